"""Planning one peer (pure: no wrapper state): does stock code serve it, or does its K/V
placement differ from ours -- then a :class:`Conversion` whose descriptors replace vLLM's --
or can its bytes not pair with ours (:class:`GeometryMismatch`, only that peer's requests
fail).  The geometry maths is :mod:`pdpatch.kv`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from pdpatch import metrics, vllm_sites
from pdpatch.log import logger
from pdpatch.patches.kv_segments.settings import NAME
from pdpatch.patches.kv_segments.state import count, note_refusal

# The descriptor-planning core (pdpatch.kv, ~6 ms) is imported by the functions that use it,
# when vLLM first registers or pairs KV caches, not by install() inside every `import vllm`.
if TYPE_CHECKING:
    import numpy as np

    from pdpatch.kv import KVGeometry, PairPlan




def head_major_of(layout: Any) -> bool | None:
    """Heads outside tokens inside a block? ``HND``/``LBHNC``/... yes, ``NHD``/``LBNHC`` no."""
    if not isinstance(layout, str) or "H" not in layout or "N" not in layout:
        return None
    return layout.index("H") < layout.index("N")


def _with_heads(geometry: KVGeometry, heads: int | None, head_major: bool | None) -> KVGeometry:
    from pdpatch.kv import KVGeometry

    layers = tuple(dataclasses.replace(
        la, num_heads=la.num_heads if la.num_heads is not None else heads,
        head_major=la.head_major if la.head_major is not None else head_major)
        for la in geometry.layers)
    return KVGeometry(layers, geometry.device_id, geometry.label, geometry.names)


@dataclass
class LocalView:
    """The local worker as vLLM's own descriptor code sees it, plus its true geometry."""

    view: KVGeometry          # from the worker's own handshake fields (vLLM's region view)
    kind: str                 # split / fused / packed: how vLLM addresses K and V locally
    num_layers: int
    true: KVGeometry | None   # from tensor strides (what pdpatch advertises)
    heads: int
    head_major: bool | None
    members: list[list[str]] | None = None   # the layers of each region (0.31+ metadata)


def _own_metadata(worker: Any) -> dict[str, Any]:
    import msgspec

    from pdpatch.kv import UnsupportedLayout

    meta = msgspec.msgpack.decode(worker.xfer_handshake_metadata.agent_metadata_bytes)
    if not isinstance(meta, dict):
        raise UnsupportedLayout("own handshake metadata is not a map")
    return meta


def local_view(worker: Any, version: Version,
               true: KVGeometry | None = None) -> LocalView | None:
    """The worker as vLLM's descriptor code sees it (its own encoded handshake fields), with
    ``true``, its geometry from tensor strides, where it was inferred."""
    from pdpatch.kv import (
        KIND_FUSED,
        KIND_PACKED,
        KIND_SPLIT,
        KVPlanError,
        geometry_from_handshake,
    )

    try:
        own = _own_metadata(worker)
    except Exception:
        return None
    addrs = list(own.get("kv_caches_base_addr") or [])
    lens = list(own.get("block_lens") or [])
    if not addrs or len(addrs) != len(lens):
        return None
    n = len(addrs)
    split_era = version in vllm_sites.KV_SPLIT_DESCRIPTORS
    if not split_era or (true is not None and true.kind == KIND_PACKED):
        kind, layers = KIND_PACKED, n
    elif int(getattr(worker, "num_regions", 0)) == 2 * n:
        kind, layers = KIND_FUSED, n          # blocks-first memory, K/V split "virtually"
    elif int(getattr(worker, "num_regions", 0)) == n and n % 2 == 0:
        kind, layers = KIND_SPLIT, n // 2     # K and V registered as separate regions
    else:
        return None
    total = int(worker.vllm_config.model_config.get_total_num_kv_heads())
    heads = max(1, total // vllm_sites.transfer_tp_size(worker))
    # The tensors' strides win over the layout name: a backend may ignore the requested
    # layout (vLLM 0.19's Triton keeps token-major memory while NIXL advertises "HND").
    orders = {la.head_major for la in true.layers} if true is not None else {None}
    head_major = orders.pop() if len(orders) == 1 and None not in orders else \
        head_major_of(own.get("kv_cache_layout"))
    try:
        view = geometry_from_handshake(
            addrs, lens, int(own["num_blocks"]), num_layers=layers, layout=kind,
            block_strides=own.get("block_strides") or None,
            device_id=int(own.get("device_id") or 0), label="local (vLLM's view)")
    except KVPlanError:
        return None
    members = own.get("region_members")
    members = [list(m) for m in members] if isinstance(members, list) and \
        len(members) == n else None
    return LocalView(_with_heads(view, heads, head_major), kind, layers, true, heads, head_major,
                     members)


def remote_geometry(meta: Any, num_layers: int | None, layout: str, heads: int,
                    advertised: Mapping | None) -> KVGeometry:
    """The peer's geometry: its advertisement, else vLLM's own metadata fields.
    ``num_layers``: the local layer count it must match (positional pairing, up to 0.33);
    None: all of the peer's layers (0.34+ pairs them by name: a PP stage holds a slice)."""
    from pdpatch.kv import GeometryMismatch, KVGeometry, geometry_from_handshake

    label = f"remote engine {meta.engine_id}"
    if advertised is not None:
        geo = KVGeometry.from_wire(dict(advertised), label=label)
        if num_layers is not None and geo.num_layers != num_layers:
            raise GeometryMismatch(
                f"peer advertises {geo.num_layers} KV layers, the local model has {num_layers}",
                None, geo)
        if geo.num_blocks != meta.num_blocks:
            raise GeometryMismatch(
                f"peer advertises {geo.num_blocks} blocks but its metadata says "
                f"{meta.num_blocks}", None, geo)
        geo = KVGeometry(geo.layers, int(meta.device_id), label, geo.names)
    else:
        addrs = list(meta.kv_caches_base_addr)
        geo = geometry_from_handshake(
            addrs, list(meta.block_lens), int(meta.num_blocks),
            num_layers=len(addrs) if num_layers is None else num_layers, layout=layout,
            block_strides=getattr(meta, "block_strides", None) or None,
            device_id=int(meta.device_id), label=label)
    return _with_heads(geo, heads, head_major_of(getattr(meta, "kv_cache_layout", None)))


def _in_registration_order(worker: Any, mine: KVGeometry, remote: KVGeometry,
                           version: Version) -> tuple[KVGeometry, KVGeometry]:
    """Both sides' per-layer geometries (from tensors, in ``kv_caches`` dict order) in the
    order each registers its regions, which 0.30-0.33 pair by position: their layer names
    sorted as vLLM sorts them (:data:`pdpatch.vllm_sites.REGIONS_IN_LAYER_NAME_ORDER`).
    vLLM's own region view, and geometries without names, are left as they are."""
    from pdpatch.kv.pairing import in_region_order

    if version not in vllm_sites.REGIONS_IN_LAYER_NAME_ORDER or mine.names is None or \
            remote.names is None or getattr(worker, "_is_csa_linear", False):
        return mine, remote
    return mine.select(in_region_order(mine.names)), remote.select(in_region_order(remote.names))


def paired_by_layer(worker: Any, meta: Any, local: LocalView, remote_tp_size: int,
                    advertised: Mapping | None) -> tuple[KVGeometry, KVGeometry]:
    """(local, remote) geometries pair by pair as vLLM 0.34+ will transfer them
    (:data:`pdpatch.vllm_sites.REGIONS_PAIRED_BY_LAYER`): through the layers both hold, not
    by position.  Both sides' tensors by layer name where both advertise names (pdpatch on
    each side), else vLLM's own regions through their ``region_members``.  Raises
    :class:`GeometryMismatch` where the release refuses the pairing itself."""
    from pdpatch.kv import KIND_PACKED, GeometryMismatch
    from pdpatch.kv.pairing import pair_layers_by_name, pair_regions_by_layer

    stage = int(getattr(worker, "pp_size", 1) or 1) > 1      # a PP stage: a slice of the peer
    total = int(worker.vllm_config.model_config.get_total_num_kv_heads())
    heads = max(1, total // int(remote_tp_size))
    if advertised is not None and local.true is not None and local.true.names is not None:
        remote = remote_geometry(meta, None, KIND_PACKED, heads, advertised)
        if remote.names is not None:
            pairs = pair_layers_by_name(local.true.names, remote.names, peer_may_hold_more=stage)
            return (local.true.select(li for _, li in pairs),
                    remote.select(ri for ri, _ in pairs))
    members = getattr(meta, "region_members", None) or []
    if local.members is None or len(members) != len(meta.kv_caches_base_addr):
        raise GeometryMismatch("the peer did not advertise the layers of its KV regions "
                               "(region_members), by which vLLM pairs them")
    if getattr(meta, "packed_member_layouts", None):
        # vLLM splits such rows into one virtual region per layer first (0.34.0 base_worker.py
        # L441-504); a peer of another backend name is accepted only on a pairing pdpatch
        # models, and it does not model those rows
        raise GeometryMismatch("the peer packs several layers per block row "
                               "(packed_member_layouts), which pdpatch does not check against "
                               "another backend's layout")
    remote = remote_geometry(meta, None, KIND_PACKED, heads, None)
    pairs = pair_regions_by_layer(local.members, members, peer_may_hold_more=stage)
    return local.view.select(li for _, li in pairs), remote.select(ri for ri, _ in pairs)


@dataclass
class Conversion:
    """A peer whose K/V placement differs from the local one, planned and validated.

    ``descs`` stays an ``(N, 3)`` uint64 array end to end: NIXL's ``get_xfer_descs`` takes it
    as it is, while a list of tuples costs ~1 s per 500k descriptors at first contact (an 8B
    model's over-allocated pool) before the first request can read."""

    meta: Any
    shadow: Any
    plan: PairPlan
    descs: np.ndarray
    factor: int
    substituted: bool = False   # set by the inner wrapper that swapped vLLM's list

    def substitute(self, stock: list, factor: int | None) -> np.ndarray:
        """pdpatch's descriptors in place of vLLM's ``stock`` list (checked); the wrapper that
        started the conversion reads :attr:`substituted` to learn vLLM built a list to swap."""
        self.check_against(stock, factor)
        self.substituted = True
        return self.descs

    def check_against(self, stock: list, factor: int | None) -> None:
        """vLLM's own list (built from the shadow) must match pdpatch's in count, order and
        lengths -- only addresses may differ -- or the desc ids would not line up."""
        import numpy as np

        from pdpatch.kv import GeometryMismatch

        mine = self.descs[:, 1]
        stock_lens = np.fromiter(map(itemgetter(1), stock), dtype=np.uint64, count=len(stock))
        problem = ""
        if stock_lens.size != mine.size:
            problem = f"vLLM builds {stock_lens.size} remote descriptors, pdpatch {mine.size}"
        elif not np.array_equal(stock_lens, mine):
            i = int(np.flatnonzero(stock_lens != mine)[0])
            problem = (f"descriptor {i} is {stock_lens[i]} B in vLLM's list, {mine[i]} B in "
                       "pdpatch's")
        elif factor is not None and factor != self.factor:
            problem = f"vLLM reads head slice {factor}, pdpatch computed {self.factor}"
        if problem:
            raise GeometryMismatch(
                f"{problem}; this pair needs a descriptor layout pdpatch does not convert",
                self.plan.local, self.plan.remote)


def shadow(meta: Any, remote: KVGeometry, kind: str) -> Any:
    """``meta`` describing the same bytes the way vLLM expects a peer of layout ``kind``:
    split = per layer a K and a V region of one segment each; fused = one region per layer
    whose ``block_len`` is K+V.  vLLM's validation then checks the real byte spans."""
    from pdpatch.kv import KIND_SPLIT, ROLE_K, ROLE_V, GeometryMismatch

    addrs: list[int] = []
    lens: list[int] = []
    for la in remote.layers:
        if la.roles != (ROLE_K, ROLE_V):
            raise GeometryMismatch("peer's layers are not K/V segments", None, remote)
        k, v = la.segments
        if kind == KIND_SPLIT:
            addrs += [la.base + k.offset, la.base + v.offset]
            lens += [k.length, v.length]
        else:
            addrs.append(la.base + k.offset)
            lens.append(k.length + v.length)
    return dataclasses.replace(meta, kv_caches_base_addr=addrs, block_lens=lens)


def _peer_geometry(worker: Any, meta: Any, local: LocalView, remote_tp_size: int,
                   advertised: Mapping | None, version: Version) -> KVGeometry:
    """The peer's geometry as ``local`` pairs with it: packed where the local side is, else
    told apart by its regions; each of its ranks holding its share of the model's KV heads;
    as many layers as the local side up to 0.33 (positional pairing), all of its own from 0.34.
    One place for :func:`plan_peer` and :func:`peer_read_ranges`, which model the same peer."""
    from pdpatch.kv import KIND_PACKED

    total = int(worker.vllm_config.model_config.get_total_num_kv_heads())
    by_name = version in vllm_sites.REGIONS_PAIRED_BY_LAYER
    return remote_geometry(meta, None if by_name else local.num_layers,
                           KIND_PACKED if local.kind == KIND_PACKED else "auto",
                           max(1, total // int(remote_tp_size)), advertised)


def _same_regions(worker: Any, meta: Any, advertised: Any, version: Version) -> bool:
    """Cheap test that stock code is right for a same-backend peer: from 0.26 there is no K/V
    split to get wrong; before, vLLM's own view (2·L regions = split, L = fused) is the same on
    both sides when the region counts are.  A peer that advertises its geometry gets the full
    comparison (its true placement may differ from what its region count says: kvcached)."""
    if version not in vllm_sites.KV_SPLIT_DESCRIPTORS:
        return True
    lens = getattr(worker, "block_len_per_layer", None)
    return advertised is None and lens is not None and \
        len(meta.kv_caches_base_addr) == len(lens)


def peer_read_ranges(worker: Any, meta: Any, remote_tp_size: int, version: Version, *,
                     local_true: KVGeometry | None = None,
                     advertised: Mapping | None = None) -> list[tuple[int, int]] | None:
    """The memory of a peer stock code serves (same layout) that a staged READ may cross
    whole, for gap reads; None where its geometry cannot be built (its READs are then staged
    without gap reads: optional, so nothing raised here fails the peer)."""
    try:
        local = local_view(worker, version, local_true)
        if local is None:
            return None
        return list(_peer_geometry(worker, meta, local, remote_tp_size,
                                   advertised, version).read_ranges())
    except Exception as exc:
        logger.info("pdpatch kv_segments: peer %s's memory not modelled (%s: %s); its READs "
                    "are staged without gap reads", getattr(meta, "engine_id", "?"),
                    type(exc).__name__, exc)
        return None


HEAD_ORDER_ADVICE = (
    "To pair a head-major prefill with a token-major decode (kvcached, PDPATCH_LAYOUT_FORCE), "
    "set enable_permute_local_kv=true in the decode engine's --kv-transfer-config (pdpatch's "
    "layout patch does so where it makes the decode engine token-major), "
    "or run the prefill engine token-major too (PDPATCH_LAYOUT_FORCE=1)")
HEAD_ORDER_BLOCK_SIZE_ADVICE = (
    "The decode engine already reorders received blocks (enable_permute_local_kv), but only "
    "blocks of its own size: run the prefill and decode engines with equal block sizes for "
    "this pair, or a decode engine that is head-major (no kvcached, no PDPATCH_LAYOUT_FORCE)")


def plan_peer(worker: Any, meta: Any, remote_tp_size: int, version: Version, *,
              local_true: KVGeometry | None = None, advertised: Mapping | None = None,
              hash_accepted: bool = False) -> Conversion | None:
    """None: stock code is right for this peer.  A :class:`Conversion`: K/V placements differ
    and pdpatch's descriptors replace vLLM's.  Raises :class:`GeometryMismatch` for a peer whose
    bytes cannot pair with ours (only that peer's requests fail).

    ``local_true``: the worker's geometry from its tensors; ``advertised``: the peer rank's
    advertised geometry; ``hash_accepted``: this handshake let a peer through whose hash
    differed from ours only in the backend name."""
    from pdpatch.kv import (
        KIND_FUSED,
        KIND_PACKED,
        GeometryMismatch,
        HeadOrderMismatch,
        PairPlan,
        UnsupportedLayout,
        handshake_kind,
        slices_for,
    )

    if getattr(worker, "use_mla", False) or getattr(worker, "_has_mamba", False):
        return None
    local_name = getattr(worker, "backend_name", None)
    remote_name = getattr(meta, "attn_backend_name", None)
    mixed = (remote_name is not None and remote_name != local_name) or hash_accepted
    if not mixed and _same_regions(worker, meta, advertised, version):
        return None                 # the pass-through: no geometry is built for this peer
    local = local_view(worker, version, local_true)
    if local is None:
        return None
    reorders = False
    try:
        if local.kind == KIND_PACKED:
            remote_kind = KIND_PACKED
        else:
            remote_kind = handshake_kind(len(meta.kv_caches_base_addr), local.num_layers,
                                         advertised=advertised)
        if remote_kind == local.kind and not mixed:
            return None
        total = int(worker.vllm_config.model_config.get_total_num_kv_heads())
        sl = slices_for(total, vllm_sites.transfer_tp_size(worker),
                        vllm_sites.transfer_tp_rank(worker), int(remote_tp_size),
                        int(worker.block_size), int(meta.block_size))
        if local.kind == KIND_FUSED and sl.block_size_ratio > 1:
            # 0.19-0.25 `_build_fa_local`/`_build_fa_remote` do not divide the V descriptor by
            # the ratio for blocks-first memory: the reads overrun into the next block.
            raise GeometryMismatch(
                f"vLLM {version} cannot receive a peer with {sl.block_size_ratio}x smaller "
                "blocks into blocks-first (fused K|V) memory: its V descriptors are not "
                "divided by the block-size ratio (the reads would overrun into the next "
                "block); use equal block sizes or a split (K/V-first) decode layout")
        reorders = vllm_sites.reorders_heads_on_receive(worker, meta, version)
        if remote_kind == local.kind:
            # Mixed backend names, same placement: accept only an exact byte pairing of the
            # layers the release will pair (by position up to 0.33, by layer name from 0.34).
            if version in vllm_sites.REGIONS_PAIRED_BY_LAYER:
                mine, remote = paired_by_layer(worker, meta, local, remote_tp_size, advertised)
            else:
                remote = _peer_geometry(worker, meta, local, remote_tp_size, advertised,
                                        version)
                mine = local.true if (advertised is not None and local.true is not None) \
                    else local.view
                mine, remote = _in_registration_order(worker, mine, remote, version)
            PairPlan(mine, remote, local_slice=sl.local, remote_slice=sl.remote,
                     block_size_ratio=sl.block_size_ratio, receiver_reorders_heads=reorders)
            count("mixed_accepted")
            logger.info("pdpatch kv_segments: accepting %s peer %s for local %s: identical "
                        "%s geometry (%s)", remote_name or "?", meta.engine_id, local_name,
                        remote_kind, remote.describe())
            return None
        remote = _peer_geometry(worker, meta, local, remote_tp_size, advertised, version)
        plan = PairPlan(local.view, remote, local_slice=sl.local, remote_slice=sl.remote,
                        block_size_ratio=sl.block_size_ratio, receiver_reorders_heads=reorders)
        return Conversion(meta, shadow(meta, remote, local.kind), plan, plan.remote_table(),
                          sl.remote.index)
    except (GeometryMismatch, UnsupportedLayout) as exc:
        if isinstance(exc, UnsupportedLayout) and not mixed and advertised is None:
            return None        # nothing pdpatch knows better than stock; let vLLM decide
        err = exc if isinstance(exc, GeometryMismatch) else GeometryMismatch(str(exc))
        if err.local is None:
            err = GeometryMismatch(err.reason, local.view, err.remote)
        if isinstance(err, HeadOrderMismatch):
            # with the reorder on, only a block-size ratio is refused (pdpatch.kv.plan)
            advice = HEAD_ORDER_BLOCK_SIZE_ADVICE if reorders else HEAD_ORDER_ADVICE
            err = HeadOrderMismatch(f"{err.reason}. {advice}", err.local, err.remote)
        note_refusal(str(err))
        metrics.count(worker, metrics.REFUSALS, NAME)
        logger.error("pdpatch kv_segments: refusing peer %s (backend %s; local %s): %s",
                     getattr(meta, "engine_id", "?"), remote_name or "?", local_name, err)
        raise err from None


