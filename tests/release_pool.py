"""Run one function under many old vLLM releases' real source trees: a forked child per release,
from one pool process that imports the packages every release shares once.

Why not :func:`versions_harness.run_in_release` per release: a fresh interpreter spends 15-25 s
on this 2-core machine importing an old release's hashing code, nearly all of it torch,
transformers and the other third-party packages every release shares (vLLM's own modules take
about 3 s).  The pool process forks a child per release; the child puts the release's tree
first on ``sys.path`` (with the same distribution record and old-release extras as
``versions_harness.child_env``), checks that ``import vllm`` is that tree and that the
installed distribution reads as that release, and calls the function -- the release's real
code, nothing stubbed.  The first child reports the third-party modules it imported, and the
pool imports them before forking the others.

From a test::

    runs = run_releases(["0.10.2", ...], "release_hashing", "drive", {ver: payload, ...})
    runs["0.10.2"].check()      # the function's return value (JSON), or AssertionError
    runs["0.10.2"].seconds      # the child's time, its imports included

The module is looked up in ``tests/`` (or anywhere on the pool's path); it must import vLLM
only when called.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from versions_harness import REPO, TESTS, child_env, vllm_cache_root

MAX_PARALLEL = 2


@dataclass(frozen=True)
class PoolRun:
    """One release's outcome: the function's result, or the error (and the pool's output)."""

    version: str
    result: Any
    error: str
    seconds: float | None
    import_seconds: float | None

    def check(self) -> Any:
        if self.result is None:
            raise AssertionError(f"vLLM {self.version} in the release pool: {self.error}")
        return self.result


def release_path(version: str) -> list[str]:
    """The ``sys.path`` entries ``versions_harness.child_env`` gives a release's child."""
    return [p for p in child_env(version)["PYTHONPATH"].split(os.pathsep)
            if p not in (str(REPO), str(TESTS))]


def run_releases(versions: list[str], module: str, function: str,
                 payloads: dict[str, Any], *, timeout: float = 600) -> dict[str, PoolRun]:
    """``module.function(payloads[version])`` under each release, in one pool process."""
    with tempfile.TemporaryDirectory(prefix="pdpatch-pool-") as tmp:
        jobs = []
        for v in versions:
            payload = Path(tmp, f"{v}.in.json")
            payload.write_text(json.dumps(payloads[v]))
            jobs.append({"version": v, "path": release_path(v), "payload": str(payload),
                         "result": str(Path(tmp, f"{v}.out.json"))})
        request = Path(tmp, "pool.json")
        request.write_text(json.dumps({"module": module, "function": function, "jobs": jobs}))
        env = {k: v for k, v in child_env(versions[0]).items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)])
        proc = subprocess.Popen([sys.executable, __file__, str(request)], env=env, cwd=str(REPO),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # the pool and every child it forked
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        runs = {}
        for job in jobs:
            out = Path(job["result"])
            done = json.loads(out.read_text()) if out.exists() else {"error": "no result"}
            error = done.get("error", "") + f"\n--- pool (rc={proc.returncode}) ---\n" \
                + stdout[-2000:] + stderr[-3000:]
            runs[job["version"]] = PoolRun(job["version"], done.get("result"), error,
                                           done.get("seconds"), done.get("import_seconds"))
        return runs


# ----------------------------------------------------------------------------- pool process


def _child(job: dict[str, Any], module: str, function: str, learn: int | None) -> None:
    """In the forked child: become the release, run, write the result; never returns."""
    status = 1
    forked = time.monotonic()
    try:
        before = set(sys.modules)
        if any(m == "vllm" or m.startswith("vllm.") for m in before):
            raise RuntimeError("the pool imported vLLM before forking")
        sys.path[:0] = job["path"]
        os.environ["VLLM_CACHE_ROOT"] = str(vllm_cache_root(job["version"]))
        importlib.invalidate_caches()
        import importlib.metadata as md

        if not md.version("vllm").startswith(job["version"]):
            raise RuntimeError(f"distribution version {md.version('vllm')} is not "
                               f"{job['version']}")
        import vllm

        tree = job["path"][0]
        if not str(vllm.__file__).startswith(tree):
            raise RuntimeError(f"vllm resolved to {vllm.__file__}, not the tree {tree}")
        payload = json.loads(Path(job["payload"]).read_text())
        started = time.monotonic()
        result = getattr(importlib.import_module(module), function)(payload)
        done = {"result": result, "seconds": round(time.monotonic() - forked, 2),
                "import_seconds": round(started - forked, 2)}
        Path(job["result"]).write_text(json.dumps(done))
        if learn is not None:
            own = tuple(job["path"])
            shared = [m for m in sys.modules if m not in before and m != module
                      and not m.startswith(("vllm", "pdpatch", "__main__"))
                      and not str(getattr(sys.modules[m], "__file__", "") or "").startswith(own)]
            os.write(learn, json.dumps(shared).encode())
        status = 0
    except BaseException:
        Path(job["result"]).write_text(json.dumps({"error": traceback.format_exc()}))
    finally:
        if learn is not None:
            os.close(learn)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _fork(job: dict[str, Any], module: str, function: str, learn: bool = False
          ) -> tuple[int, int | None]:
    r, w = os.pipe() if learn else (None, None)
    pid = os.fork()
    if pid == 0:
        if r is not None:
            os.close(r)
        _child(job, module, function, w)
    if w is not None:
        os.close(w)
    return pid, r


def _learned(r: int) -> list[str]:
    data = b""
    while chunk := os.read(r, 1 << 20):
        data += chunk
    os.close(r)
    return json.loads(data or b"[]")


def pool(request: dict[str, Any]) -> None:
    """Run every job of ``request``: the first alone (it reports what to preload), then the
    rest, :data:`MAX_PARALLEL` at a time."""
    module, function, jobs = request["module"], request["function"], request["jobs"]
    pid, r = _fork(jobs[0], module, function, learn=True)
    shared = _learned(r)
    os.waitpid(pid, 0)
    for name in shared:  # best effort: a child imports whatever is missing itself
        try:
            importlib.import_module(name)
        except Exception:  # a module that only imports in its context: the child does it
            continue
    running: set[int] = set()
    for job in jobs[1:]:
        if len(running) >= MAX_PARALLEL:
            running.discard(os.wait()[0])
        running.add(_fork(job, module, function)[0])
    while running:
        running.discard(os.wait()[0])


if __name__ == "__main__":
    pool(json.loads(Path(sys.argv[1]).read_text()))
