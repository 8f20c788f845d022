"""The code of patch ``division_checks``, loaded when vLLM imports the NIXL worker (the patch and
why it exists: :mod:`pdpatch.patches.division_checks`)."""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from pdpatch import metrics, vllm_sites
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.division_checks import NAME
from pdpatch.registry import Wrapper


class GeometryNotDivisible(ValueError):
    """A peer's geometry would make the release's descriptor maths truncate."""


def _block_count_problems(worker: Any, meta: Any) -> list[str]:
    num_blocks = meta.num_blocks
    ppl = getattr(meta, "physical_blocks_per_logical_kv_block", None)
    if ppl is not None:
        if isinstance(ppl, int) and ppl >= 1 and isinstance(num_blocks, int) and \
                num_blocks % ppl:
            return [f"num_blocks {num_blocks} is not a multiple of "
                    f"physical_blocks_per_logical_kv_block {ppl} (descriptor ids would use "
                    f"{num_blocks} // {ppl} logical blocks)"]
    elif getattr(worker, "_has_mamba", False):
        ratio = worker._physical_blocks_per_logical_kv_block
        if num_blocks % ratio:
            return [f"num_blocks {num_blocks} is not a multiple of the local "
                    f"physical_blocks_per_logical_kv_block {ratio} (Mamba descriptor ids "
                    f"would use {num_blocks} // {ratio})"]
    return []


def _split_lens(worker: Any, i: int, version: Version) -> list[int]:
    """The byte length(s) of local region ``i`` that the release divides."""
    if vllm_sites.split_len_source(version) == "backend_aware" and \
            hasattr(worker, "get_backend_aware_kv_block_len"):
        return sorted({int(worker.get_backend_aware_kv_block_len(
            layer_idx=i, first_split=first, mamba_view=False)) for first in (True, False)})
    return [int(worker.block_len_per_layer[i])]


def _head_problems(worker: Any, remote_tp: int, version: Version) -> list[str]:
    """A peer TP that does not divide the KV heads, and what its head slices would lose."""
    topo = vllm_sites.topology(worker, version)
    heads = int(topo.total_num_kv_heads)
    local_tp = int(topo.tp_size)
    if getattr(worker, "use_mla", False) or remote_tp >= heads or heads % remote_tp == 0:
        return []
    out = [f"peer TP {remote_tp} does not divide the model's {heads} KV heads "
           f"({heads / remote_tp:g} heads per rank)"]
    if remote_tp > local_tp:
        reads = remote_tp // local_tp
        bad: dict[int, list[int]] = {}
        for i in range(len(worker.block_len_per_layer)):
            for length in _split_lens(worker, i, version):
                if length % reads:
                    bad.setdefault(length, []).append(i)
        out += [f"local region(s) {regions} block length {length} B is not divisible by "
                f"{reads} reads (peer TP {remote_tp} / local TP {local_tp}): each read would "
                f"cover {length // reads} B and leave {length % reads} B of every block "
                f"untransferred" for length, regions in bad.items()]
    return out


def problems(worker: Any, meta: Any, remote_tp: int, version: Version) -> list[str]:
    """Every way ``meta`` (one rank of a peer with TP ``remote_tp``), as the release will use
    it, would truncate; [] also where the worker lacks what the check reads."""
    try:
        found = _block_count_problems(worker, meta) + _head_problems(worker, remote_tp,
                                                                      version)
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return []
    peer = getattr(meta, "engine_id", "?")
    return [f"peer {peer}: {p}" for p in found]


def make_check(version: Version) -> Wrapper:
    def check_geometry(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if allowed(NAME, instance):
            meta = arg(args, kwargs, 0, "nixl_agent_meta")
            remote_tp = arg(args, kwargs, 1, "remote_tp_size")
            found = problems(instance, meta, remote_tp, version)
            if found:
                metrics.count(instance, metrics.REFUSALS, NAME)
                raise GeometryNotDivisible(
                    "pdpatch: NIXL handshake rejected, the descriptor maths would truncate: "
                    + "; ".join(found) + " [division_checks]")
        return result

    return check_geometry
