"""The ``kv_segments`` patch's names and operator settings (its counters: :mod:`.state`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdpatch import config
from pdpatch.patches import common
from pdpatch.patches.kv_segments import NAME

FIELD = "pdpatch_kv_geometry"
BACKENDS_KEY = "kv_segments_backends"
STAGING_ENV = config.KV_STAGING_MIB.var   # passed to the staging agent, named in its messages
STAGING_DEFAULT_MIB = int(config.KV_STAGING_MIB.default)
COALESCE_ENV = config.KV_COALESCE.var
GAP_ENV = config.KV_GAP_KIB.var           # likewise; unset or "auto": measured per peer

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
    return config.KV_STAGING_MIB.read(env)


def gap_kib(env: Mapping[str, str] | None = None) -> int | None:
    """``PDPATCH_KV_GAP_KIB``: KiB a staged READ may read between requested blocks; None
    (unset or ``auto``) measures it per peer."""
    return config.KV_GAP_KIB.read(env)


def coalesce(env: Mapping[str, str] | None = None) -> bool:
    """``PDPATCH_KV_COALESCE``: stage the READs of peers stock code serves (same layout) too."""
    return config.KV_COALESCE.read(env)
