"""Every pdpatch patch, in the order they are applied."""

from __future__ import annotations

from pdpatch.registry import Patch


def all_patches() -> list[Patch]:
    """Imported lazily: patch modules are tiny, but the bootstrap should not pay for them."""
    from pdpatch.patches import (
        division_checks,
        handshake_failure_guard,
        kv_segments,
        layout,
        mla_notif,
        num_blocks,
        read_guard,
        spec_classify,
    )

    return [read_guard.PATCH, layout.PATCH, num_blocks.PATCH, mla_notif.PATCH,
            division_checks.PATCH, spec_classify.PATCH, handshake_failure_guard.PATCH,
            kv_segments.PATCH]


def patch_names() -> list[str]:
    return [p.name for p in all_patches()]
