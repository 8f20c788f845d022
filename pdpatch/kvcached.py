"""What kvcached is doing in this process, read from ``sys.modules`` without importing kvcached.

Why not import it: importing kvcached pulls in torch and its CUDA extension and prints warnings;
and "kvcached is installed" or ``ENABLE_KVCACHED=true`` is not the same as "kvcached allocates the
KV cache here" (kvcached 0.1.6 still patches NixlConnector on vLLM releases where it allocates
nothing).  What counts is kvcached's own runtime state:

* ``kvcached.integration.vllm.interfaces._kvcached_initialized`` -- ``init_kvcached()`` ran in this
  process.  kvcached's ``EngineCore.__init__`` patch calls it (``is_worker=False``) *before*
  vLLM builds the executor and resolves the KV-cache layout (vLLM >= 0.29 resolves it there),
  and its ``GPUModelRunner.__init__`` patch calls it in every worker (``is_worker=True``) before
  the KV cache is allocated (vLLM <= 0.28 consults the layout there).
* ``interfaces._created_kv_tensor_capacity`` -- per KV-cache group, the *virtual* block capacity of
  the tensors kvcached created (``num_blocks`` per layer), set by ``alloc_kv_cache``.
* ``interfaces._contiguous_layout`` -- kvcached's compound-page layout switch.
* kvcached's NixlConnector patch (``nixl_compat.py``) leaves markers on the classes it replaced:
  ``<connector>._original_get_layout``, ``<worker owner>._kvcached_register_patched`` /
  ``_kvcached_original_register_kv_caches``, ``TransferTopology._kvcached_topology_patched``.

Which vLLM releases kvcached runs on is kvcached's to say, and this module reads only what it
did.  kvcached 0.1.6 refuses vLLM 0.31 and later outright: with ``ENABLE_KVCACHED`` set, its
``EngineCore.__init__`` patch raises ``KVCachedConfigError("kvcached has no runner adapter for
vLLM ...")`` for any release >= 0.29 outside ``>=0.29.0,<0.31.0`` (kvcached 0.1.6
``integration/vllm/patches.py`` L388, L1178-1185), before its ``init_kvcached`` (L1235).  So on
vLLM 0.31-0.34 ``_kvcached_initialized`` stays False, :attr:`KvcachedState.in_deployment` is
never true through kvcached 0.1.6, and no kvcached engine starts (a kvcached decode engine on
0.33 on an H200: docs/proof.md).  What may still load there, with ``ENABLE_KVCACHED`` unset,
is its NixlConnector patch (the markers below), which then defers to vLLM's own code.  The
markers are kvcached 0.1.6's: re-check them when a kvcached release adapts vLLM 0.31+.

Pure module: no vLLM or kvcached import; classes to inspect are passed in.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

INTERFACES_MODULE = "kvcached.integration.vllm.interfaces"
NIXL_COMPAT_MODULE = "kvcached.integration.vllm.nixl_compat"

# Markers kvcached's nixl_compat.py sets (kvcached 0.1.6).
LAYOUT_MARKER = "_original_get_layout"
REGISTER_MARKER = "_kvcached_register_patched"
REGISTER_ORIGINAL = "_kvcached_original_register_kv_caches"
TOPOLOGY_MARKER = "_kvcached_topology_patched"

_TRUE = ("1", "true")


@dataclass(frozen=True)
class KvcachedState:
    """One reading of kvcached's state in this process."""

    imported: bool = False             # kvcached's vLLM interfaces module is loaded
    initialized: bool = False          # init_kvcached() ran here
    is_worker: bool | None = None      # None when not initialized / unknown
    contiguous_layout: bool | None = None
    capacity: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    env_enabled: bool = False          # ENABLE_KVCACHED (kvcached reads it per call)

    @property
    def in_deployment(self) -> bool:
        """kvcached runs in this engine: it initialised itself in this process.

        In EngineCore this is true before any KV tensor exists (the moment vLLM >= 0.29 resolves
        the layout), so it is the signal the layout override keys on.
        """
        return self.initialized

    @property
    def allocated(self) -> bool:
        """kvcached created KV tensors in this process (a worker after ``alloc_kv_cache``)."""
        return bool(self.capacity)

    def virtual_blocks(self, group_id: int = 0) -> int | None:
        """Per-layer virtual block capacity kvcached reserved for a KV-cache group."""
        rec = self.capacity.get(group_id)
        if rec is None:
            return None
        value = rec.get("num_blocks")
        return int(value) if value is not None else None

    def describe(self) -> str:
        if not self.imported:
            return "kvcached absent"
        if not self.initialized:
            return "kvcached loaded, not initialised in this process"
        role = "worker" if self.is_worker else "engine-core" if self.is_worker is False else "?"
        caps = ", ".join(f"group {g}: {r.get('num_blocks')} virtual blocks"
                         for g, r in sorted(self.capacity.items()))
        layout = {True: "contiguous", False: "non-contiguous", None: "?"}[self.contiguous_layout]
        return f"kvcached initialised ({role}, {layout} layout{'; ' + caps if caps else ''})"


def read_state(modules: Mapping[str, Any] | None = None,
               env: Mapping[str, str] | None = None) -> KvcachedState:
    """Read kvcached's module globals if, and only if, kvcached already loaded them."""
    modules = sys.modules if modules is None else modules
    env = os.environ if env is None else env
    env_enabled = env.get("ENABLE_KVCACHED", "").strip().lower() in _TRUE
    mod = modules.get(INTERFACES_MODULE)
    if mod is None:
        return KvcachedState(env_enabled=env_enabled)
    initialized = bool(getattr(mod, "_kvcached_initialized", False))
    is_worker = getattr(mod, "_is_worker", None) if initialized else None
    contiguous = getattr(mod, "_contiguous_layout", None)
    raw_caps = getattr(mod, "_created_kv_tensor_capacity", None) or {}
    capacity: dict[int, dict[str, int]] = {}
    if isinstance(raw_caps, Mapping):
        for group, rec in raw_caps.items():
            if isinstance(rec, Mapping):
                capacity[int(group)] = {str(k): int(v) for k, v in rec.items()
                                        if isinstance(v, int)}
    return KvcachedState(
        imported=True,
        initialized=initialized,
        is_worker=None if is_worker is None else bool(is_worker),
        contiguous_layout=None if contiguous is None else bool(contiguous),
        capacity=capacity,
        env_enabled=env_enabled,
    )


def _marker(cls: Any, name: str) -> bool:
    """A marker kvcached set on ``cls`` itself or on a class it inherits from."""
    if cls is None:
        return False
    return any(name in vars(c) for c in getattr(cls, "__mro__", (cls,)))


def layout_patched(*connector_classes: Any) -> bool:
    """kvcached replaced ``get_required_kvcache_layout`` on one of these connector classes."""
    return any(_marker(c, LAYOUT_MARKER) for c in connector_classes)


def register_patched(worker_cls: Any) -> bool:
    """kvcached replaced ``register_kv_caches`` on ``worker_cls`` or a base of it."""
    if worker_cls is None:
        return False
    return any(bool(vars(c).get(REGISTER_MARKER, False))
               for c in getattr(worker_cls, "__mro__", (worker_cls,)))


def topology_patched(topology_cls: Any) -> bool:
    return bool(getattr(topology_cls, TOPOLOGY_MARKER, False)) if topology_cls else False


def pending_force_split(modules: Mapping[str, Any] | None = None) -> bool:
    """kvcached's class-level signal that it just transposed a split-half tensor."""
    modules = sys.modules if modules is None else modules
    mod = modules.get(NIXL_COMPAT_MODULE)
    patch_cls = getattr(mod, "NixlConnectorPatch", None) if mod is not None else None
    return bool(getattr(patch_cls, "_pending_force_split", False))


__all__ = [
    "INTERFACES_MODULE",
    "KvcachedState",
    "layout_patched",
    "pending_force_split",
    "read_state",
    "register_patched",
    "topology_patched",
]
