"""``kv_segments`` building blocks against the installed vLLM's real objects (no workers): head
slices vs vLLM's own ``compute_tp_mapping``, the scoped wire classes and msgspec, the hash
alternates, the shadow metadata, the descriptor cross-check, and the 5-D heads-dim inference
it needs."""

from __future__ import annotations

import dataclasses
import threading

import msgspec
import numpy as np
import pytest
import torch

from pdpatch import config, installer
from pdpatch.kv import (
    KIND_FUSED,
    KIND_SPLIT,
    GeometryMismatch,
    UnsupportedLayout,
    infer_geometry,
    slices_for,
)
from pdpatch.kv.geometry import geometry_from_handshake
from pdpatch.patches import kv_segments as ks
from pdpatch.patches.kv_segments import handshake, planning, settings

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


# ------------------------------------------------------------------------ head slices


def _vllm_mapping(total: int, local_tp: int, rank: int, remote_tp: int):
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    topo = TransferTopology(tp_rank=rank, tp_size=local_tp, block_size=16, engine_id="local",
                            is_mla=False, is_mamba=False, total_num_kv_heads=total,
                            attn_backends=[CPUAttentionBackend])
    return compute_tp_mapping(topo, remote_tp, (FullAttentionSpec,))


GRID = [(t, lt, rt) for t in (1, 2, 4, 8) for lt in (1, 2, 4, 8) for rt in (1, 2, 4, 8)
        if not (rt > lt and rt > t)]     # vLLM refuses P TP > D TP with replicated P KV


@pytest.mark.parametrize(("total", "local_tp", "remote_tp"), GRID)
def test_slices_match_vllms_tp_mapping(total: int, local_tp: int, remote_tp: int) -> None:
    for rank in range(local_tp):
        vm = _vllm_mapping(total, local_tp, rank, remote_tp)
        sl = slices_for(total, local_tp, rank, remote_tp, 16, 16)
        reads = len(vm.source_ranks_per_group[0])
        assert sl.local.parts == reads, (total, local_tp, remote_tp, rank)
        assert sl.remote.index == vm.rank_offset_factor, (total, local_tp, remote_tp, rank)
        h_local, h_remote = max(1, total // local_tp), max(1, total // remote_tp)
        # bytes: local segment / reads == remote segment / parts (head counts stand for bytes)
        assert h_local * sl.remote.parts == h_remote * sl.local.parts


def test_slices_refuse_non_divisible_sizes() -> None:
    with pytest.raises(GeometryMismatch, match="not a multiple of the peer's 48 tokens"):
        slices_for(2, 1, 0, 1, 64, 48)
    assert slices_for(2, 1, 0, 1, 32, 16).block_size_ratio == 2


@pytest.mark.parametrize(("layout", "want"), [("HND", True), ("NHD", False), ("LBHNC", True),
                                              ("LBNHC", False), ("BLHNC", True), (None, None),
                                              ("", None)])
def test_head_order_from_layout_names(layout, want) -> None:
    assert planning.head_major_of(layout) is want


# ------------------------------------------------------------------ 5-D heads dimension


def test_cpu_style_5d_tensor_reads_its_heads_dim() -> None:
    """vLLM's CPU backend up to 0.22 is (2, N, H, bs, D): heads at dim 2, not 3."""
    t = torch.zeros(2, 6, 4, 16, 8, dtype=torch.bfloat16)
    g = infer_geometry([(t.shape, t.stride(), 2, t.data_ptr())], heads_dim_5d=2)
    assert g.layers[0].num_heads == 4 and g.layers[0].head_major is True
    wrong = infer_geometry([(t.shape, t.stride(), 2, t.data_ptr())])       # FA's order
    assert wrong.layers[0].num_heads == 16 and wrong.layers[0].head_major is False
    with pytest.raises(UnsupportedLayout, match="heads_dim_5d must be 2 or 3"):
        infer_geometry([(t.shape, t.stride(), 2, t.data_ptr())], heads_dim_5d=4)


# ------------------------------------------------------------- wire classes and msgspec


def _classes():
    import importlib

    mod = importlib.import_module(f"{NIXL}.base_worker")
    return mod, mod.NixlAgentMetadata, mod.NixlHandshakePayload


def _meta(cls, **extra):
    fields = dict(engine_id="e", agent_metadata=b"a", kv_caches_base_addr=[1, 2], device_id=0,
                  num_blocks=4, block_lens=[8, 8], block_strides=[8, 8], kv_cache_layout="LBHNC",
                  block_size=16, ssm_sizes=(0, 0), attn_backend_name="FLASH_ATTN",
                  physical_blocks_per_logical_kv_block=1)
    return cls(**fields, **extra)


def test_advertised_field_is_read_from_the_raw_bytes_and_vllm_sees_a_stock_object() -> None:
    _, stock, payload = _classes()
    wire = {"v": 1, "dev": 0, "layers": [[1, 8, 4, [["KV", 0, 8]], 2, 1]]}
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(_meta(stock)))
    raw[settings.FIELD] = wire                      # what a pdpatch P serves
    encoded = msgspec.msgpack.encode(raw)
    plain = msgspec.msgpack.Decoder(stock).decode(encoded)
    assert type(plain) is stock and plain == _meta(stock)      # vLLM's own object, unchanged
    worker = type("W", (), {"compat_hash": "h", "backend_name": "FLASH_ATTN"})()
    dec = msgspec.msgpack.Decoder(handshake.payload_class(payload))
    with handshake.handshake_scope(worker):
        dec.decode(msgspec.msgpack.encode(payload("h", encoded)))
        assert handshake.advertised_geometry(plain) == wire
        other = dataclasses.replace(plain, agent_metadata=b"b")
        assert handshake.advertised_geometry(other) is None
    assert handshake.advertised_geometry(plain) is None            # outside a handshake: nothing


def test_payload_post_init_swaps_only_an_alternate_hash() -> None:
    _, _, payload = _classes()
    mine = handshake.payload_class(payload)
    installer.reset_state()
    installer.state_of(ks.NAME).alternates["local-hash"] = {"fi-hash": "FLASHINFER"}
    worker = type("W", (), {"compat_hash": "local-hash", "backend_name": "FLASH_ATTN"})()
    dec = msgspec.msgpack.Decoder(mine)
    with handshake.handshake_scope(worker) as ctx:
        got = dec.decode(msgspec.msgpack.encode(payload("fi-hash", b"x")))
        assert got.compatibility_hash == "local-hash"
        assert ctx.accepted == {"fi-hash": "FLASHINFER"}
        other = dec.decode(msgspec.msgpack.encode(payload("other-model-hash", b"x")))
        assert other.compatibility_hash == "other-model-hash"        # vLLM still refuses it
    outside = dec.decode(msgspec.msgpack.encode(payload("fi-hash", b"x")))
    assert outside.compatibility_hash == "fi-hash"                   # no handshake: untouched
    assert installer.state_of(ks.NAME).hash_alternates_accepted == 1


def test_scoped_payload_class_nests_across_threads_and_restores() -> None:
    mod, _, stock_payload = _classes()
    scoped = handshake.ScopedPayloadClass()
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        with scoped.active(mod):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_thread)
    with scoped.active(mod):
        assert mod.NixlHandshakePayload is not stock_payload
        assert mod.NixlHandshakePayload.__dict__["_pdpatch_base"] is stock_payload
        t.start()
        assert inside.wait(10)
        assert scoped.depth(mod.__name__) == 2
    assert mod.NixlHandshakePayload is not stock_payload    # the other handshake still runs
    release.set()
    t.join(10)
    assert mod.NixlHandshakePayload is stock_payload
    assert scoped.depth(mod.__name__) == 0


def test_scoped_payload_class_leaves_a_foreign_replacement_alone() -> None:
    mod, _, stock_payload = _classes()
    scoped = handshake.ScopedPayloadClass()
    foreign = type("Foreign", (stock_payload,), {})
    try:
        with scoped.active(mod):
            mod.NixlHandshakePayload = foreign         # someone else patched meanwhile
        assert mod.NixlHandshakePayload is foreign
    finally:
        mod.NixlHandshakePayload = stock_payload


# ----------------------------------------------------------------------- hash alternates


def test_hash_wrapper_returns_vllms_hash_and_records_alternates() -> None:
    import robust_worker as rw
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        compute_nixl_compatibility_hash as real,
    )

    installer.reset_state()
    cfg = rw.vllm_config("llama", 2, "kv_consumer", 1)
    got = handshake.hash_wrapper(real, None, (cfg, "FLASH_ATTN"), {"transfer_mode": "pull"})
    assert got == real(cfg, "FLASH_ATTN", transfer_mode="pull")
    alts = handshake.alternates_for(got)
    assert alts == {real(cfg, n, transfer_mode="pull"): n for n in ("FLASHINFER", "TRITON_ATTN")}
    # a backend outside the set gets none; a push-mode hash is never an alternate of pull
    cpu = handshake.hash_wrapper(real, None, (cfg, "CPU_ATTN"), {})
    assert handshake.alternates_for(cpu) == {}
    assert real(cfg, "FLASHINFER", transfer_mode="push") not in alts


def test_operator_can_extend_the_interchangeable_set() -> None:
    import robust_worker as rw

    cfg = rw.vllm_config("llama", 2, "kv_consumer", 1,
                         extra={"pdpatch": {"kv_segments_backends": ["FLEX_ATTENTION"]}})
    assert "FLEX_ATTENTION" in settings.interchangeable(cfg)
    bad = rw.vllm_config("llama", 2, "kv_consumer", 1,
                         extra={"pdpatch": {"kv_segments_backends": "FLEX_ATTENTION"}})
    with pytest.raises(config.ConfigError, match="kv_segments_backends"):
        settings.interchangeable(bad)


# --------------------------------------------------------- shadow metadata, cross-check


def _split_remote():
    # 2 layers, K and V regions 4096 B per block, 12 blocks
    return geometry_from_handshake([1000, 100000, 200000, 300000], [4096] * 4, 12,
                                   num_layers=2)


def test_shadow_describes_the_peer_in_local_terms() -> None:
    _, stock, _ = _classes()
    meta = _meta(stock)
    remote = _split_remote()
    fused = planning.shadow(meta, remote, KIND_FUSED)
    assert fused.kv_caches_base_addr == [1000, 200000] and fused.block_lens == [8192, 8192]
    split = planning.shadow(meta, remote, KIND_SPLIT)
    assert split.kv_caches_base_addr == [1000, 100000, 200000, 300000]
    assert split.block_lens == [4096] * 4
    assert dataclasses.replace(split, kv_caches_base_addr=[1, 2], block_lens=[8, 8]) == meta


def test_cross_check_refuses_any_difference_but_addresses() -> None:
    conv = planning.Conversion(meta=None, shadow=None, plan=type("P", (), {"local": None,
                                                                     "remote": None})(),
                         descs=np.array([(10, 64, 0), (20, 64, 0)], dtype=np.uint64), factor=1)
    conv.check_against([(999, 64, 0), (888, 64, 0)], 1)            # addresses may differ
    for stock, factor, match in (([(1, 64, 0)], None, "builds 1 remote descriptors"),
                                 ([(1, 64, 0), (2, 32, 0)], None, "descriptor 1 is 32 B"),
                                 ([(1, 64, 0), (2, 64, 0)], 0, "head slice 0")):
        with pytest.raises(GeometryMismatch, match=match):
            conv.check_against(stock, factor)


def test_patch_targets_per_release() -> None:
    from packaging.version import Version

    def names(ver: str) -> list[str]:
        return [t.qualname.rsplit(".", 1)[-1] for t in ks._targets(Version(ver))]

    common = ["compute_nixl_compatibility_hash", "_nixl_handshake", "register_kv_caches"]
    assert names("0.19.0") == [*common, "add_remote_agent"]          # closure builder
    assert names("0.22.1") == [*common, "add_remote_agent", "_build_fa_remote"]
    assert names("0.25.1") == [*common, "add_remote_agent", "_build_fa_remote"]
    assert names("0.28.0") == [*common, "add_remote_agent"]          # no split path left
    assert names("0.33.0") == [*common, "restore_kv_caches", "add_remote_agent"]
    # 0.34: the same five sites; _build_fa_remote (now taking local_region_ids) stays unwrapped
    assert names("0.34.0") == [*common, "restore_kv_caches", "add_remote_agent"]


def test_settings_readers_and_the_names_the_staging_agent_reports() -> None:
    """The patch reads its options as ``pdpatch.config`` declares them (values, ranges and
    errors: test_config.py); the staging agent names them in its messages."""
    assert (settings.staging_mib({}), settings.gap_kib({})) == (settings.STAGING_DEFAULT_MIB, None)
    assert settings.staging_mib({settings.STAGING_ENV: " 512 "}) == 512
    assert settings.gap_kib({settings.GAP_ENV: "2048"}) == 2048
    from pdpatch.patches.kv_segments.staged_reads import install_staging

    worker = type("W", (), {"nixl_wrapper": object()})()
    install_staging(worker, {})
    agent = worker.nixl_wrapper
    assert (agent._gap_setting, agent._capacity_setting) == (settings.GAP_ENV, settings.STAGING_ENV)


@pytest.mark.parametrize(("role", "reads"), [("kv_producer", False), ("kv_consumer", True),
                                             ("kv_both", True)])
def test_only_a_worker_that_pulls_kv_builds_its_list_table_at_start_up(role: str,
                                                                      reads: bool) -> None:
    """Eager staging (coalescing on, or a kvcached pool) is for a worker that READs: a
    prefill-only worker's table would be start-up work and memory for nothing."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    from pdpatch.patches.kv_segments.staged_reads import _reads_kv

    cfg = KVTransferConfig(kv_connector="NixlConnector", kv_role=role)
    assert _reads_kv(SimpleNamespace(kv_transfer_config=cfg)) is reads


@pytest.mark.parametrize(("role", "coalescing", "at_start"), [
    ("kv_consumer", True, True), ("kv_both", True, True), ("kv_producer", True, False),
    ("kv_consumer", False, False)])
def test_a_worker_that_will_stage_every_read_makes_its_buffer_at_start_up(
        monkeypatch, role: str, coalescing: bool, at_start: bool) -> None:
    """Coalescing on and a worker that READs: its staging buffer is made when vLLM prepares
    its list (``buffer_at_start``), not in its first request's READ."""
    from vllm.config import KVTransferConfig

    from pdpatch.kv.staging import StagingAgent
    from pdpatch.patches.kv_segments.staged_reads import install_staging

    monkeypatch.setenv("PDPATCH_KV_COALESCE", "1" if coalescing else "0")
    cfg = KVTransferConfig(kv_connector="NixlConnector", kv_role=role)
    worker = type("W", (), {"nixl_wrapper": object(), "kv_transfer_config": cfg})()
    install_staging(worker, {})
    assert isinstance(worker.nixl_wrapper, StagingAgent)
    assert worker.nixl_wrapper._buffer_at_start is at_start
