"""The gap budget of a peer: how many unrequested bytes a staged READ may read to save one
NIXL descriptor, measured on the peer's own memory at its first staged READ."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from pdpatch.kv.staging.lists import prep_rows
from pdpatch.kv.staging.nixl_states import DONE, INIT_AGENT, PROC
from pdpatch.kv.staging.plans import TransportCost
from pdpatch.kv.staging.rows import StagedPeer
from pdpatch.log import logger

# Calibration READs: descriptors of the many-descriptor READ, the bytes of the big one (more
# bytes, a truer bandwidth: 64 MiB take ~40 us over cuda_ipc, 0.13 s over TCP loopback).
CALIBRATION_DESCS = 256
CALIBRATION_MAX_BYTES = 64 << 20
CALIBRATION_REPS = 3
SLOW_READ_S = 0.01


class GapCalibration:
    """The calibration half of the staging agent's READ planning
    (:class:`~pdpatch.kv.staging.reads.ReadPlanner`), kept apart because it is a measurement,
    not the READ path.  It runs inside the planner: its NIXL agent, memory type, staging
    buffer, lock and stats."""

    _agent: Any
    _mem_type: str
    _staging: Any
    _gap: int | None
    _gap_setting: str
    _lock: Any
    stats: Any

    def _gap_for(self, peer: StagedPeer, slot: int, dev: int) -> int:
        """The peer's gap budget: the agent's setting, else measured at the first READ from
        the peer that a gap could shorten (0 until it could be)."""
        if not peer.ranges:
            return 0
        if peer.gap is None and self._gap is not None:
            peer.gap = self._gap
        if peer.gap is None:
            peer.gap = self._calibrate(peer, slot, dev)
        return peer.gap or 0

    def _calibrate(self, peer: StagedPeer, slot: int, dev: int) -> int | None:
        """The most bytes worth reading to save one descriptor, measured on this peer: three
        READs of its memory into staging -- :data:`CALIBRATION_DESCS` rows one apart, the
        same bytes as one descriptor, and one descriptor of up to
        :data:`CALIBRATION_MAX_BYTES` -- best of :data:`CALIBRATION_REPS` each
        (:meth:`~pdpatch.kv.staging.plans.TransportCost.from_reads`).

        Why measure: the budget is ``cost x bandwidth``, a few MiB over cuda_ipc on one node,
        tens of KiB over host memory, a few KiB over TCP: no default fits every transport.
        None (try again at the next READ) while other READs hold the staging it needs.
        The READs stay inside the peer's largest read range (one registration)."""
        base, end = max(peer.ranges, key=lambda r: r[1] - r[0])
        run_len = (end - base) // slot
        room = min(CALIBRATION_MAX_BYTES, self._staging.capacity, run_len * slot) // (2 * slot)
        descs = min(CALIBRATION_DESCS, run_len // 2, 2 * room)
        if descs < 2:
            logger.info("pdpatch kv_segments: no gap reads from %s: no range of its memory, "
                        "or no staging, large enough to measure the transport with", peer.name)
            return 0
        start = self._staging.reserve(2 * room * slot, slot)
        if start is None:
            return None
        first = np.array([base], dtype=np.int64)
        try:
            spaced = self._timed(peer, start, base + np.arange(0, 2 * descs, 2) * slot, slot,
                                 dev)
            one = self._timed(peer, start, first, descs * slot, dev)
            big = self._timed(peer, start, first, 2 * room * slot, dev)
            cost = TransportCost.from_reads(spaced, one, big)
        except Exception as exc:
            logger.warning("pdpatch kv_segments: no gap reads from %s: measuring its "
                           "transport failed (%s: %s); set %s to choose a gap", peer.name,
                           type(exc).__name__, exc, self._gap_setting)
            return 0
        finally:
            self._staging.free(start, 2 * room * slot)
        gap = cost.gap_budget()
        with self._lock:
            self.stats.gap_budgets[peer.name] = gap
        logger.info("pdpatch kv_segments: READs from %s cost %.1f us per descriptor at %.1f "
                    "GB/s: staged READs read up to %d KiB between requested blocks rather than "
                    "post another descriptor (%s overrides; 0 turns it off)", peer.name,
                    cost.desc_cost_s * 1e6, cost.bandwidth_bps / 1e9, gap >> 10, self._gap_setting)
        return gap

    def _timed(self, peer: StagedPeer, start: int, remote: np.ndarray, length: int, dev: int
               ) -> tuple[int, int, float]:
        """``(descs, bytes, best seconds)`` of READing ``length`` bytes at each of ``remote``
        into staging at ``start``, posted and polled as vLLM does."""
        n = remote.size
        lens = np.full(n, length, dtype=np.int64)
        local = self._staging.base + start + np.arange(n, dtype=np.int64) * length
        lh = prep_rows(self._agent, INIT_AGENT, local, lens, dev, self._mem_type)
        ids = np.arange(n, dtype=np.int64)
        best = math.inf
        rh = None
        try:
            rh = prep_rows(self._agent, peer.agent_name, remote, lens, peer.table.dev,
                           self._mem_type)
            for rep in range(CALIBRATION_REPS):
                t0 = time.perf_counter()
                handle = self._agent.make_prepped_xfer("READ", lh, ids, rh, ids)
                try:
                    state = self._agent.transfer(handle)
                    while state == PROC:
                        state = self._agent.check_xfer_state(handle)
                    best = min(best, time.perf_counter() - t0)
                finally:
                    self._agent.release_xfer_handle(handle)
                with self._lock:
                    self.stats.calibration_bytes += n * length
                if state != DONE:
                    raise RuntimeError(f"calibration READ ended {state}")
                if rep and best > SLOW_READ_S:   # slow transport: small noise, dear time
                    break                            # (the first READ warms the memory)
        finally:
            self._agent.release_dlist_handle(lh)
            if rh is not None:
                self._agent.release_dlist_handle(rh)
        return n, n * length, best
