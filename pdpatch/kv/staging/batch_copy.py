"""The CUDA driver's batch copy, ``cuMemcpyBatchAsync`` (driver >= 12.8): a whole gather as one
driver call over arrays of addresses, whatever the number of copies and of arenas they touch.

Why: torch can only copy what it holds as tensors.  A fused copy makes a view per copy (~3-5 us
of host work each, 1.0 ms for one block's 64 copies inside an engine on an H200 host); index
ops cost ~35 us per (source, destination) arena pair, so ~1.3 ms for one block at 32 layers.
The driver takes the addresses the plan already has.  vLLM's own KV offloading makes the same
call the same way (``vllm/v1/simple_kv_offload/cuda_mem_ops.py``, 0.19 and later), through
``cuGetProcAddress`` at the 12.8 ABI; here ctypes reaches ``libcuda`` directly, so no
``cuda-python`` is needed.

Used only after a probe: one 16-byte copy on the device, read back and compared
(:func:`batch_copy_for`).  An old driver, a missing symbol, or a probe that fails leaves the
gather to torch, logged once per device.  Nothing here runs without CUDA.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from pdpatch.log import logger

CUDA_VERSION_ABI = 12080
"""The ABI asked of ``cuGetProcAddress``: 12.8's, which has the ``failIdx`` argument (CUDA 13's
``_v2`` dropped it); a 13.x driver serves both."""
SRC_ACCESS_ORDER_STREAM = 1
"""Sources read in stream order: the staging slots NIXL has filled, behind nothing on our
stream, but never read before the call's place in it."""
MEM_LOCATION_TYPE_DEVICE = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


_BATCH_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,   # dsts srcs sizes n
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,                    # attrs idxs nattrs
    ctypes.c_void_p, ctypes.c_void_p)                                     # failIdx stream


class BatchCopy:
    """``cuMemcpyBatchAsync`` bound to one device: its primary context (made current on a
    thread that has none: the chunk driver's thread may never have called CUDA) and its
    attributes."""

    def __init__(self, libcuda: Any, fn: Any, device_index: int) -> None:
        self._cuda = libcuda
        self._fn = fn
        self._ctx = ctypes.c_void_p()
        dev = ctypes.c_int()
        _check(libcuda.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        _check(libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev),
               "cuDevicePrimaryCtxRetain")
        loc = _MemLocation(MEM_LOCATION_TYPE_DEVICE, device_index)
        self._attrs = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, loc, loc, 0)

    def __call__(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray,
                 stream: int) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` (uint64 arrays, read by
        the driver during the call) on ``stream``; RuntimeError names the copy it refused."""
        current = ctypes.c_void_p()
        _check(self._cuda.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != self._ctx.value:
            _check(self._cuda.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        idx, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)
        err = self._fn(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, dst.size,
                       ctypes.addressof(self._attrs), ctypes.byref(idx), 1,
                       ctypes.byref(fail), stream)
        if err != 0:
            i = fail.value
            what = (f" at copy {i} ({int(sizes[i])} B {int(src[i]):#x} -> {int(dst[i]):#x})"
                    if i < dst.size else "")
            raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {err}{what}")


def _check(err: int, call: str) -> None:
    if err != 0:
        raise RuntimeError(f"{call} failed with CUresult {err}")


def _resolve(device_index: int) -> BatchCopy:
    libcuda = ctypes.CDLL("libcuda.so.1")
    fn_ptr = ctypes.c_void_p()
    status = ctypes.c_int()
    get_proc = libcuda.cuGetProcAddress_v2       # driver >= 12.0
    get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                         ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    err = get_proc(b"cuMemcpyBatchAsync", ctypes.byref(fn_ptr), CUDA_VERSION_ABI, 0,
                   ctypes.byref(status))
    if err != 0 or not fn_ptr.value:
        raise RuntimeError(f"the driver has no cuMemcpyBatchAsync (CUDA 12.8+): CUresult "
                           f"{err}, symbol status {status.value}")
    return BatchCopy(libcuda, _BATCH_FN(fn_ptr.value), device_index)


def _probe(batch: BatchCopy, device: Any) -> None:
    """One copy of 16 bytes between two halves of a device tensor, read back."""
    import torch

    words = torch.arange(4, dtype=torch.int64, device=device)
    base = int(words.data_ptr())
    stream = torch.cuda.Stream(device)
    batch(np.array([base + 16], np.uint64), np.array([base], np.uint64),
          np.array([16], np.uint64), stream.cuda_stream)
    stream.synchronize()
    got = words.tolist()
    if got != [0, 1, 0, 1]:
        raise RuntimeError(f"a probe copy of 16 bytes read back {got}, not [0, 1, 0, 1]")


_found: dict[int, BatchCopy | None] = {}
_lock = threading.Lock()


def batch_copy_for(device: Any) -> BatchCopy | None:
    """The driver's batch copy on a CUDA ``device`` once a probe copy came back right; None
    (logged once per device) where it is missing or wrong: the gather is torch's then."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index in _found:
            return _found[index]
        try:
            batch = _resolve(index)
            _probe(batch, device)
        except Exception as exc:
            logger.info("pdpatch kv_segments: no driver batch copy on %s (%s: %s); staged "
                        "READs gather with torch copies", device, type(exc).__name__, exc)
            batch = None
        _found[index] = batch
        return batch
