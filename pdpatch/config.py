"""pdpatch settings, read from the environment at the moment they are needed.

Why read late: on Ray the driver's environment reaches an actor only after the interpreter
started (vLLM copies it in ``initialize_worker``), so nothing here is cached at import time.

Variables (never ``VLLM_``-prefixed: vLLM warns or fails on unknown ``VLLM_*`` names):

==============================  ==========================================================
``ENABLE_PDPATCH``              master switch (alias ``PDPATCH_ENABLED``); default off
``PDPATCH_DISABLE``             comma list of patch names, or ``*`` for all
``PDPATCH_<NAME>``              ``1``/``0`` for one patch; wins over ``PDPATCH_DISABLE``
``PDPATCH_STRICT``              a patch that is enabled but cannot apply stops startup
``PDPATCH_ALLOW_UNTESTED_VLLM`` apply patches outside their declared vLLM versions
``PDPATCH_LOG_LEVEL``           level of the ``pdpatch`` logger (default INFO)
==============================  ==========================================================

The same settings may also come from ``kv_transfer_config.kv_connector_extra_config["pdpatch"]``
(a dict: ``{"disable": [...], "<name>": bool}``), which travels inside ``VllmConfig`` to every
process; wrappers that have that config at hand consult it per call.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Settings:
    """One consistent reading of the environment."""

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
            return parse_bool(var, env[var]), var
    return False, "ENABLE_PDPATCH unset"


def read_settings(patch_names: Iterable[str], env: Mapping[str, str] | None = None,
                  option_vars: Iterable[str] = ()) -> Settings:
    """Parse every ``PDPATCH_*`` variable; unknown names and bad values raise ``ConfigError``.

    ``option_vars`` are the extra variables patches declare (``Patch.options``); each patch
    parses its own, this only keeps them from being taken for typos.
    """
    env = os.environ if env is None else env
    known = set(patch_names)
    options = set(option_vars)
    enabled, source = master_enabled(env)
    if "ENABLE_PDPATCH" in env and "PDPATCH_ENABLED" in env:
        a = parse_bool("ENABLE_PDPATCH", env["ENABLE_PDPATCH"])
        b = parse_bool("PDPATCH_ENABLED", env["PDPATCH_ENABLED"])
        if a != b:
            raise ConfigError("ENABLE_PDPATCH and PDPATCH_ENABLED disagree; set only one of them")

    disabled = _parse_disable(env.get("PDPATCH_DISABLE", ""), known)
    overrides: dict[str, bool] = {}
    for var, raw in env.items():
        if not var.startswith("PDPATCH_") or var in GLOBAL_VARS or var in options:
            continue
        name = var[len("PDPATCH_"):].lower()
        if name not in known:
            raise ConfigError(
                f"{var} names no pdpatch setting or patch; accepted variables: "
                f"{', '.join(sorted(GLOBAL_VARS + tuple(options)))}, and "
                f"{', '.join(toggle_var(n) for n in sorted(known))}"
            )
        overrides[name] = parse_bool(var, raw)

    level = env.get("PDPATCH_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        raise ConfigError(
            f"PDPATCH_LOG_LEVEL={env['PDPATCH_LOG_LEVEL']!r} is not a valid value; "
            f"accepted: {', '.join(LOG_LEVELS)}"
        )
    return Settings(
        enabled=enabled,
        enabled_source=source,
        strict=parse_bool("PDPATCH_STRICT", env.get("PDPATCH_STRICT", "0")),
        allow_untested=parse_bool(
            "PDPATCH_ALLOW_UNTESTED_VLLM", env.get("PDPATCH_ALLOW_UNTESTED_VLLM", "0")),
        log_level=level,
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
