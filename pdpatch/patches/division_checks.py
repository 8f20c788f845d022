"""Patch ``division_checks``: a peer whose geometry does not divide evenly is rejected at
handshake time, with the numbers, instead of being read with truncated descriptors.

The decode worker turns a peer's metadata into descriptor lengths and ids with unchecked floor
divisions (PR #40731 review; research notes §6(b)):

* ``_compute_desc_ids``: ``logical_blocks = dst_num_blocks // physical_blocks_per_logical``
  (0.33 ``base_worker.py`` L237; 0.19 ``_get_block_descs_ids`` L2770 with the *local* ratio);
* ``_build_local_splits_from_plan``: ``handle[fa_split, 1] //= fa_num_splits`` (0.33 L335;
  0.21 ``chunk = local_len // num_splits``; 0.19 inline ``local_block_len // (-tp_ratio)``);
* ``_build_fa_remote``: ``local_block_len // block_size_ratio`` and ``// num_reads``
  (0.33 L2224, L2241; 0.19 closure in ``add_remote_agent`` L1981/L1988).

When a division is not exact, each READ covers ``len // n`` bytes: bytes of every block are
never transferred, slices start mid-element, and a slice can run past the peer's block into
the next one.  Nothing reports it.  Stock validation does not catch it either, because it uses
the same floor arithmetic (``remote_len == local_len * remote_heads // local_heads`` with
``remote_heads = max(1, total_kv_heads // remote_tp)``).  Well-formed vLLM peers always divide
evenly (vLLM refuses a TP that does not divide the KV heads, block lengths scale with heads and
tokens); a peer that does not is misconfigured or malformed.

The fix is a pre-hook on ``add_remote_agent`` (the handshake thread: raising there fails only
the requests waiting for that peer, through the release's own handshake-failure path).  It
checks, before anything is registered:

1. the peer's ``num_blocks`` is a multiple of its ``physical_blocks_per_logical_kv_block``
   (0.21+; 0.19/0.20 divide by the local ratio, which matters only with Mamba groups);
2. the local and remote block sizes divide (the release asserts this later, less clearly);
3. each side's TP size divides the model's KV heads (when TP does not exceed them), so a head
   slice is whole heads;
4. every per-region length the release will divide is divisible by
   ``block_size_ratio x reads`` (reads = remote TP / local TP for head-split regions; MLA and
   other replicated regions are read whole).

It raises ``ValueError`` listing every failed check.  SSM sub-splits of Mamba state (the
``ssm_num_splits`` division) are not checked: their sizes come from per-release conv
decompositions this patch does not model.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.patches.read_guard import allowed
from pdpatch.registry import Patch, Target, Wrapper

NAME = "division_checks"


class GeometryNotDivisible(ValueError):
    """A peer's geometry would make the release's descriptor maths truncate."""


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _kv_heads(worker: Any) -> int | None:
    model_config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    try:
        return int(model_config.get_total_num_kv_heads())
    except Exception:
        return None


def _split_lens(worker: Any, i: int, source: str | None) -> list[int]:
    """The byte length(s) of local region ``i`` that the release divides."""
    if source == "backend_aware" and hasattr(worker, "get_backend_aware_kv_block_len"):
        return sorted({int(worker.get_backend_aware_kv_block_len(
            layer_idx=i, first_split=first, mamba_view=False)) for first in (True, False)})
    return [int(worker.block_len_per_layer[i])]


def problems(worker: Any, meta: Any, remote_tp: int, version: Version) -> list[str]:
    """Every way ``meta`` (one rank of a peer with TP ``remote_tp``) would truncate."""
    out: list[str] = []
    peer = getattr(meta, "engine_id", "?")
    num_blocks = meta.num_blocks
    ppl = getattr(meta, "physical_blocks_per_logical_kv_block", None)
    if ppl is not None:
        if not isinstance(ppl, int) or ppl < 1:
            out.append(f"physical_blocks_per_logical_kv_block is {ppl!r}, not a positive int")
        elif not isinstance(num_blocks, int) or num_blocks % ppl:
            out.append(f"num_blocks {num_blocks} is not a multiple of "
                       f"physical_blocks_per_logical_kv_block {ppl} (descriptor ids would use "
                       f"{num_blocks} // {ppl} logical blocks)")
    elif getattr(worker, "_has_mamba", False):
        ratio = worker._physical_blocks_per_logical_kv_block
        if num_blocks % ratio:
            out.append(f"num_blocks {num_blocks} is not a multiple of the local "
                       f"physical_blocks_per_logical_kv_block {ratio} (Mamba descriptor ids "
                       f"would use {num_blocks} // {ratio})")

    local_bs, remote_bs = worker.block_size, meta.block_size
    bsr = 1
    if not isinstance(remote_bs, int) or remote_bs < 1:
        out.append(f"block_size is {remote_bs!r}, not a positive int")
    elif remote_bs < local_bs:
        if local_bs % remote_bs:
            out.append(f"local block size {local_bs} is not a multiple of the peer's "
                       f"{remote_bs}")
        else:
            bsr = local_bs // remote_bs

    local_tp = int(getattr(worker, "world_size", 1) or 1)
    if not isinstance(remote_tp, int) or remote_tp < 1:
        out.append(f"remote TP size is {remote_tp!r}, not a positive int")
        return out
    heads = _kv_heads(worker)
    use_mla = bool(getattr(worker, "use_mla", False))
    if heads and not use_mla:
        for side, tp in (("local", local_tp), ("peer", remote_tp)):
            if tp < heads and heads % tp:
                out.append(f"{side} TP {tp} does not divide the model's {heads} KV heads "
                           f"({heads / tp:g} heads per rank)")
    reads = remote_tp // local_tp if remote_tp > local_tp else 1
    if remote_tp > local_tp and remote_tp % local_tp:
        out.append(f"peer TP {remote_tp} is not a multiple of local TP {local_tp}")
    replicated_kv = bool(heads) and remote_tp > heads
    source = vllm_sites.split_len_source(version)
    is_replicated = getattr(worker, "_is_region_replicated", None)
    bad: dict[tuple[int, int, bool], list[int]] = {}       # (length, n, whole) -> regions
    for i in range(len(worker.block_len_per_layer)):
        whole = use_mla or replicated_kv or (is_replicated is not None and is_replicated(i))
        n = bsr * (1 if whole else reads)
        for length in _split_lens(worker, i, source):
            if n > 1 and length % n:
                bad.setdefault((length, n, whole), []).append(i)
    for (length, n, whole), regions in bad.items():
        what = f"block_size_ratio {bsr}" if whole or reads == 1 else \
            f"block_size_ratio {bsr} x {reads} reads (peer TP {remote_tp} / local TP {local_tp})"
        out.append(f"local region(s) {regions} block length {length} B is not divisible by "
                   f"{what}: each read would cover {length // n} B and leave "
                   f"{length - (length // n) * n} B of every block untransferred")
    return [f"peer {peer}: {p}" for p in out]


def make_check(version: Version) -> Wrapper:
    def check_geometry(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if allowed(NAME, instance):
            meta = _arg(args, kwargs, 0, "nixl_agent_meta", None)
            remote_tp = _arg(args, kwargs, 2, "remote_tp_size", 1)
            found = problems(instance, meta, remote_tp, version)
            if found:
                raise GeometryNotDivisible(
                    "pdpatch: NIXL handshake rejected, the descriptor maths would truncate: "
                    + "; ".join(found) + " [division_checks]")
        return wrapped(*args, **kwargs)

    return check_geometry


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.ADD_REMOTE_AGENT, version)
    return [] if site is None else [Target(site.module, site.qualname, make_check(version))]


PATCH = Patch(
    name=NAME,
    summary="reject at handshake a peer geometry that the descriptor maths would truncate",
    versions=">=0.19,<0.34",
    why_version="the unchecked divisions were checked in 0.19-0.33 only",
    targets=_targets,
)
