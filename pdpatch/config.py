"""pdpatch settings, read from the environment at the moment they are needed.

Why read late: on Ray the driver's environment reaches an actor only after the interpreter
started (vLLM copies it in ``initialize_worker``), so nothing here is cached at import time.

Every variable is declared once, at the end of this module (``GLOBAL_SETTINGS``, and
``PATCH_OPTIONS`` for the options of single patches): values, range, unit, default, meaning.
None is ``VLLM_``-prefixed (vLLM warns or fails on unknown ``VLLM_*`` names).

The same settings may also come from ``kv_transfer_config.kv_connector_extra_config["pdpatch"]``
(a dict: ``{"disable": [...], "<name>": bool}``), which travels inside ``VllmConfig`` to every
process; wrappers that have that config at hand consult it per call.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

MASTER_VARS = ("ENABLE_PDPATCH", "PDPATCH_ENABLED")
GLOBAL_VARS = ("PDPATCH_DISABLE", "PDPATCH_STRICT", "PDPATCH_ALLOW_UNTESTED_VLLM",
               "PDPATCH_LOG_LEVEL", "PDPATCH_ENABLED")
EXTRA_CONFIG_KEY = "pdpatch"


class ConfigError(ValueError):
    """An invalid pdpatch setting; the message names the variable and the accepted values."""


def toggle_var(patch_name: str) -> str:
    """The per-patch environment variable, e.g. ``num_blocks`` -> ``PDPATCH_NUM_BLOCKS``."""
    return "PDPATCH_" + patch_name.upper()


def parse_bool(var: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(
        f"{var}={raw!r} is not a valid value; accepted: "
        f"{', '.join(w for w in TRUE_WORDS)} (on) or {', '.join(w for w in FALSE_WORDS if w)} (off)"
    )


class Settings(NamedTuple):
    """One consistent reading of the environment.  (Settings and :class:`Setting` are
    NamedTuples, not frozen dataclasses: this module is imported inside every ``import vllm``,
    where defining a frozen dataclass costs ~0.5 ms.)"""

    enabled: bool
    enabled_source: str
    strict: bool
    allow_untested: bool
    log_level: str
    disabled: frozenset[str]          # from PDPATCH_DISABLE ('*' expanded)
    overrides: Mapping[str, bool]     # from PDPATCH_<NAME>

    def patch_toggle(self, name: str) -> tuple[bool, str]:
        """Whether patch ``name`` is switched on by the environment, and why (for the summary)."""
        if name in self.overrides:
            on = self.overrides[name]
            return on, f"{toggle_var(name)}={'1' if on else '0'}"
        if name in self.disabled:
            return False, "listed in PDPATCH_DISABLE"
        return True, "default"


def master_enabled(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """The master switch alone, cheap enough for an import hook."""
    env = os.environ if env is None else env
    for var in MASTER_VARS:
        if var in env:
            return ENABLE.parse(env[var], var), var
    return False, "ENABLE_PDPATCH unset"


def read_settings(patch_names: Iterable[str], env: Mapping[str, str] | None = None) -> Settings:
    """Parse and check every ``PDPATCH_*`` variable against its declaration
    (:data:`GLOBAL_SETTINGS`, :data:`PATCH_OPTIONS`); unknown names and bad values raise
    ``ConfigError`` naming the variable and the valid values."""
    env = os.environ if env is None else env
    known = set(patch_names)
    options = {s.var: s for s in PATCH_OPTIONS}
    enabled, source = master_enabled(env)
    if "ENABLE_PDPATCH" in env and "PDPATCH_ENABLED" in env:
        a = parse_bool("ENABLE_PDPATCH", env["ENABLE_PDPATCH"])
        b = parse_bool("PDPATCH_ENABLED", env["PDPATCH_ENABLED"])
        if a != b:
            raise ConfigError("ENABLE_PDPATCH and PDPATCH_ENABLED disagree; set only one of them")

    disabled = _parse_disable(env.get("PDPATCH_DISABLE", ""), known)
    overrides: dict[str, bool] = {}
    for var, raw in env.items():
        if var in options:
            options[var].parse(raw)
        if not var.startswith("PDPATCH_") or var in GLOBAL_VARS or var in options:
            continue
        name = var[len("PDPATCH_"):].lower()
        if name not in known:
            raise ConfigError(
                f"{var} names no pdpatch setting or patch; accepted variables: "
                f"{', '.join(sorted(GLOBAL_VARS + tuple(options)))}, and "
                f"{', '.join(toggle_var(n) for n in sorted(known))}"
            )
        overrides[name] = TOGGLE.parse(raw, var)

    return Settings(
        enabled=enabled,
        enabled_source=source,
        strict=STRICT.read(env),
        allow_untested=ALLOW_UNTESTED.read(env),
        log_level=LOG_LEVEL.read(env),
        disabled=disabled,
        overrides=overrides,
    )


def _parse_disable(raw: str, known: set[str]) -> frozenset[str]:
    names = {part.strip().lower() for part in raw.split(",") if part.strip()}
    if "*" in names:
        return frozenset(known)
    unknown = names - known
    if unknown:
        raise ConfigError(
            f"PDPATCH_DISABLE={raw!r} names unknown patch(es) {', '.join(sorted(unknown))}; "
            f"accepted: {', '.join(sorted(known))} or *"
        )
    return frozenset(names)


def extra_config_allows(patch_name: str, kv_connector_extra_config: Mapping | None) -> bool:
    """Per-deployment toggle from ``kv_connector_extra_config["pdpatch"]``.

    Wrappers call this with the connector's extra config so one engine can switch a patch off
    without touching the environment of every process.  Absent config means allowed.
    """
    if not kv_connector_extra_config:
        return True
    section = kv_connector_extra_config.get(EXTRA_CONFIG_KEY)
    if section is None:
        return True
    if not isinstance(section, Mapping):
        raise ConfigError(
            f'kv_connector_extra_config["{EXTRA_CONFIG_KEY}"] must be an object, '
            f"got {type(section).__name__}"
        )
    if patch_name in section:
        value = section[patch_name]
        if not isinstance(value, bool):
            raise ConfigError(
                f'kv_connector_extra_config["{EXTRA_CONFIG_KEY}"]["{patch_name}"] must be '
                f"true or false, got {value!r}"
            )
        return value
    disable = section.get("disable", [])
    if disable == "*":
        return False
    if not isinstance(disable, list):
        raise ConfigError(
            f'kv_connector_extra_config["{EXTRA_CONFIG_KEY}"]["disable"] must be a list of '
            f'patch names or "*", got {disable!r}'
        )
    return patch_name not in disable


# ---------------------------------------------------------------------------- declared settings
#
# Every environment variable pdpatch reads, declared once: its values, range, unit, default and
# meaning.  The parsers below and in the patches use these declarations, `read_settings` checks
# every one that is set (so `pdpatch doctor` and startup reject a bad value before a patch would
# read it), and `scripts/doc_tables.py` writes the README's settings table from them.


class Setting(NamedTuple):
    """One ``PDPATCH_*`` variable (or the master switch).

    ``kind``: ``switch`` (on/off words), ``int`` (a whole number in ``minimum..maximum``, in
    ``unit``; ``auto``, when set, is a word meaning "pdpatch decides"), ``choice`` (one of
    ``choices``), ``names`` (patch names, checked against the registry by ``read_settings``),
    ``level`` (a logging level).  ``default`` is the value as it would be written; ``patch``
    names the patch whose option it is ("" for global settings).
    """

    var: str
    kind: str
    default: str
    doc: str
    unit: str = ""
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    auto: str = ""
    patch: str = ""

    def accepted(self) -> str:
        """The valid values, as the README and every error message state them."""
        if self.kind == "switch":
            return "1/true/yes/on or 0/false/no/off"
        if self.kind == "int":
            span = (f"{self.minimum}-{self.maximum}" if self.maximum is not None
                    else f"{self.minimum} or more")
            return f"{span} {self.unit}" + (f", or `{self.auto}`" if self.auto else "")
        if self.kind in ("choice", "level"):
            return " / ".join(self.choices)
        return "`name,name` or `*`"

    def parse(self, raw: str | None, var: str | None = None):
        """The value of ``raw`` (None or blank: the default); ``ConfigError`` naming the
        variable (``var`` for a pattern such as ``PDPATCH_<NAME>``) and the valid range."""
        text = (self.default if raw is None or not raw.strip() else raw).strip()
        invalid = ConfigError(f"{var or self.var}={raw!r} is not a valid value; accepted: "
                              f"{self.accepted()} (default {self.default or 'unset'})")
        if self.kind == "switch":
            try:
                return parse_bool(var or self.var, text)
            except ConfigError:
                raise invalid from None
        if self.kind == "int":
            if self.auto and text.lower() == self.auto:
                return None
            try:
                value = int(text)
            except ValueError:
                raise invalid from None
            if value < (self.minimum or 0) or (self.maximum is not None and value > self.maximum):
                raise invalid
            return value
        if self.kind in ("choice", "level"):
            word = text.upper() if self.kind == "level" else text.lower()
            if word not in self.choices:
                raise invalid
            return word
        return text

    def read(self, env: Mapping[str, str] | None = None):
        """This setting's value in ``env`` (default ``os.environ``), parsed."""
        return self.parse((os.environ if env is None else env).get(self.var))


ENABLE = Setting("ENABLE_PDPATCH", "switch", "0",
                 "master switch (alias `PDPATCH_ENABLED`); off: pdpatch changes nothing")
DISABLE = Setting("PDPATCH_DISABLE", "names", "",
                  "patches to leave off (`*`: all of them)")
TOGGLE = Setting("PDPATCH_<NAME>", "switch", "1",
                 "one patch on or off (the patch table's \"turn off\" column); wins over "
                 "`PDPATCH_DISABLE`")
STRICT = Setting("PDPATCH_STRICT", "switch", "0",
                 "an enabled patch that cannot apply, or an invalid setting, stops startup")
ALLOW_UNTESTED = Setting(
    "PDPATCH_ALLOW_UNTESTED_VLLM", "switch", "0",
    "on a vLLM newer than pdpatch verified, apply the patches whose vLLM code changed too (those "
    "whose code is unchanged apply by themselves; every process warns which are off and why); "
    "never on an older vLLM, never a patch vLLM made unneeded")
LOG_LEVEL = Setting("PDPATCH_LOG_LEVEL", "level", "INFO", "level of the `pdpatch` logger",
                    choices=LOG_LEVELS)
LAYOUT_FORCE = Setting("PDPATCH_LAYOUT_FORCE", "switch", "0",
                       "token-major KV layout even where kvcached does not allocate the KV",
                       patch="layout")
LAYOUT_PERMUTE = Setting(
    "PDPATCH_LAYOUT_PERMUTE", "switch", "1",
    "a token-major decode engine turns on vLLM's own `enable_permute_local_kv` (0.19-0.34), "
    "so stock head-major prefill engines pair with it", patch="layout")
BLOCK_KEYS_ON_MISMATCH = Setting(
    "PDPATCH_BLOCK_KEYS_ON_MISMATCH", "choice", "recompute",
    "on a P/D block-key mismatch: compute the prompt locally, or only warn and load P's KV",
    choices=("recompute", "warn"), patch="block_keys")
KV_STAGING_MIB = Setting(
    "PDPATCH_KV_STAGING_MIB", "int", "128",
    "staging memory per decode worker for a converted peer's READs (0.19-0.25) and, with "
    "`PDPATCH_KV_COALESCE`, a same-layout peer's (allocated at the first staged READ, or "
    "at start-up with `PDPATCH_KV_COALESCE`); 0 turns staging off", unit="MiB",
    minimum=0, maximum=65536, patch="kv_segments")
KV_GAP_KIB = Setting(
    "PDPATCH_KV_GAP_KIB", "int", "auto",
    "bytes a staged READ may read between requested blocks to merge descriptors; 0 turns gap "
    "reads off, `auto` measures the transport per peer", unit="KiB", minimum=0,
    maximum=1048576, auto="auto", patch="kv_segments")
KV_COALESCE = Setting(
    "PDPATCH_KV_COALESCE", "switch", "0",
    "stage the READs of same-layout peers too (0.19-0.34): runs of adjacent blocks move in one "
    "descriptor instead of one per block and layer, then one local copy; off: vLLM's own READs",
    patch="kv_segments")

GLOBAL_SETTINGS: tuple[Setting, ...] = (ENABLE, DISABLE, TOGGLE, STRICT, ALLOW_UNTESTED,
                                        LOG_LEVEL)
PEER_DEADLINE_S = Setting(
    "PDPATCH_PEER_DEADLINE_S", "int", "60",
    "a decode request whose READ from a prefill engine, or whose wait for its handshake, lasts "
    "longer than this is failed (READs released) instead of waiting on a stalled peer; 0: no "
    "deadline, as vLLM", unit="s", minimum=0, maximum=86400, patch="peer_restart")
PATCH_OPTIONS: tuple[Setting, ...] = (LAYOUT_FORCE, LAYOUT_PERMUTE, BLOCK_KEYS_ON_MISMATCH,
                                      KV_STAGING_MIB, KV_GAP_KIB, KV_COALESCE, PEER_DEADLINE_S)
