"""Patch ``kv_segments``: P and D whose attention backends place K and V differently exchange
blocks byte-exactly; pairs pdpatch cannot convert fail that peer's handshake with both
geometries named.

Why: up to vLLM 0.22 FlashAttention keeps a layer's K and V in two regions (``(2, N, ...)``)
while FlashInfer / Triton fuse ``[K|V]`` per block (``(N, 2, ...)``); kvcached's split-half
memory does the same on 0.23-0.25.  Stock vLLM refuses such a pair twice over: the NIXL
compatibility hash covers the backend *name*, and with that check off
``_validate_remote_agent_handshake`` asserts on block lengths and region counts -- and even
then the remote descriptors would be built with the *local* layout.  From 0.26 every backend
packs K|V per token, so two backend names can share one geometry, and the hash still refuses.

What this does (research notes §4.1-4.4; the geometry maths is :mod:`pdpatch.kv`):

* **advertise** -- after ``register_kv_caches`` the worker's geometry, inferred from tensor
  strides, is added to the encoded ``NixlAgentMetadata`` as the optional field
  ``pdpatch_kv_geometry``.  msgspec decoders drop unknown fields, so every decoded
  ``NixlAgentMetadata`` -- a stock peer's, and the one vLLM's own handshake builds on a pdpatch
  D -- is exactly what the release would build; D reads the field from the raw bytes, through
  a subclass of ``NixlHandshakePayload`` that is the worker module's global only while a
  handshake runs (reference-counted, restored in ``finally``: nothing outlives the wrapper and
  ``pdpatch.uninstall()`` leaves vLLM's globals untouched);
* **hash** -- ``compute_nixl_compatibility_hash`` as bound in the worker module is wrapped only
  to record, for the local configuration, the hashes the *same* configuration would have with
  another interchangeable backend name (:data:`INTERCHANGEABLE`).  The hash this worker sends
  is vLLM's own.  A peer whose hash is one of those alternates passed every hashed factor
  except the backend name; it is let through to the geometry check below, nothing else is;
* **convert (0.19-0.25)** -- ``add_remote_agent`` compares the peer's K/V placement with the
  local one (advertised geometry, else vLLM's own fields: 2·L regions = split, L = fused).
  Equal placements call stock code unchanged.  Different ones are planned with
  :class:`pdpatch.kv.PairPlan` (byte-span check: local segment / block-size ratio / reads ==
  remote segment / head slices, else :class:`GeometryMismatch` in the handshake thread, which
  fails only that peer's requests, before anything is registered).  Stock code then runs on a
  *shadow* of the peer's metadata that describes the same bytes in the local layout's terms,
  so vLLM's own validation, TP mapping and local split handles apply unchanged, and the remote
  descriptor list it builds is swapped for pdpatch's (same count, order and lengths -- checked --
  only addresses differ): in ``_build_fa_remote`` on 0.21-0.25, at the
  ``get_xfer_descs``/``prep_xfer_dlist`` pair inside ``add_remote_agent`` on 0.19/0.20 (the
  builder is a closure there);
* **stage (0.19-0.25)** -- a converted peer's READs cost one NIXL descriptor per block segment
  (nothing merges across layouts).  ``register_kv_caches`` puts a
  :class:`pdpatch.kv.staging.StagingAgent` in front of the worker's NIXL agent (before vLLM
  prepares its lists, so it sees them), and ``add_remote_agent`` marks each converted peer's
  list: its READs land in a staging buffer in the peer's address order (runs merge), and are
  gathered into the KV cache before ``check_xfer_state`` answers ``DONE``.  Requests it cannot
  stage, or where staging saves under a quarter of the descriptors, run vLLM's own READ.
  ``PDPATCH_KV_STAGING_MIB`` (default 128 per decode worker, allocated at the first READ it
  stages; 0 = off).  Nearby blocks of one peer registration also share a descriptor across
  the unrequested bytes between them, up to a gap measured per peer at its first staged READ
  (a descriptor's cost times the bandwidth: MiB over cuda_ipc, KiB over TCP);
  ``PDPATCH_KV_GAP_KIB`` sets it instead (0 = no gap reads);
* **mixed names (all releases)** -- a peer whose backend name differs is accepted only when
  its geometry pairs with the local one exactly (same roles, head order, spans after TP and
  block-size scaling); a real difference raises :class:`GeometryMismatch`.

D (the reading side) must run pdpatch; P needs it only to advertise its geometry (without it
D derives P's geometry from vLLM's own metadata fields).  Toggle: ``PDPATCH_KV_SEGMENTS``,
or ``kv_connector_extra_config["pdpatch"]["kv_segments"] = false``; extra interchangeable
backend names: ``kv_connector_extra_config["pdpatch"]["kv_segments_backends"] = [...]``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from pdpatch import config, versions, vllm_sites
from pdpatch.log import logger
from pdpatch.registry import Patch, Target, Wrapper

# The descriptor-planning core (pdpatch.kv, ~6 ms) is imported by the functions that use it,
# when vLLM first registers or pairs KV caches, not by install() inside every `import vllm`.
if TYPE_CHECKING:
    from pdpatch.kv import KVGeometry, PairPlan

NAME = "kv_segments"
FIELD = "pdpatch_kv_geometry"
BACKENDS_KEY = "kv_segments_backends"
STAGING_ENV = "PDPATCH_KV_STAGING_MIB"    # also named in pdpatch.kv.staging's messages
STAGING_DEFAULT_MIB = 128
GAP_ENV = "PDPATCH_KV_GAP_KIB"            # likewise; unset or "auto": measured per peer

# Backends whose K and V are plain [block, token, head, dim] arrays (split or fused), so that a
# byte-level conversion is meaningful.  Not CPU_ATTN (from 0.23 vLLM re-packs its cache after a
# transfer from another backend: `pack_kv_cache`), not MLA backends (one latent, several
# incompatible page formats).
INTERCHANGEABLE: tuple[str, ...] = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")

# vLLM 0.21 moved the remote builder out of the add_remote_agent closure (PR #40731).
BUILDER_METHOD_FROM = Version("0.21")


@dataclass
class Stats:
    """What this process's patch did (for tests and ``pdpatch doctor``)."""

    advertised: int = 0
    hash_alternates_accepted: int = 0
    conversions: int = 0
    mixed_accepted: int = 0
    rejected: int = 0
    last_error: str = ""


stats = Stats()
_stats_lock = threading.Lock()
_tls = threading.local()


def _count(attr: str, error: str = "") -> None:
    with _stats_lock:
        setattr(stats, attr, getattr(stats, attr) + 1)
        if error:
            stats.last_error = error


def _reset_for_tests() -> None:
    global stats
    stats = Stats()
    with _alt_lock:
        _ALTERNATES.clear()


# --------------------------------------------------------------------------------- settings


def _extra(obj: Any) -> Mapping | None:
    """``kv_connector_extra_config`` of a worker or a ``VllmConfig``."""
    ktc = getattr(obj, "kv_transfer_config", None)
    if ktc is None:
        ktc = getattr(getattr(obj, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None)
    return extra if isinstance(extra, Mapping) else None


def _allowed(obj: Any) -> bool:
    return config.extra_config_allows(NAME, _extra(obj))


def interchangeable(vllm_config: Any) -> frozenset[str]:
    """:data:`INTERCHANGEABLE` plus the names an operator added in the extra config."""
    names = set(INTERCHANGEABLE)
    section = (_extra(vllm_config) or {}).get(config.EXTRA_CONFIG_KEY)
    more = section.get(BACKENDS_KEY) if isinstance(section, Mapping) else None
    if more is not None:
        if not isinstance(more, list) or not all(isinstance(x, str) for x in more):
            raise config.ConfigError(
                f'kv_connector_extra_config["{config.EXTRA_CONFIG_KEY}"]["{BACKENDS_KEY}"] must '
                f"be a list of attention backend names, got {more!r}")
        names.update(more)
    return frozenset(names)


# ------------------------------------------------------------- hash: record the alternates

_ALTERNATES: dict[str, dict[str, str]] = {}   # local hash -> {alternate hash: backend name}
_alt_lock = threading.Lock()


def _hash_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Return vLLM's hash unchanged; remember what the same configuration hashes to with each
    other interchangeable backend name (same call, only the name differs)."""
    result = wrapped(*args, **kwargs)
    try:
        vllm_config = args[0] if args else kwargs["vllm_config"]
        in_args = len(args) > 1
        name = args[1] if in_args else kwargs.get("attn_backend_name")
        names = interchangeable(vllm_config)
        if name not in names or not _allowed(vllm_config):
            return result
        alternates: dict[str, str] = {}
        for other in sorted(names - {name}):
            if in_args:
                alt = wrapped(args[0], other, *args[2:], **kwargs)
            else:
                alt = wrapped(*args, **{**kwargs, "attn_backend_name": other})
            alternates[alt] = other
        with _alt_lock:
            _ALTERNATES[result] = alternates
    except config.ConfigError:
        raise
    except Exception as exc:  # never let the bookkeeping break vLLM's own hash
        logger.debug("pdpatch kv_segments: no hash alternates recorded: %s", exc)
    return result


def alternates_for(local_hash: str) -> dict[str, str]:
    with _alt_lock:
        return dict(_ALTERNATES.get(local_hash, {}))


# ------------------------------------------- handshake: scoped subclasses of the wire classes


@dataclass
class _HandshakeCtx:
    worker: Any
    accepted: dict[str, str] = field(default_factory=dict)   # remote hash -> its backend name
    # the peer rank's advertised geometry, by its NIXL agent metadata (one per rank)
    advertised: dict[bytes, Mapping] = field(default_factory=dict)


def _on_payload(payload: Any) -> None:
    """Runs in the decoded ``NixlHandshakePayload``'s ``__post_init__`` (msgspec calls it)."""
    ctx: _HandshakeCtx | None = getattr(_tls, "handshake", None)
    if ctx is None:
        return
    _note_advertised(ctx, getattr(payload, "agent_metadata_bytes", None))
    local = getattr(ctx.worker, "compat_hash", None)
    remote = getattr(payload, "compatibility_hash", None)
    if not local or not remote or remote == local:
        return
    name = alternates_for(local).get(remote)
    if name is None:
        return
    ctx.accepted[remote] = name
    payload.compatibility_hash = local
    _count("hash_alternates_accepted")
    logger.info(
        "pdpatch kv_segments: peer's NIXL compatibility hash differs from ours only in the "
        "attention backend (peer %s, local %s); its K/V geometry is checked before any "
        "descriptor is built", name, getattr(ctx.worker, "backend_name", "?"))


def _note_advertised(ctx: _HandshakeCtx, raw: Any) -> None:
    """Keep the geometry a pdpatch peer added to its agent metadata.  vLLM decodes the same
    bytes into its own ``NixlAgentMetadata``, which drops the unknown field, so the object
    vLLM's code sees is exactly what a stock peer would produce."""
    import msgspec

    if not isinstance(raw, bytes):
        return
    try:
        meta = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return              # vLLM's own decode reports it
    if isinstance(meta, dict) and isinstance(meta.get(FIELD), Mapping) and \
            isinstance(meta.get("agent_metadata"), bytes):
        ctx.advertised[meta["agent_metadata"]] = meta[FIELD]


def advertised_geometry(meta: Any) -> Mapping | None:
    """The geometry the peer rank behind ``meta`` advertised in this handshake, if any."""
    ctx: _HandshakeCtx | None = getattr(_tls, "handshake", None)
    agent = getattr(meta, "agent_metadata", None)
    if ctx is None or not isinstance(agent, bytes):
        return None
    return ctx.advertised.get(agent)


_class_cache: dict[type, type] = {}
_class_lock = threading.Lock()


def payload_class(base: type) -> type:
    """``NixlHandshakePayload`` whose decode lets :func:`_on_payload` see the peer's hash and
    raw agent metadata, before vLLM compares the hash."""
    with _class_lock:
        if base not in _class_cache:
            parent_post = getattr(base, "__post_init__", None)

            def __post_init__(self: Any) -> None:
                if parent_post is not None:
                    parent_post(self)
                _on_payload(self)

            _class_cache[base] = dataclasses.make_dataclass(
                base.__name__, [], bases=(base,),
                namespace={"__module__": __name__, "_pdpatch_base": base,
                           "__post_init__": __post_init__})
        return _class_cache[base]


class _ScopedPayloadClass:
    """Replace the worker module's ``NixlHandshakePayload`` while at least one handshake runs;
    restore it after the last one.

    Why a module global: ``_nixl_handshake`` decodes the peer's payload and compares its
    compatibility hash inline, with no seam between the two; the decode is the only place a
    hash that differs only in the backend name can be recognised.  Any thread that meets the
    replacement meanwhile gets a subclass with no extra field, which decodes every payload
    exactly as vLLM's class does.
    """

    NAME = "NixlHandshakePayload"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, list[Any]] = {}   # module name -> [depth, original, mine]

    @contextmanager
    def active(self, module: Any) -> Iterator[None]:
        name = module.__name__
        with self._lock:
            entry = self._active.get(name)
            if entry is None:
                original = _stock(module.__dict__[self.NAME])
                mine = payload_class(original)
                setattr(module, self.NAME, mine)
                entry = self._active[name] = [0, original, mine]
            entry[0] += 1
        try:
            yield
        finally:
            with self._lock:
                entry[0] -= 1
                if entry[0] == 0:
                    if module.__dict__.get(self.NAME) is entry[2]:
                        setattr(module, self.NAME, entry[1])
                    del self._active[name]

    def depth(self, module_name: str) -> int:
        with self._lock:
            entry = self._active.get(module_name)
            return entry[0] if entry else 0


def _stock(cls: type) -> type:
    return getattr(cls, "__dict__", {}).get("_pdpatch_base", cls)


scoped_payload = _ScopedPayloadClass()


def _make_handshake_wrapper(module_name: str) -> Wrapper:
    def handshake(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not _allowed(instance):
            return wrapped(*args, **kwargs)
        module = sys.modules[module_name]
        prev = getattr(_tls, "handshake", None)
        _tls.handshake = _HandshakeCtx(instance)
        try:
            with scoped_payload.active(module):
                return wrapped(*args, **kwargs)
        finally:
            _tls.handshake = prev

    return handshake


# ----------------------------------------------------------------- advertise local geometry


def _probe_heads_dims(worker: Any) -> dict[str, int]:
    """Where the backend's ``get_kv_cache_shape`` puts the heads dimension (its logical order;
    vLLM's CPU backend up to 0.22 is ``(2, N, H, bs, D)``, FlashAttention ``(2, N, bs, H, D)``)."""
    backends = getattr(worker, "attn_backends", None) or []
    shape_fn = getattr(backends[0], "get_kv_cache_shape", None) if backends else None
    if shape_fn is None:
        return {}
    try:
        shape = tuple(shape_fn(num_blocks=5, block_size=16, num_kv_heads=3, head_size=64))
    except Exception:
        return {}
    if shape.count(3) != 1:
        return {}
    dim = shape.index(3)
    if len(shape) == 5 and dim in (2, 3):
        return {"heads_dim_5d": dim}
    if len(shape) == 4 and dim in (1, 2):
        return {"heads_dim": dim}
    return {}


def local_geometry(worker: Any, kv_caches: Mapping[str, Any]) -> KVGeometry | None:
    """The worker's registered KV memory as :class:`KVGeometry` (from strides), or None where
    pdpatch does not model it (MLA, Mamba, shared or non-tensor caches)."""
    from pdpatch.kv import infer_geometry, tensor_info

    if getattr(worker, "use_mla", False) or getattr(worker, "_has_mamba", False):
        return None
    if getattr(worker, "use_host_buffer", False):
        kv_caches = getattr(worker, "host_xfer_buffers", None) or {}
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else []
    if not tensors or not all(hasattr(t, "stride") and hasattr(t, "data_ptr") and
                              len(getattr(t, "shape", ())) in (4, 5) for t in tensors):
        return None
    if len({t.data_ptr() for t in tensors}) != len(tensors):
        return None          # layers sharing one tensor (HMA pools): regions != layers
    return infer_geometry(
        [tensor_info(t) for t in tensors], num_blocks=int(worker.num_blocks),
        device_id=int(getattr(worker, "device_id", 0) or 0),
        label=f"engine {getattr(worker, 'engine_id', '?')} rank {getattr(worker, 'tp_rank', 0)}",
        **_probe_heads_dims(worker))


def _set_advertised(worker: Any, geometry: KVGeometry) -> None:
    """Add the geometry to the already-encoded handshake metadata (a msgpack map)."""
    import msgspec

    payload = getattr(worker, "xfer_handshake_metadata", None)
    raw = getattr(payload, "agent_metadata_bytes", None)
    if raw is None:
        return
    meta = msgspec.msgpack.decode(raw)
    if not isinstance(meta, dict):
        return
    meta[FIELD] = geometry.to_wire()
    payload.agent_metadata_bytes = msgspec.msgpack.encode(meta)


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
    import os

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


def _kv_memory(worker: Any, kv_caches: Any) -> list:
    """The tensors the worker's local descriptor lists point into."""
    if getattr(worker, "use_host_buffer", False):
        return list((getattr(worker, "host_xfer_buffers", None) or {}).values())
    return list(kv_caches.values()) if isinstance(kv_caches, Mapping) else []


def _install_staging(worker: Any, kv_caches: Any) -> None:
    """Put a :class:`~pdpatch.kv.staging.StagingAgent` in front of the worker's NIXL agent,
    before vLLM prepares its local lists (the agent must see them being prepared).  It acts
    only on peers :func:`_make_add_remote_wrapper` marks converted."""
    from pdpatch.kv.staging import StagingAgent

    mib, gap = staging_mib(), gap_kib()
    agent = getattr(worker, "nixl_wrapper", None)
    if mib == 0 or agent is None or isinstance(agent, StagingAgent) or \
            getattr(worker, "use_mla", False):
        return
    worker.nixl_wrapper = StagingAgent(
        agent, mem_type=getattr(worker, "nixl_memory_type", "VRAM"), capacity=mib << 20,
        memory=lambda: _kv_memory(worker, kv_caches),
        gap=None if gap is None else gap << 10)


def _make_register_wrapper(version: Version) -> Wrapper:
    converts = version in vllm_sites.KV_SPLIT_DESCRIPTORS

    def register_kv_caches(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        kv_caches = args[0] if args else kwargs.get("kv_caches")
        if converts and _allowed(instance):
            _install_staging(instance, kv_caches)
        result = wrapped(*args, **kwargs)
        if _allowed(instance):
            _advertise(instance, kv_caches)
        return result

    return register_kv_caches


def _advertise(instance: Any, kv_caches: Any) -> None:
    from pdpatch.kv import KVPlanError

    geometry = None
    try:
        geometry = local_geometry(instance, kv_caches)
        if geometry is not None:
            _set_advertised(instance, geometry)
    except KVPlanError as exc:
        logger.info("pdpatch kv_segments: local KV geometry not advertised: %s", exc)
        geometry = None
    except Exception as exc:  # the advertisement is optional: never fail registration for it
        logger.warning("pdpatch kv_segments: local KV geometry not advertised (%s: %s)",
                       type(exc).__name__, exc)
        geometry = None
    instance.__dict__["_pdpatch_kv_geometry"] = geometry
    if geometry is not None:
        _count("advertised")
        logger.debug("pdpatch kv_segments: advertising %s", geometry.describe())


def _restore_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.33 re-encodes the metadata through the stock class on wake-up: advertise again."""
    result = wrapped(*args, **kwargs)
    geometry = instance.__dict__.get("_pdpatch_kv_geometry")
    if geometry is not None and _allowed(instance):
        _set_advertised(instance, geometry)
    return result


# ------------------------------------------------------------------------ peer planning


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
    return KVGeometry(layers, geometry.device_id, geometry.label)


@dataclass
class LocalView:
    """The local worker as vLLM's own descriptor code sees it, plus its true geometry."""

    view: KVGeometry          # from the worker's own handshake fields (vLLM's region view)
    kind: str                 # split / fused / packed: how vLLM addresses K and V locally
    num_layers: int
    true: KVGeometry | None   # from tensor strides (what pdpatch advertises)
    heads: int
    head_major: bool | None


def _own_metadata(worker: Any) -> dict[str, Any]:
    import msgspec

    from pdpatch.kv import UnsupportedLayout

    meta = msgspec.msgpack.decode(worker.xfer_handshake_metadata.agent_metadata_bytes)
    if not isinstance(meta, dict):
        raise UnsupportedLayout("own handshake metadata is not a map")
    return meta


def local_view(worker: Any, version: Version) -> LocalView | None:
    from pdpatch.kv import (
        KIND_FUSED,
        KIND_PACKED,
        KIND_SPLIT,
        KVPlanError,
        geometry_from_handshake,
    )

    true = worker.__dict__.get("_pdpatch_kv_geometry")
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
    tp = int(getattr(worker, "transfer_tp_size", 0) or getattr(worker, "world_size", 1))
    heads = max(1, total // tp)
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
    return LocalView(_with_heads(view, heads, head_major), kind, layers, true, heads, head_major)


def remote_geometry(meta: Any, num_layers: int, layout: str, heads: int,
                    advertised: Mapping | None) -> KVGeometry:
    """The peer's geometry: its advertisement, else vLLM's own metadata fields."""
    from pdpatch.kv import GeometryMismatch, KVGeometry, geometry_from_handshake

    label = f"remote engine {meta.engine_id}"
    if advertised is not None:
        geo = KVGeometry.from_wire(dict(advertised), label=label)
        if geo.num_layers != num_layers:
            raise GeometryMismatch(
                f"peer advertises {geo.num_layers} KV layers, the local model has {num_layers}",
                None, geo)
        if geo.num_blocks != meta.num_blocks:
            raise GeometryMismatch(
                f"peer advertises {geo.num_blocks} blocks but its metadata says "
                f"{meta.num_blocks}", None, geo)
        geo = KVGeometry(geo.layers, int(meta.device_id), label)
    else:
        geo = geometry_from_handshake(
            list(meta.kv_caches_base_addr), list(meta.block_lens), int(meta.num_blocks),
            num_layers=num_layers, layout=layout,
            block_strides=getattr(meta, "block_strides", None) or None,
            device_id=int(meta.device_id), label=label)
    return _with_heads(geo, heads, head_major_of(getattr(meta, "kv_cache_layout", None)))


@dataclass
class Conversion:
    """A peer whose K/V placement differs from the local one, planned and validated."""

    meta: Any
    shadow: Any
    plan: PairPlan
    descs: list[tuple[int, int, int]]
    factor: int
    substituted: bool = False

    def check_against(self, stock: list, factor: int | None) -> None:
        """vLLM's own list (built from the shadow) must match pdpatch's in count, order and
        lengths -- only addresses may differ -- or the desc ids would not line up."""
        from pdpatch.kv import GeometryMismatch

        stock_lens = [int(d[1]) for d in stock]
        mine = [d[1] for d in self.descs]
        problem = ""
        if len(stock_lens) != len(mine):
            problem = f"vLLM builds {len(stock_lens)} remote descriptors, pdpatch {len(mine)}"
        elif stock_lens != mine:
            i = next(i for i, (a, b) in enumerate(zip(stock_lens, mine, strict=True)) if a != b)
            problem = (f"descriptor {i} is {stock_lens[i]} B in vLLM's list, {mine[i]} B in "
                       "pdpatch's")
        elif factor is not None and factor != self.factor:
            problem = f"vLLM reads head slice {factor}, pdpatch computed {self.factor}"
        if problem:
            raise GeometryMismatch(
                f"{problem}; this pair needs a descriptor layout pdpatch does not convert",
                self.plan.local, self.plan.remote)


def _shadow(meta: Any, remote: KVGeometry, kind: str) -> Any:
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


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


HEAD_ORDER_ADVICE = (
    "To pair a head-major prefill with a token-major decode (kvcached, PDPATCH_LAYOUT_FORCE), "
    "set enable_permute_local_kv=true in the decode engine's --kv-transfer-config (pdpatch's "
    "layout patch does so where it makes the decode engine token-major, on vLLM 0.19-0.25), "
    "or run the prefill engine token-major too (PDPATCH_LAYOUT_FORCE=1)")


def plan_peer(worker: Any, meta: Any, remote_tp_size: int, version: Version) -> Conversion | None:
    """None: stock code is right for this peer.  A :class:`Conversion`: K/V placements differ
    and pdpatch's descriptors replace vLLM's.  Raises :class:`GeometryMismatch` for a peer whose
    bytes cannot pair with ours (only that peer's requests fail)."""
    from pdpatch.kv import (
        KIND_FUSED,
        KIND_PACKED,
        GeometryMismatch,
        HeadOrderMismatch,
        PairPlan,
        UnsupportedLayout,
        as_tuples,
        handshake_kind,
        slices_for,
    )

    if getattr(worker, "use_mla", False) or getattr(worker, "_has_mamba", False):
        return None
    ctx: _HandshakeCtx | None = getattr(_tls, "handshake", None)
    local_name = getattr(worker, "backend_name", None)
    remote_name = getattr(meta, "attn_backend_name", None)
    mixed = (remote_name is not None and remote_name != local_name) or bool(ctx and ctx.accepted)
    advertised = advertised_geometry(meta)
    if not mixed and _same_regions(worker, meta, advertised, version):
        return None                 # the pass-through: no geometry is built for this peer
    local = local_view(worker, version)
    if local is None:
        return None
    try:
        if local.kind == KIND_PACKED:
            remote_kind = KIND_PACKED
        else:
            remote_kind = handshake_kind(len(meta.kv_caches_base_addr), local.num_layers,
                                         advertised=advertised)
        if remote_kind == local.kind and not mixed:
            return None
        total = int(worker.vllm_config.model_config.get_total_num_kv_heads())
        local_tp = int(getattr(worker, "transfer_tp_size", 0) or getattr(worker, "world_size", 1))
        local_rank = int(getattr(worker, "transfer_tp_rank", getattr(worker, "tp_rank", 0)))
        sl = slices_for(total, local_tp, local_rank, int(remote_tp_size),
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
        remote = remote_geometry(meta, local.num_layers,
                                 KIND_PACKED if local.kind == KIND_PACKED else "auto",
                                 max(1, total // int(remote_tp_size)), advertised)
        if remote_kind == local.kind:
            # Mixed backend names, same placement: accept only an exact byte pairing.
            mine = local.true if (advertised is not None and local.true is not None) else local.view
            PairPlan(mine, remote, local_slice=sl.local, remote_slice=sl.remote,
                     block_size_ratio=sl.block_size_ratio, receiver_reorders_heads=reorders)
            _count("mixed_accepted")
            logger.info("pdpatch kv_segments: accepting %s peer %s for local %s: identical "
                        "%s geometry (%s)", remote_name or "?", meta.engine_id, local_name,
                        remote_kind, remote.describe())
            return None
        plan = PairPlan(local.view, remote, local_slice=sl.local, remote_slice=sl.remote,
                        block_size_ratio=sl.block_size_ratio, receiver_reorders_heads=reorders)
        descs = as_tuples(plan.remote_table())
        return Conversion(meta, _shadow(meta, remote, local.kind), plan, descs, sl.remote.index)
    except (GeometryMismatch, UnsupportedLayout) as exc:
        if isinstance(exc, UnsupportedLayout) and not mixed and advertised is None:
            return None        # nothing pdpatch knows better than stock; let vLLM decide
        err = exc if isinstance(exc, GeometryMismatch) else GeometryMismatch(str(exc))
        if err.local is None:
            err = GeometryMismatch(err.reason, local.view, err.remote)
        if isinstance(err, HeadOrderMismatch):
            err = HeadOrderMismatch(f"{err.reason}. {HEAD_ORDER_ADVICE}", err.local, err.remote)
        _count("rejected", str(err))
        logger.error("pdpatch kv_segments: refusing peer %s (backend %s; local %s): %s",
                     getattr(meta, "engine_id", "?"), remote_name or "?", local_name, err)
        raise err from None


# ------------------------------------------------------------------ descriptor substitution


class _Pending:
    """A descriptor list not yet handed to NIXL (0.19/0.20 substitution, see below)."""

    __slots__ = ("args", "blocks", "kwargs")

    def __init__(self, blocks: list, args: tuple, kwargs: dict) -> None:
        self.blocks, self.args, self.kwargs = blocks, args, kwargs


class _SubstitutingAgent:
    """Stands in for ``worker.nixl_wrapper`` during one 0.19/0.20 ``add_remote_agent`` call.

    There the remote builder is a closure; its list reaches NIXL as
    ``prep_xfer_dlist(<remote agent>, get_xfer_descs(list))``.  On the handshake thread
    ``get_xfer_descs`` is deferred until ``prep_xfer_dlist`` shows which agent the list is for,
    and the remote agent's list is replaced by the converted one.  Everything else, and every
    other thread, goes straight to the real agent.
    """

    def __init__(self, real: Any, conversion: Conversion) -> None:
        self._real = real
        self._conv = conversion
        self._thread = threading.get_ident()
        self._agent: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def add_remote_agent(self, metadata: Any, *args: Any, **kwargs: Any) -> Any:
        name = self._real.add_remote_agent(metadata, *args, **kwargs)
        if threading.get_ident() == self._thread:
            self._agent = name
        return name

    def get_xfer_descs(self, blocks_data: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self._thread:
            return self._real.get_xfer_descs(blocks_data, *args, **kwargs)
        return _Pending(list(blocks_data), args, kwargs)

    def prep_xfer_dlist(self, agent: Any, descs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(descs, _Pending):
            blocks = descs.blocks
            if agent == self._agent and not self._conv.substituted:
                self._conv.check_against(blocks, None)
                blocks = list(self._conv.descs)
                self._conv.substituted = True
            descs = self._real.get_xfer_descs(blocks, *descs.args, **descs.kwargs)
        return self._real.prep_xfer_dlist(agent, descs, *args, **kwargs)


@contextmanager
def _substituting_agent(worker: Any, conversion: Conversion) -> Iterator[None]:
    real = worker.nixl_wrapper
    worker.nixl_wrapper = _SubstitutingAgent(real, conversion)
    try:
        yield
    finally:
        if isinstance(worker.nixl_wrapper, _SubstitutingAgent):
            worker.nixl_wrapper = real


def _make_add_remote_wrapper(version: Version) -> Wrapper:
    closure_builder = versions.release_of(version) < BUILDER_METHOD_FROM

    def add_remote_agent(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not _allowed(instance):
            return wrapped(*args, **kwargs)
        meta = _arg(args, kwargs, 0, "nixl_agent_meta", None)
        rank = _arg(args, kwargs, 1, "remote_tp_rank", 0)
        tp_size = _arg(args, kwargs, 2, "remote_tp_size", 1)
        if meta is None or rank in getattr(instance, "_remote_agents", {}).get(
                getattr(meta, "engine_id", None), {}):
            return wrapped(*args, **kwargs)
        try:
            conversion = plan_peer(instance, meta, tp_size, version)
        except (AttributeError, KeyError, TypeError) as exc:
            # a worker or metadata without what the planning reads (a stand-in): the
            # release's own handshake decides, with its own errors
            logger.warning("pdpatch kv_segments: peer %s not planned (%s: %s); vLLM's own "
                           "handshake runs", getattr(meta, "engine_id", "?"),
                           type(exc).__name__, exc)
            conversion = None
        if conversion is None:
            return wrapped(*args, **kwargs)
        if "nixl_agent_meta" in kwargs:
            kwargs = {**kwargs, "nixl_agent_meta": conversion.shadow}
        else:
            args = (conversion.shadow, *args[1:])
        prev = getattr(_tls, "conversion", None)
        _tls.conversion = conversion
        try:
            if closure_builder:
                with _substituting_agent(instance, conversion):
                    result = wrapped(*args, **kwargs)
            else:
                result = wrapped(*args, **kwargs)
        finally:
            _tls.conversion = prev
        if not conversion.substituted:
            from pdpatch.kv import GeometryMismatch

            raise GeometryMismatch(
                "vLLM built no remote descriptor list pdpatch could replace",
                conversion.plan.local, conversion.plan.remote)
        _count("conversions")
        staged = _stage_peer(instance, meta.engine_id, rank, conversion.plan.remote)
        logger.info("pdpatch kv_segments: peer %s rank %s converted (%s -> %s, %d descriptors%s)",
                    meta.engine_id, rank, conversion.plan.remote.kind, conversion.plan.local.kind,
                    len(conversion.descs), ", READs staged" if staged else "")
        return result

    return add_remote_agent


def _stage_peer(worker: Any, engine_id: str, rank: int, remote: KVGeometry) -> bool:
    """Route the converted peer's READs through the staging agent, when there is one; gap
    READs stay inside ``remote``'s read ranges."""
    from pdpatch.kv.staging import StagingAgent

    agent = getattr(worker, "nixl_wrapper", None)
    handle = (getattr(worker, "dst_xfer_side_handles", None) or {}).get(engine_id, {}).get(rank)
    if not isinstance(agent, StagingAgent) or handle is None:
        return False
    return agent.mark_converted(handle, f"{engine_id} rank {rank}", remote.read_ranges())


def _build_fa_remote_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    conversion: Conversion | None = getattr(_tls, "conversion", None)
    meta = _arg(args, kwargs, 1, "nixl_agent_meta", None)
    if conversion is None or meta is not conversion.shadow:
        return wrapped(*args, **kwargs)
    stock = wrapped(*args, **kwargs)
    plan = _arg(args, kwargs, 0, "plan", None)
    conversion.check_against(stock, getattr(plan, "rank_offset_factor", None))
    conversion.substituted = True
    return list(conversion.descs)


# ------------------------------------------------------------------------------ registration


def _targets(version: Version) -> list[Target]:
    out: list[Target] = []

    def add(sites: tuple, wrapper: Wrapper) -> None:
        site = vllm_sites.lookup(sites, version)
        if site is not None:
            out.append(Target(site.module, site.qualname, wrapper))

    handshake = vllm_sites.lookup(vllm_sites.NIXL_HANDSHAKE, version)
    if handshake is None:
        return []
    add(vllm_sites.COMPAT_HASH, _hash_wrapper)
    out.append(Target(handshake.module, handshake.qualname,
                      _make_handshake_wrapper(handshake.module)))
    add(vllm_sites.REGISTER_KV_CACHES, _make_register_wrapper(version))
    add(vllm_sites.RESTORE_KV_CACHES, _restore_wrapper)
    add(vllm_sites.ADD_REMOTE_AGENT, _make_add_remote_wrapper(version))
    if version in vllm_sites.KV_SPLIT_DESCRIPTORS:
        add(vllm_sites.BUILD_FA_REMOTE, _build_fa_remote_wrapper)
    return out


PATCH = Patch(
    name=NAME,
    summary="P/D with different K/V segment layouts (FlashAttention split vs FlashInfer fused, "
            "kvcached split-half) convert descriptors byte-exactly, their READs staged so runs "
            "of blocks merge (0.19-0.25, PDPATCH_KV_STAGING_MIB); mixed backend names with "
            "identical geometry are accepted, real differences fail that peer clearly",
    versions=vllm_sites.SUPPORTED,
    why_version="written against vLLM 0.19-0.33 sources; later releases not yet verified",
    targets=_targets,
    options=(STAGING_ENV, GAP_ENV),
)

__all__ = ["FIELD", "INTERCHANGEABLE", "NAME", "PATCH", "Conversion", "advertised_geometry",
           "alternates_for", "head_major_of", "local_geometry", "local_view", "payload_class",
           "plan_peer", "remote_geometry", "scoped_payload", "stats"]
