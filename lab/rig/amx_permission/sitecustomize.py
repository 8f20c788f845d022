"""Test rig only (engines started by ``rig.engine_env``): each engine process asks Linux for
permission to use AMX tiles before vLLM's CPU kernels run.

On a CPU with AMX (Sapphire Rapids and later) vLLM's CPU attention picks its ``amx`` kernels for
bf16 (``_get_attn_isa``: ``torch.cpu._is_amx_tile_supported()``, which reads CPUID only).  Linux
hands out AMX's tile state per process, on request (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``), and a tile instruction without it is SIGILL: the decode worker died with
"Fatal Python error: Illegal instruction" in ``cpu_attention_with_kv_cache`` at its first P/D
request, stock and pdpatch alike.  ``torch.cpu._init_amx()`` makes the same request; this makes
it without importing torch.  Where there is no AMX (or not Linux on x86-64) nothing is asked and
nothing changes.  Chains on to the next ``sitecustomize`` (``lab/rig/site_chain.py``).
"""

import os
import platform
import runpy
import sys

ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158            # x86-64


def _allow_amx() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    try:
        with open("/proc/cpuinfo") as f:
            if " amx_tile" not in f.read(1 << 16):
                return
        import ctypes

        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM,
                                                  XFEATURE_XTILEDATA)
    except OSError:
        return


_allow_amx()
# the next sitecustomize on the path, imported by lab/rig/site_chain.py (found by file path:
# no import reaches lab/ in an engine)
_here = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(os.path.dirname(_here), "site_chain.py"))[
    "chain_next_sitecustomize"](_here)
del _allow_amx, _here
