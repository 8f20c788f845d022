"""The code of patch ``num_blocks``, loaded when vLLM imports the NIXL worker (the patch and why it
exists: :mod:`pdpatch.patches.num_blocks`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from packaging.version import Version

from pdpatch import config, kvcached, vllm_sites
from pdpatch.installer import state_of
from pdpatch.log import logger
from pdpatch.patches.num_blocks import NAME
from pdpatch.state import State

if TYPE_CHECKING:          # the reconciliation core is imported when a worker registers its KV
    from pdpatch.block_counts import LayerBlocks

MODE_KEY = "num_blocks_mode"


@dataclass
class NumBlocksState(State):
    in_charge: str = ""          # pdpatch | kvcached | stock
    kvcached_patch_seen: bool = False
    last: str = ""               # last reconciliation, human readable


def _version() -> Version:
    return vllm_sites.running_release()


def _extra(worker: Any) -> Mapping | None:
    ktc = getattr(getattr(worker, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) if ktc is not None else None
    return extra if isinstance(extra, Mapping) else None


def mode_of(extra: Mapping | None) -> str:
    from pdpatch.block_counts import MODE_SLICE, MODES

    section = (extra or {}).get(config.EXTRA_CONFIG_KEY)
    if not isinstance(section, Mapping) or MODE_KEY not in section:
        return MODE_SLICE
    mode = section[MODE_KEY]
    if mode not in MODES:
        raise config.ConfigError(
            f'kv_connector_extra_config["{config.EXTRA_CONFIG_KEY}"]["{MODE_KEY}"]={mode!r} is '
            f"not valid; accepted: {', '.join(repr(m) for m in MODES)}")
    return mode


# ------------------------------------------------------------------------------ the wrapper


def reconcile_register(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from pdpatch.block_counts import MODE_SLICE, BlockCountError, reconcile

    worker = instance
    if "kv_caches" in kwargs:
        kwargs = dict(kwargs)
        kv_caches, rest = kwargs.pop("kv_caches"), args
    else:
        kv_caches, rest = args[0], args[1:]
    extra = _extra(worker)
    kvc_patch = kvcached.register_patched(type(worker))
    if not config.extra_config_allows(NAME, extra):
        _note("kvcached" if kvc_patch else "stock", kvc_patch, "switched off by extra config")
        return wrapped(kv_caches, *rest, **kwargs)
    plan = _plan(worker, kv_caches)
    if plan is None or not _needed(plan, kvc_patch):
        # vLLM's own tensors, exactly as it planned them: its registration is right as it is
        # (0.30+ also registers views pdpatch does not model: padding tails, packed rows,
        # host pools), so it runs untouched.
        _note("kvcached" if kvc_patch else "stock", kvc_patch,
              "no over-allocated KV tensor and no kvcached allocation: vLLM's registration")
        return wrapped(kv_caches, *rest, **kwargs)
    layers, logical, ratio, planned, kv_cache_config = plan
    mode = mode_of(extra)
    context = (f" (kv_cache_config.num_blocks={logical} x {ratio} kernel blocks per block, "
               f"engine {getattr(worker, 'engine_id', '?')}, TP rank "
               f"{getattr(worker, 'tp_rank', '?')})")
    rec = reconcile(layers, planned, mode, context=context)
    if rec.over_allocated and getattr(worker, "_has_mamba", False):
        raise BlockCountError(
            f"pdpatch num_blocks: over-allocated KV tensors in a hybrid (Mamba) model are not "
            f"supported{context}; Mamba state regions use a different block count")
    neutralized = _restore_counts(worker, planned, logical, rec)
    if mode == MODE_SLICE:
        new_caches = _sliced(kv_caches, rec)
        if vllm_sites.registers_whole_storage(_version()):
            # Also for exactly-sized views whose storage has a tail (a VMM reservation rounded
            # up to its page): 0.29/0.30 treat any tail as "not block-major" and refuse.
            new_caches = _rebased(new_caches, [lb.name for lb in rec.layers])
    else:
        new_caches = kv_caches
        _advertise_virtual(worker, rec, ratio, kv_cache_config)
    result = wrapped(new_caches, *rest, **kwargs)
    verify_advertised(worker, rec.target)
    summary = rec.describe() + (" ; kvcached's num_blocks rewrite undone" if neutralized else "")
    _note("pdpatch", kvc_patch, summary)
    if rec.changed or neutralized:
        logger.info("pdpatch num_blocks: %s%s", summary, context)
    return result


class _Plan(NamedTuple):
    layers: list[LayerBlocks]
    logical: int                 # kv_cache_config.num_blocks
    ratio: int                   # kernel blocks per logical block
    planned: int                 # kernel blocks the scheduler may address
    kv_cache_config: Any


def _plan(worker: Any, kv_caches: Any) -> _Plan | None:
    """What the engine planned, or None where the worker or its caches are not what this patch
    models (a stand-in worker, no attention tensor)."""
    try:
        ratio = int(getattr(worker, "_physical_blocks_per_logical_kv_block", 1) or 1)
        kv_cache_config = getattr(worker, "kv_cache_config", None)
        logical = int(getattr(kv_cache_config, "num_blocks", 0) or worker._logical_num_blocks)
        layers = _layer_blocks(worker, kv_caches)
    except (AttributeError, TypeError, ValueError):
        return None
    if not layers:
        return None
    return _Plan(layers, logical, ratio, logical * ratio, kv_cache_config)


def _needed(plan: _Plan, kvc_patch: bool) -> bool:
    """Whether stock registration would be wrong here: a tensor holds more blocks than
    planned (0.19-0.29 assert, 0.30+ mis-partition it), or kvcached allocated the tensors or
    rewrote the counts (its views carry its virtual range as their storage)."""
    if kvc_patch or any(lb.count > plan.planned for lb in plan.layers):
        return True
    state = kvcached.read_state()
    return state.in_deployment or state.allocated


def _note(in_charge: str, kvc_patch: bool, last: str) -> None:
    state = state_of(NAME)
    with state.lock:
        state.in_charge, state.kvcached_patch_seen, state.last = in_charge, kvc_patch, last


def _layer_blocks(worker: Any, kv_caches: Mapping[str, Any]) -> list[LayerBlocks]:
    """Attention tensors whose block dimension is known; Mamba state tuples, flat byte views and
    host-resident (HiSparse) groups keep vLLM's own handling."""
    from pdpatch.block_counts import LayerBlocks, block_dim

    specs = getattr(worker, "_layer_specs", None) or {}
    out = []
    for name, t in kv_caches.items():
        if not hasattr(t, "shape") or not hasattr(t, "stride") or len(t.shape) < 2:
            continue
        spec = specs.get(name)
        if spec is not None and type(spec).__name__ == "MambaSpec":
            continue
        if _host_resident(worker, name):
            continue
        dim = block_dim(tuple(t.shape))
        out.append(LayerBlocks(name, dim, int(t.shape[dim])))
    return out


def _host_resident(worker: Any, name: str) -> bool:
    kvc = getattr(worker, "kv_cache_config", None)
    try:
        index = kvc.transfer_group_index_by_layer[name]
        return bool(kvc.transfer_groups[index].host_resident)
    except Exception:
        return False


def _restore_counts(worker: Any, planned: int, logical: int, rec: Any) -> bool:
    """Undo kvcached's ``worker.num_blocks = <virtual>`` (it ran first when it wraps outside us).

    In virtual mode the counts are set afterwards by :func:`_advertise_virtual`.
    """
    changed = getattr(worker, "num_blocks", planned) != planned
    if changed:
        worker.num_blocks = planned
    if getattr(worker, "_logical_num_blocks", logical) != logical:
        worker._logical_num_blocks = logical
        changed = True
    return changed


def _sliced(kv_caches: Mapping[str, Any], rec: Any) -> dict[str, Any]:
    from pdpatch.block_counts import ACTION_SLICE

    by_name = {lb.name: lb for lb in rec.layers}
    out = dict(kv_caches)
    for name, action in rec.actions.items():
        if action == ACTION_SLICE:
            lb = by_name[name]
            out[name] = kv_caches[name].narrow(lb.dim, 0, rec.planned)
    return out


def _advertise_virtual(worker: Any, rec: Any, ratio: int, kv_cache_config: Any) -> None:
    from pdpatch.block_counts import BlockCountError

    if rec.target % ratio:
        raise BlockCountError(
            f"pdpatch num_blocks (mode virtual): {rec.target} blocks is not a multiple of "
            f"{ratio} kernel blocks per block")
    worker.num_blocks = rec.target
    worker._logical_num_blocks = rec.target // ratio
    if kv_cache_config is not None and dataclasses.is_dataclass(kv_cache_config):
        # A private copy: the model runner and the scheduler keep the shared one.
        worker.kv_cache_config = dataclasses.replace(kv_cache_config,
                                                     num_blocks=rec.target // ratio)


# ------------------------------------------------------------- bounded storage (>= 0.29)


def _rebased(kv_caches: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Give the narrowed views a storage that spans exactly their bytes.

    From 0.29 vLLM registers ``cache.untyped_storage()`` whole, and decides a region is
    "block-major" by comparing ``storage.nbytes()`` with ``num_blocks x block stride``; a view
    narrowed over kvcached's virtual range keeps the whole range as its storage.  Views sharing
    one storage (kvcached's contiguous layout interleaves every layer's blocks) are re-based
    together onto the single interval they cover, so vLLM still sees one shared storage.
    """
    from pdpatch.block_counts import BlockCountError, byte_extent, covering_range, merge

    groups: dict[tuple[Any, int], list[str]] = {}
    for name in names:
        t = kv_caches[name]
        groups.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    out = dict(kv_caches)
    for (_, _), members in groups.items():
        first = kv_caches[members[0]]
        storage = first.untyped_storage()
        extents = {m: byte_extent(kv_caches[m].storage_offset(),
                                  tuple(kv_caches[m].shape),
                                  tuple(kv_caches[m].stride()),
                                  kv_caches[m].element_size())
                   for m in members}
        span = covering_range(extents.values())
        if span is None:
            merged = merge(extents.values())
            if sum(hi - lo for lo, hi in merged) != sum(hi - lo for lo, hi in extents.values()):
                raise BlockCountError(
                    f"pdpatch num_blocks: KV views {members} share one storage, overlap and "
                    f"leave gaps; no registration can cover exactly their planned blocks")
            spans = {m: extents[m] for m in members}
        else:
            if span == (0, storage.nbytes()):
                continue
            spans = {m: span for m in members}
        bases: dict[tuple[int, int], Any] = {}
        for m in members:
            lo, hi = spans[m]
            if (lo, hi) not in bases:
                bases[(lo, hi)] = _bounded_bytes(storage, first.device, lo, hi)
            t = kv_caches[m]
            isz = t.element_size()
            if lo % isz:
                raise BlockCountError(f"pdpatch num_blocks: view {m} is not {isz}-byte aligned")
            out[m] = bases[(lo, hi)].view(t.dtype).as_strided(
                tuple(t.shape), tuple(t.stride()), t.storage_offset() - lo // isz)
    return out


class _Memory:
    """An array-interface description of ``[ptr, ptr + n)`` that keeps its owner alive.

    numpy (CPU) and torch (CUDA) keep this object referenced for as long as the tensor built on
    it lives, so the original storage -- kvcached's mapping -- outlives every re-based view.
    """

    def __init__(self, ptr: int, nbytes: int, owner: Any, cuda: bool) -> None:
        iface = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        if cuda:
            iface["strides"] = None
            iface["version"] = 2
            self.__cuda_array_interface__ = iface
        else:
            self.__array_interface__ = iface
        self.owner = owner


def _bounded_bytes(storage: Any, device: Any, lo: int, hi: int) -> Any:
    import torch

    from pdpatch.block_counts import BlockCountError

    ptr = storage.data_ptr() + lo
    if device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.asarray(_Memory(ptr, hi - lo, storage, cuda=False)))
    if device.type == "cuda":
        return torch.as_tensor(_Memory(ptr, hi - lo, storage, cuda=True), device=device)
    raise BlockCountError(
        f"pdpatch num_blocks: cannot bound the NIXL registration of {device.type} memory; use "
        f'kv_connector_extra_config["pdpatch"]["{MODE_KEY}"]="virtual" or PDPATCH_NUM_BLOCKS=0')


# ---------------------------------------------------------------------------- verification


def advertised(worker: Any) -> dict[str, Any]:
    """``num_blocks`` and ``region_num_blocks`` as the peer will decode them."""
    payload = getattr(worker, "xfer_handshake_metadata", None)
    raw = getattr(payload, "agent_metadata_bytes", None)
    if raw is not None:
        import msgspec

        meta = msgspec.msgpack.decode(raw)
        if isinstance(meta, list):  # array_like structs: fall back to the worker's fields
            meta = {}
    else:
        meta = {k: getattr(payload, k) for k in ("num_blocks", "region_num_blocks")
                if payload is not None and hasattr(payload, k)}
    return {"num_blocks": meta.get("num_blocks", getattr(worker, "num_blocks", None)),
            "region_num_blocks": list(meta.get("region_num_blocks")
                                      or getattr(worker, "region_num_blocks", None) or [])}


def verify_advertised(worker: Any, target: int) -> None:
    """Fail startup if what the peer will read disagrees with what was registered."""
    from pdpatch.block_counts import BlockCountError

    adv = advertised(worker)
    bad = []
    if adv["num_blocks"] is not None and adv["num_blocks"] != target:
        bad.append(f"num_blocks={adv['num_blocks']}")
    if not getattr(worker, "_has_mamba", False):
        regions = [n for n in adv["region_num_blocks"] if n != target]
        if regions:
            bad.append(f"region_num_blocks contains {sorted(set(regions))}")
    own = getattr(worker, "dst_num_blocks", {}).get(getattr(worker, "engine_id", None))
    if own is not None and own != target:
        bad.append(f"dst_num_blocks[self]={own}")
    if bad:
        raise BlockCountError(
            f"pdpatch num_blocks: after registration the worker advertises {', '.join(bad)}, "
            f"but registered {target} blocks per region; a peer would address blocks that are "
            f"not registered")


# ----------------------------------------------------------------------------------- status


def status_line(state: NumBlocksState) -> str:
    """Short, for ``pdpatch.status()``: which reconciliation is in charge in this process."""
    with state.lock:
        if not state.in_charge:
            return "num_blocks=not-registered-yet"
        seen = "+kvcached-patch-neutralized" if (
            state.kvcached_patch_seen and state.in_charge == "pdpatch") else ""
        return f"num_blocks={state.in_charge}{seen}"
