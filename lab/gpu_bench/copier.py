"""The staged modes' local copy on GPU: one CuPy kernel launch per :class:`CopyPlan`, a thread
block per chunk, 16-byte vectors, its chunk and block size tuned on the device (CPU runs and a
missing CuPy use :class:`pdpatch.kv.staging.ByteCopier`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from pdpatch.kv.staging.plans import CopyPlan

from .pools import lazy_torch

CHUNK = 64 * 1024  # max bytes per copy-kernel thread block

_KERNEL = r"""
extern "C" __global__ void pd_copy(const unsigned long long* __restrict__ d, int n) {
    int c = blockIdx.x;
    if (c >= n) return;
    unsigned long long s = d[c], t = d[n + c], len = d[2 * n + c];
    if (((s | t | len) & 15ULL) == 0ULL) {
        const uint4* sp = (const uint4*)s; uint4* tp = (uint4*)t;
        unsigned long long nv = len >> 4, i = threadIdx.x, step = blockDim.x;
        for (; i + 3 * step < nv; i += 4 * step) {  // four 16-byte loads in flight
            uint4 a = sp[i], b = sp[i + step], c2 = sp[i + 2 * step], e = sp[i + 3 * step];
            tp[i] = a; tp[i + step] = b; tp[i + 2 * step] = c2; tp[i + 3 * step] = e;
        }
        for (; i < nv; i += step) tp[i] = sp[i];
    } else {
        const unsigned char* sp = (const unsigned char*)s; unsigned char* tp = (unsigned char*)t;
        for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x) tp[i] = sp[i];
    }
}
"""


class CupyCopier:
    """One kernel launch per CopyPlan: a thread block per chunk, 16-byte vectors; the chunk
    size and block size are picked by :meth:`tune` on the device."""

    name = "cupy-kernel"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.kernel = cupy.RawKernel(_KERNEL, "pd_copy")
        # not the legacy default stream, which would wait for UCX's copies in flight
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.chunk, self.threads = CHUNK, 256
        self.tuning: dict[str, float] = {}

    def tune(self, nbytes: int = 256 << 20, seg: int = 64 << 10) -> dict:
        """GB/s of a scattered segment copy per (chunk, threads), beside torch copy_ of the
        same bytes; keeps the fastest configuration."""
        torch = lazy_torch()
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros_like(src)
        n = nbytes // seg
        perm = np.random.default_rng(0).permutation(n).astype(np.uint64)
        plan = CopyPlan(np.uint64(src.data_ptr()) + perm * np.uint64(seg),
                        np.uint64(dst.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(seg),
                        np.full(n, seg, dtype=np.uint64))

        def timeit(fn) -> float:
            fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            return nbytes / best / 1e9

        self.tuning = {"torch copy_ (flat)": timeit(lambda: dst.copy_(src))}
        best = (0.0, self.chunk, self.threads)
        for chunk in (32 << 10, 64 << 10, 256 << 10):
            for threads in (256, 512):
                self.chunk, self.threads = chunk, threads
                prepared = self.prepare(plan)  # built while NIXL moves the bytes: not timed
                gbs = timeit(lambda p=prepared: self.launch(p))
                self.tuning[f"kernel chunk {chunk >> 10} KiB x {threads} threads"] = gbs
                best = max(best, (gbs, chunk, threads))
        _, self.chunk, self.threads = best
        ok = torch.equal(dst.view(n, seg)[torch.as_tensor(np.arange(n))],
                         src.view(n, seg)[torch.as_tensor(perm.astype(np.int64))])
        self.tuning["byte-exact"] = ok
        return self.tuning

    def prepare(self, plan: CopyPlan) -> tuple[Any, int]:
        """The chunk table, uploaded on the copier's stream: host work a READ does while NIXL
        still moves the bytes."""
        ch = plan.chunks(self.chunk)
        n = len(ch)
        if not n:
            return None, 0
        with self.stream:
            return self.cp.asarray(np.concatenate([ch.src, ch.dst, ch.length])
                                   .astype(np.uint64)), n

    def launch(self, prepared: tuple[Any, int], sync: bool = True) -> None:
        arr, n = prepared
        if n:
            with self.stream:
                self.kernel((n,), (self.threads,), (arr, np.int32(n)))
        if sync:
            self.sync()

    def run(self, plan: CopyPlan, sync: bool = True) -> None:
        self.launch(self.prepare(plan), sync)

    def sync(self) -> None:
        self.stream.synchronize()
