"""A staging agent's memory: ``capacity`` bytes on the KV cache's device, made at the first READ
to stage (a worker that only writes to a converted peer never pays for it), or at start-up where
every READ will be staged (coalescing on: the agent's ``buffer_at_start``), registered with
NIXL once per device id the local lists use (and, for READs through a peer's twin, prepared as
a list of equal slots per slot length), shared out by a first-fit allocator, and copied into
the KV memory by a :class:`~pdpatch.kv.staging.copier.ByteCopier`.  Needs torch once made."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdpatch.kv.staging.copier import ByteAllocator, ByteCopier, arenas_of
from pdpatch.kv.staging.nixl_states import INIT_AGENT
from pdpatch.kv.staging.plans import CopyPlan, staging_table
from pdpatch.kv.staging.reads import NotStaged
from pdpatch.log import logger


class StagingBuffer:
    """``agent``: the NIXL agent that registers the buffer; ``memory``: the tensors the local
    descriptor lists point into, asked for when the buffer is made (it goes on their device).
    ``capacity`` 0: staging off (also once the buffer could not be made, or was closed);
    ``setting``: what the operator sets to change it, named in the messages."""

    def __init__(self, agent: Any, *, mem_type: str, capacity: int,
                 memory: Callable[[], Sequence[Any]], setting: str) -> None:
        self._agent = agent
        self._mem_type = mem_type
        self.capacity = capacity
        self._memory = memory
        self._setting = setting
        self._lock = threading.Lock()
        self._alloc = ByteAllocator(capacity)
        self._tensor: Any = None
        self.base = 0                                  # the buffer's address, once made
        self._copier: ByteCopier | None = None
        self._registered: dict[int, Any] = {}         # dev -> NIXL registration
        self._slot_lists: dict[tuple[int, int], Any] = {}   # (slot len, dev) -> dlist
        self._warm = False

    @property
    def allocated(self) -> int:
        """Bytes of staging memory held (0 until the first READ to stage)."""
        return 0 if self._tensor is None else int(self._tensor.numel())

    @property
    def free_bytes(self) -> int:
        """Bytes not held by a READ in flight."""
        with self._lock:
            return self._alloc.free_bytes

    def reserve(self, nbytes: int, align: int) -> int | None:
        """The offset of ``nbytes`` free bytes starting at a multiple of ``align``, now held;
        None while other READs hold the room."""
        with self._lock:
            return self._alloc.alloc(nbytes, align)

    def free(self, start: int, nbytes: int) -> None:
        with self._lock:
            self._alloc.free(start, nbytes)

    def ensure(self) -> None:
        """Make the buffer if it is not made yet; :class:`NotStaged` if it cannot be (then
        staging is off for good)."""
        if self._tensor is not None:
            return
        try:
            self._make()
        except Exception as exc:
            self.capacity = 0
            logger.warning("pdpatch kv_segments: no staging buffer (%s: %s); converted READs "
                           "go per segment (%s=0 silences this)", type(exc).__name__, exc,
                           self._setting)
            raise NotStaged("no staging buffer could be made") from None

    def _make(self) -> None:
        import torch

        t0 = time.perf_counter()
        memory = list(self._memory())
        device = memory[0].device          # (the copier below checks they share it)
        tensor = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self._copier = ByteCopier(arenas_of([*memory, tensor]))
        self._copier.check_span(tensor)
        self._tensor, self.base = tensor, int(tensor.data_ptr())
        logger.info("pdpatch kv_segments: %d MiB staging buffer on %s for converted READs "
                    "(%s), made in %.0f ms", self.capacity >> 20, device, self._setting,
                    (time.perf_counter() - t0) * 1e3)

    def warm(self) -> None:
        """Load the gather's copy kernels on the KV memory's GPU now (once): CUDA loads a
        kernel's module at its first launch, and that was 14.5 ms of a worker's first staged
        READ on an H200.  Nothing is allocated but a few bytes; on CPU there is nothing to
        load."""
        if self._warm:
            return
        self._warm = True
        memory = list(self._memory())
        device = getattr(memory[0], "device", None) if memory else None
        if device is None or device.type != "cuda":
            return
        try:
            ByteCopier.warm(device)
        except Exception as exc:      # only a first READ's speed is at stake, not start-up
            logger.warning("pdpatch kv_segments: the gather's copy kernels could not be loaded "
                           "at start-up (%s: %s); the first staged READ loads them",
                           type(exc).__name__, exc)

    def slot_list(self, slot: int, dev: int) -> Any:
        """The buffer as a prepared list of ``slot``-byte entries, registered with the device id
        the local lists use (NIXL matches a descriptor to its registration by it)."""
        key = (slot, dev)
        with self._lock:
            handle = self._slot_lists.get(key)
        if handle is not None:
            return handle
        self.register(dev)
        table = staging_table(self.base, slot, self.capacity // slot, dev)
        handle = self._agent.prep_xfer_dlist(INIT_AGENT,
                                             self._agent.get_xfer_descs(table, self._mem_type))
        with self._lock:
            self._slot_lists[key] = handle
        return handle

    def register(self, dev: int) -> None:
        """Register the buffer with NIXL under device id ``dev`` (once per id)."""
        with self._lock:
            if dev in self._registered:
                return
        descs = self._agent.get_reg_descs([(self.base, self.capacity, dev, "")], self._mem_type)
        reg = self._agent.register_memory(descs)
        with self._lock:
            self._registered[dev] = reg if reg is not None else descs

    def covers(self, addr: np.ndarray, length: int) -> bool:
        """The ``length``-byte rows at ``addr`` (one READ's) lie in memory the gather can
        write.  Per READ, not once per list: a whole list's 10^5-10^6 rows cost its peer's
        first READ ~20 ms per 500k, a READ's few thousand nothing measurable."""
        try:
            self._copier.locate(addr, np.full(addr.size, length, dtype=np.int64))
        except ValueError:
            return False
        return True

    def prepare(self, plan: CopyPlan) -> list:
        """A gather out of staging (a staged READ's, or one chunk's), prepared: host work that
        can overlap the wire."""
        return self._copier.prepare(plan)

    def row_scatter(self, dst: np.ndarray, length: int, lanes: Sequence[int],
                    lane_bytes: int, row_off: np.ndarray | None) -> Any:
        """A chunked READ's whole gather, prepared once (:meth:`ByteCopier.row_scatter`):
        rows of ``length`` bytes into ``dst`` from the buffer's ``lanes`` (offsets), back to
        back or at ``row_off`` in their lane (a gap READ); None where each chunk is to be
        prepared on its own."""
        return self._copier.row_scatter(dst, length,
                                        self.base + np.asarray(lanes, dtype=np.int64),
                                        lane_bytes, row_off)

    def enter_thread(self) -> None:
        """Make the buffer's GPU the calling thread's current device (once, in a thread of
        pdpatch's own that launches gathers: the chunk driver).

        Why: a new thread's current CUDA device is device 0.  The copier's stream context
        switches to its stream's device and, on leaving, back to device 0 -- which creates
        device 0's primary context in a worker that never used that GPU (TP rank 1 on GPU 1):
        0.2-1.2 s inside the first chunked READ's gather (GPU runs ba, bb), and the context's
        memory taken on the other rank's GPU."""
        tensor = self._tensor
        if tensor is not None and tensor.device.type == "cuda":
            import torch

            torch.cuda.set_device(tensor.device)

    def launch(self, ops: list) -> Any:
        """Start a prepared gather; returns its event (``query()``, ``synchronize()``)."""
        return self._copier.launch(ops, sync=False)

    def turn_off(self) -> None:
        """No READ is staged from now on."""
        with self._lock:
            self.capacity = 0

    def close(self) -> None:
        """Release the slot lists and the registration, and let the buffer go."""
        with self._lock:
            handles, self._slot_lists = list(self._slot_lists.values()), {}
            regs, self._registered = list(self._registered.values()), {}
            self.capacity = 0
        for handle in handles:
            self._agent.release_dlist_handle(handle)
        for reg in regs:
            self._agent.deregister_memory(reg)
        self._tensor = self._copier = None
