"""num_blocks reconciliation on the installed vLLM's real NIXL workers (0.34 in the test venv;
CPU, recording NIXL agent).

Every check is byte-range by byte-range: what the worker registers, what it advertises, the local
descriptor of every (region, block id), and the remote descriptors a real peer worker builds from
the advertised metadata, against the bytes each planned block occupies in kvcached-style views.
"""

from __future__ import annotations

import kvc_harness as h
import pytest

from pdpatch import block_counts, versions

pytestmark = pytest.mark.filterwarnings("ignore")

NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PLANNED = 12
VIRTUAL = 29          # not a multiple of the plan, like every real kvcached/vLLM pair


@pytest.fixture
def version():
    return versions.vllm_version()


@pytest.fixture
def patched(fresh_pdpatch):
    fresh_pdpatch.install()        # a fresh state for every patch
    yield fresh_pdpatch


@pytest.mark.parametrize("variant", ["per-layer", "layer-interleaved"])
def test_stock_vllm_rejects_over_allocated_views(fresh_pdpatch, version, variant):
    """The bug being fixed, on the real code: without pdpatch 0.30+ cannot register them
    (0.34.0 base_worker.py L1806-1815)."""
    alloc = h.kvcached_views(NAMES, VIRTUAL, variant)
    with pytest.raises(AssertionError, match="cannot be partitioned into NIXL regions"):
        h.register(alloc, PLANNED, version)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("variant", ["per-layer", "layer-interleaved"])
def test_over_allocated_views_register_exactly_the_plan(patched, version, variant, layout):
    from pdpatch.patches import num_blocks

    alloc = h.kvcached_views(NAMES, VIRTUAL, variant, layout)
    reg = h.register(alloc, PLANNED, version)
    w = reg.worker
    # advertised == planned, per region, and in the peer-facing payload
    meta = h.decoded_metadata(w)
    assert meta.num_blocks == PLANNED
    assert set(meta.region_num_blocks) == {PLANNED}
    assert w.dst_num_blocks[w.engine_id] == PLANNED
    # registered bytes == the planned blocks' bytes, nothing past them
    assert h.registered_bytes(reg.nixl) == h.planned_bytes(alloc, PLANNED)
    # every local desc id resolves to exactly its block's bytes
    h.check_descs_resolve(h.local_descs(reg), h.region_counts(w), alloc, PLANNED,
                          h.registered_bytes(reg.nixl))
    assert "sliced to the planned 12" in patched.state_of(num_blocks.NAME).last
    assert patched.status()["patches"]["num_blocks"]["runtime"] == "num_blocks=pdpatch"


@pytest.mark.parametrize("variant", ["per-layer", "layer-interleaved"])
def test_peer_resolves_advertised_blocks_to_the_right_bytes(patched, version, variant):
    """A real stock peer worker builds its remote descriptors from what we advertise."""
    alloc = h.kvcached_views(NAMES, VIRTUAL, variant)
    reg = h.register(alloc, PLANNED, version)
    peer = h.register(h.kvcached_views(NAMES, 10, "per-layer"), 10, version, engine_id="peer")
    meta = h.decoded_metadata(reg.worker)
    remote = h.peer_remote_descs(peer, meta, version)
    h.check_descs_resolve(remote, list(meta.region_num_blocks), alloc, PLANNED,
                          h.registered_bytes(reg.nixl))


def test_exactly_sized_views_are_left_alone(patched, version):
    from pdpatch.patches import num_blocks

    alloc = h.kvcached_views(NAMES, PLANNED, "per-layer")
    with h.kvcached_running(PLANNED):
        reg = h.register(alloc, PLANNED, version)
    for name, t in reg.worker.device_kv_caches.items():     # the same memory, same geometry
        orig = alloc.views[name]
        assert (t.data_ptr(), t.shape, t.stride()) == (orig.data_ptr(), orig.shape, orig.stride())
    assert h.registered_bytes(reg.nixl) == h.planned_bytes(alloc, PLANNED)
    assert h.decoded_metadata(reg.worker).num_blocks == PLANNED
    assert "hold the planned 12 blocks" in patched.state_of(num_blocks.NAME).last


@pytest.mark.parametrize("variant", ["per-layer", "layer-interleaved"])
def test_under_allocated_views_fail_with_a_clear_error(patched, version, variant):
    """kvcached in the worker and fewer blocks than planned (without kvcached the release's own
    error stands: ``test_kvcached_matrix``)."""
    alloc = h.kvcached_views(NAMES, PLANNED - 4, variant)
    with h.kvcached_running(PLANNED - 4), pytest.raises(block_counts.UnderAllocatedError,
                       match=r"fewer blocks than the engine planned: layer "
                             r"'model\.layers\.\d\.self_attn\.attn' has 8 .* the plan is 12"):
        h.register(alloc, PLANNED, version)


def test_shared_kv_cache_config_is_never_mutated(patched, version):
    seen = {}
    alloc = h.kvcached_views(NAMES, VIRTUAL, "per-layer")
    reg = h.register(alloc, PLANNED, version,
                     before_register=lambda w: seen.setdefault("kvc", w.kv_cache_config))
    assert seen["kvc"].num_blocks == PLANNED
    assert reg.worker.kv_cache_config is seen["kvc"]


def test_kvcached_style_num_blocks_rewrite_is_undone(patched, version):
    """kvcached's register patch (when it wraps outside pdpatch) sets ``worker.num_blocks`` to
    the virtual count before calling in; pdpatch restores the plan so one reconciliation holds."""
    from pdpatch.patches import num_blocks

    alloc = h.kvcached_views(NAMES, VIRTUAL, "per-layer")

    def kvcached_rewrite(worker):
        worker.num_blocks = VIRTUAL

    reg = h.register(alloc, PLANNED, version, before_register=kvcached_rewrite)
    assert h.decoded_metadata(reg.worker).num_blocks == PLANNED
    assert "kvcached's num_blocks rewrite undone" in patched.state_of(num_blocks.NAME).last


def test_virtual_mode_advertises_and_registers_the_whole_tensors(patched, version):
    seen = {}
    alloc = h.kvcached_views(NAMES, VIRTUAL, "per-layer")
    reg = h.register(alloc, PLANNED, version,
                     extra={"pdpatch": {"num_blocks_mode": "virtual"}},
                     before_register=lambda w: seen.setdefault("kvc", w.kv_cache_config))
    meta = h.decoded_metadata(reg.worker)
    assert meta.num_blocks == VIRTUAL
    assert list(meta.region_num_blocks) == [VIRTUAL] * len(NAMES)
    h.check_descs_resolve(h.local_descs(reg), h.region_counts(reg.worker), alloc, VIRTUAL,
                          h.registered_bytes(reg.nixl))
    # the worker got a private copy; the shared config keeps the plan
    assert seen["kvc"].num_blocks == PLANNED
    assert reg.worker.kv_cache_config is not seen["kvc"]
    assert reg.worker.kv_cache_config.num_blocks == VIRTUAL


def test_virtual_mode_rejects_unequal_tensors(patched, version):
    alloc = h.kvcached_views(NAMES, VIRTUAL, "per-layer")
    alloc.views[NAMES[1]] = alloc.views[NAMES[1]].narrow(0, 0, VIRTUAL - 3)
    with pytest.raises(block_counts.InconsistentBlocksError, match="different block counts"):
        h.register(alloc, PLANNED, version, extra={"pdpatch": {"num_blocks_mode": "virtual"}})


def test_extra_config_switches_it_off(patched, version):
    alloc = h.kvcached_views(NAMES, VIRTUAL, "per-layer")
    with pytest.raises(AssertionError, match="cannot be partitioned"):
        h.register(alloc, PLANNED, version, extra={"pdpatch": {"num_blocks": False}})


def test_push_worker_is_covered(patched, version):
    """The push worker overrides register_kv_caches and calls super(): the base wrap covers it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    alloc = h.kvcached_views(NAMES, VIRTUAL, "layer-interleaved")
    reg = h.register(alloc, PLANNED, version, worker_cls=NixlPushConnectorWorker)
    assert h.decoded_metadata(reg.worker).num_blocks == PLANNED
    assert h.registered_bytes(reg.nixl) == h.planned_bytes(alloc, PLANNED)


def test_rebased_views_alias_the_original_memory(patched, version):
    alloc = h.kvcached_views(NAMES, VIRTUAL, "layer-interleaved")
    reg = h.register(alloc, PLANNED, version)
    for name, t in reg.worker.device_kv_caches.items():
        orig = alloc.views[name]
        assert t.data_ptr() == orig.data_ptr()
        assert t.untyped_storage().nbytes() == PLANNED * len(NAMES) * alloc.block_bytes
        t[PLANNED - 1].fill_(3.0)                      # writes land in kvcached's memory
        assert bool((orig[PLANNED - 1] == 3.0).all())
