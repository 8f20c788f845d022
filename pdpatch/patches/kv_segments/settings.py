"""The ``kv_segments`` patch's names and operator settings (its counters: :mod:`.state`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pdpatch import config
from pdpatch.patches import common

NAME = "kv_segments"
FIELD = "pdpatch_kv_geometry"
BACKENDS_KEY = "kv_segments_backends"
STAGING_ENV = "PDPATCH_KV_STAGING_MIB"    # passed to the staging agent, named in its messages
STAGING_DEFAULT_MIB = 128
GAP_ENV = "PDPATCH_KV_GAP_KIB"            # likewise; unset or "auto": measured per peer

# Backends whose K and V are plain [block, token, head, dim] arrays (split or fused), so that a
# byte-level conversion is meaningful.  Not CPU_ATTN (from 0.23 vLLM re-packs its cache after a
# transfer from another backend: `pack_kv_cache`), not MLA backends (one latent, several
# incompatible page formats).
INTERCHANGEABLE: tuple[str, ...] = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


def allowed(obj: Any) -> bool:
    """Whether the deployment's extra config leaves this patch on for ``obj``'s engine."""
    return common.allowed(NAME, obj)


def interchangeable(vllm_config: Any) -> frozenset[str]:
    """:data:`INTERCHANGEABLE` plus the names an operator added in the extra config."""
    names = set(INTERCHANGEABLE)
    section = (common.connector_extra_config(vllm_config) or {}).get(config.EXTRA_CONFIG_KEY)
    more = section.get(BACKENDS_KEY) if isinstance(section, Mapping) else None
    if more is not None:
        if not isinstance(more, list) or not all(isinstance(x, str) for x in more):
            raise config.ConfigError(
                f'kv_connector_extra_config["{config.EXTRA_CONFIG_KEY}"]["{BACKENDS_KEY}"] must '
                f"be a list of attention backend names, got {more!r}")
        names.update(more)
    return frozenset(names)


def staging_mib(env: Mapping[str, str] | None = None) -> int:
    """``PDPATCH_KV_STAGING_MIB``: MiB of staging per decode worker for converted READs."""
    value = _size_setting(env, STAGING_ENV, "MiB", f"0 turns staging off; default "
                          f"{STAGING_DEFAULT_MIB}", auto=False)
    return STAGING_DEFAULT_MIB if value is None else value


def gap_kib(env: Mapping[str, str] | None = None) -> int | None:
    """``PDPATCH_KV_GAP_KIB``: KiB a staged READ may read between requested blocks; None
    (unset or ``auto``) measures it per peer."""
    return _size_setting(env, GAP_ENV, "KiB", "0 turns gap reads off; unset or 'auto' "
                         "measures the transport per peer", auto=True)


def _size_setting(env: Mapping[str, str] | None, name: str, unit: str, hint: str, *,
                  auto: bool) -> int | None:
    """A size >= 0 from ``name``; None when unset (or ``auto``, where ``auto`` is allowed);
    ConfigError naming the variable otherwise."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw or (auto and raw.lower() == "auto"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise config.ConfigError(f"{name}={raw!r} is not a number of {unit} >= 0 ({hint})")
    return value
