"""Every pdpatch patch, in the order they are applied."""

from __future__ import annotations

from collections.abc import Mapping

from pdpatch import config
from pdpatch.registry import Patch


def all_patches() -> list[Patch]:
    """Imported when first asked, not by the bootstrap: each is a declaration (its code is
    imported when vLLM imports a module it wraps: :class:`pdpatch.registry.Lazy`)."""
    from pdpatch.patches import (
        block_ids_bound,
        block_keys,
        division_checks,
        handshake_failure_guard,
        hma_failed_recv,
        kv_segments,
        layout,
        lease_guard,
        metrics,
        mla_notif,
        num_blocks,
        params_check,
        params_guard,
        peer_check,
        peer_restart,
        read_guard,
        readback_guard,
        side_channel_listen,
        spec_classify,
        transport_check,
    )

    # block_ids_bound and lease_guard before read_guard: read_guard wraps them (an error of
    # their checks is contained).  peer_restart first: its read-path wrapper is innermost (the
    # others' refusals come first; read_guard contains an error of its bookkeeping).
    return [peer_restart.PATCH, block_ids_bound.PATCH, lease_guard.PATCH, read_guard.PATCH,
            layout.PATCH, num_blocks.PATCH, mla_notif.PATCH, division_checks.PATCH,
            spec_classify.PATCH,
            handshake_failure_guard.PATCH, kv_segments.PATCH, block_keys.PATCH, params_check.PATCH,
            transport_check.PATCH, peer_check.PATCH, side_channel_listen.PATCH, params_guard.PATCH,
            readback_guard.PATCH, hma_failed_recv.PATCH, metrics.PATCH]


def patch_names() -> list[str]:
    return [p.name for p in all_patches()]


def read_settings(env: Mapping[str, str] | None = None) -> config.Settings:
    """The environment's settings, checked against every patch's toggle and declared option."""
    return config.read_settings(patch_names(), env)
