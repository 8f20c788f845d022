"""kvcached state detection from ``sys.modules`` (kvcached itself needs CUDA: its module globals
are stood in by a plain module object carrying the same names kvcached 0.1.6 defines)."""

from __future__ import annotations

import sys
import types

import pytest

from pdpatch import kvcached


def interfaces(**globals_):
    mod = types.ModuleType(kvcached.INTERFACES_MODULE)
    mod._kvcached_initialized = False
    mod._is_worker = False
    mod._contiguous_layout = True
    mod._created_kv_tensor_capacity = {}
    for k, v in globals_.items():
        setattr(mod, k, v)
    return {kvcached.INTERFACES_MODULE: mod}


def test_absent():
    state = kvcached.read_state({}, {})
    assert not state.imported and not state.in_deployment and not state.allocated
    assert state.describe() == "kvcached absent"


def test_env_alone_is_not_deployment():
    state = kvcached.read_state({}, {"ENABLE_KVCACHED": "true"})
    assert state.env_enabled and not state.in_deployment


def test_loaded_but_not_initialised():
    state = kvcached.read_state(interfaces(), {})
    assert state.imported and not state.in_deployment
    assert "not initialised" in state.describe()


def test_engine_core_initialised_before_any_tensor():
    state = kvcached.read_state(interfaces(_kvcached_initialized=True, _is_worker=False), {})
    assert state.in_deployment and not state.allocated and state.is_worker is False
    assert state.describe() == "kvcached initialised (engine-core, contiguous layout)"


def test_worker_with_capacity():
    caps = {0: {"num_blocks": 185344, "ftensor_bytes_per_layer": 1 << 30, "num_layers": 28,
                "num_kv_buffers": 2}}
    state = kvcached.read_state(interfaces(_kvcached_initialized=True, _is_worker=True,
                                           _contiguous_layout=False,
                                           _created_kv_tensor_capacity=caps), {})
    assert state.allocated and state.virtual_blocks(0) == 185344 and state.virtual_blocks(1) is None
    assert "worker, non-contiguous layout; group 0: 185344 virtual blocks" in state.describe()


def test_reads_the_live_sys_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, kvcached.INTERFACES_MODULE,
                        interfaces(_kvcached_initialized=True)[kvcached.INTERFACES_MODULE])
    assert kvcached.read_state().in_deployment


class Connector:
    @classmethod
    def get_required_kvcache_layout(cls, cfg):
        return "HND"


class PullConnector(Connector):
    pass


class Worker:
    def register_kv_caches(self, kv):
        return kv


class PullWorker(Worker):
    pass


@pytest.fixture
def kvcached_patched_classes():
    """Apply kvcached 0.1.6's marker assignments (nixl_compat.py) to local classes."""
    PullConnector._original_get_layout = PullConnector.get_required_kvcache_layout
    Worker._kvcached_original_register_kv_caches = Worker.register_kv_caches
    Worker._kvcached_register_patched = True
    yield
    del PullConnector._original_get_layout
    del Worker._kvcached_original_register_kv_caches
    del Worker._kvcached_register_patched


def test_markers(kvcached_patched_classes):
    assert kvcached.layout_patched(Connector, PullConnector)
    assert not kvcached.layout_patched(Connector)
    assert kvcached.register_patched(PullWorker) and kvcached.register_patched(Worker)
    assert not kvcached.register_patched(None)


def test_no_markers():
    assert not kvcached.layout_patched(PullConnector)
    assert not kvcached.register_patched(PullWorker)
    assert not kvcached.topology_patched(Worker)


def test_pending_force_split():
    mod = types.ModuleType(kvcached.NIXL_COMPAT_MODULE)
    mod.NixlConnectorPatch = type("NixlConnectorPatch", (), {"_pending_force_split": True})
    assert kvcached.pending_force_split({kvcached.NIXL_COMPAT_MODULE: mod})
    assert not kvcached.pending_force_split({})
