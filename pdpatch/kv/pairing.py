"""Which of a peer's KV regions move with which local ones, as vLLM 0.34+ pairs them.

Why: up to vLLM 0.33 a decode worker pairs the peer's regions with its own by position (from
0.30 each side's in the order of its layer names, :func:`region_sort_key`); from 0.34 it pairs
them through the layers both hold (``NixlBaseConnectorWorker._pair_regions``,
0.34.0 base_worker.py L506-608): each side lists, per region, the names of the layers it holds
(``region_members``).  Both orders can differ (a PP stage holds a slice of the peer's layers;
two layers share one region on one side only; a ``kv_caches`` dict in another order), so a
check of a peer's bytes must compare the pairs the release will transfer, not positions.

Pure: lists of layer names in, ``(remote region, local region)`` pairs out; the refusals are the
release's own (the same cases, pdpatch's words), as :class:`GeometryMismatch`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pdpatch.kv.geometry import GeometryMismatch

_DIGITS = re.compile(r"(\d+)")


def region_sort_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """vLLM's ``_region_sort_key`` (0.30+): layer names in model-layer order (numbers compared
    as numbers, ``layers.10`` after ``layers.2``), then by cache name -- the order a worker of
    0.30-0.33 registers its regions in, and so pairs a peer's with its own by position."""
    return tuple((0, int(part)) if part.isdigit() else (1, part)
                 for part in _DIGITS.split(name))


def in_region_order(names: Sequence[str]) -> list[int]:
    """Indices of ``names`` in :func:`region_sort_key` order."""
    return sorted(range(len(names)), key=lambda i: region_sort_key(names[i]))


def pair_regions_by_layer(local_members: Sequence[Sequence[str]],
                          remote_members: Sequence[Sequence[str]], *,
                          peer_may_hold_more: bool = False) -> list[tuple[int, int]]:
    """``(remote region, local region)`` pairs in the order vLLM 0.34's ``_pair_regions``
    makes them: for each layer the peer lists (in its region order), its regions in order with
    the local regions of that layer.  ``peer_may_hold_more``: this worker is a PP stage
    (``pp_size > 1``), which holds a slice of the peer's layers, so layers only the peer holds
    are skipped (L551-557).  Raises :class:`GeometryMismatch` where the release refuses the
    peer: a peer layer with no local counterpart otherwise (L558-561), a layer spanning
    different region counts (L562-565), a local layer the peer lacks (L577-582)."""
    local_by_layer: dict[str, list[int]] = {}
    for region, names in enumerate(local_members):
        for name in names:
            local_by_layer.setdefault(name, []).append(region)
    remote_by_layer: dict[str, list[int]] = {}
    for region, names in enumerate(remote_members):
        for name in names:
            remote_by_layer.setdefault(name, []).append(region)
    pairs: dict[tuple[int, int], None] = {}
    held: set[str] = set()
    for name, remote_regions in remote_by_layer.items():
        local_regions = local_by_layer.get(name)
        if local_regions is None:
            if peer_may_hold_more:
                continue
            raise GeometryMismatch(
                f"the peer holds KV layer {name!r}, which has no counterpart here (vLLM pairs "
                "regions by layer name and refuses such a peer too)")
        if len(local_regions) != len(remote_regions):
            raise GeometryMismatch(
                f"KV layer {name!r} spans {len(remote_regions)} regions on the peer and "
                f"{len(local_regions)} here (vLLM refuses such a peer too)")
        held.add(name)
        for remote, local in zip(remote_regions, local_regions, strict=True):
            pairs[(remote, local)] = None
    missing = [name for name in local_by_layer if name not in held]
    if missing:
        raise GeometryMismatch(
            f"the peer does not hold the KV layers {missing} (vLLM refuses such a peer too)")
    return list(pairs)


def pair_layers_by_name(local_names: Sequence[str], remote_names: Sequence[str], *,
                        peer_may_hold_more: bool = False) -> list[tuple[int, int]]:
    """:func:`pair_regions_by_layer` for geometries of one layer per entry (a worker's
    per-layer tensors): ``(remote layer, local layer)`` index pairs."""
    return pair_regions_by_layer([[n] for n in local_names], [[n] for n in remote_names],
                                 peer_may_hold_more=peer_may_hold_more)


__all__ = ["in_region_order", "pair_layers_by_name", "pair_regions_by_layer",
           "region_sort_key"]
