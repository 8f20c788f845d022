"""The rig's engines ask Linux for AMX's tile state (``rig/amx_permission``) before vLLM's CPU
attention runs its AMX kernels: without the request a tile instruction is SIGILL, and on an
AMX machine every P/D decode worker died at its first request (stock and pdpatch alike).
Measured in a fresh process: the permission Linux reports (``ARCH_GET_XCOMP_PERM``) with and
without the rig's ``sitecustomize``, which must still chain to the next one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lab.rig import engine_env

XTILEDATA = 1 << 18
PROBE = """
import ctypes, sys
v = ctypes.c_ulong(0)
rc = ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(v))     # ARCH_GET_XCOMP_PERM
print(rc, v.value, "chained" if "chained_marker" in sys.modules else "not chained")
"""


def _perm(tmp_path: Path, *dirs: str) -> tuple[int, int, str]:
    nxt = tmp_path / "next"
    nxt.mkdir(exist_ok=True)
    (nxt / "sitecustomize.py").write_text("import sys, types\n"
                                          "sys.modules['chained_marker'] = types.ModuleType('m')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*dirs, str(nxt)])}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rc, perm, chained = out.stdout.split(maxsplit=2)
    return int(rc), int(perm), chained.strip()


def test_rig_engines_may_use_amx_tiles_where_the_cpu_has_them(tmp_path: Path) -> None:
    with open("/proc/cpuinfo") as f:
        amx = " amx_tile" in f.read()
    rc, stock, chained = _perm(tmp_path)
    _, rig, rig_chained = _perm(tmp_path, str(engine_env.AMX_PERMISSION))
    assert chained == rig_chained == "chained"
    if rc != 0:          # a kernel without the request (before 5.16): nothing to grant
        return
    assert not stock & XTILEDATA        # Linux grants tiles only on request
    assert bool(rig & XTILEDATA) == amx, (hex(stock), hex(rig))
