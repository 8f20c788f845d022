"""Patch ``lease_guard``: D declines a READ of blocks whose lease on P has run out, instead of
decoding from blocks P may have handed to another request.

vLLM's prefill engine (P) keeps a finished request's KV blocks for ``kv_lease_duration``
(``kv_connector_extra_config``, 30 s by default since 0.22), then frees them ("Releasing expired
KV blocks for request ... retrieved by 0 remote worker(s)"), and its next prefills may write
into them.  The decode engine's (D's) heartbeats extend a lease, but only once D's scheduler
holds the request and D has met P.  Nothing tells D that a lease has run out: P exports no
expiry for a P->D request (only for a turn-2 readback, ``remote_blocks_expiry_time``, which D
checks in ``_is_turn2_read_expired``).  So a request that reaches D more than 30 s after P
answered -- a stalled proxy or client, a backed-up API server -- is READ from whatever P's
blocks hold by then, and D serves wrong tokens without an error (this project's e2e CI saw it
on 0.33: a test client stalled 27 s).  So it is in 0.34: the lease (0.34.0
``base_scheduler.py`` L82-88) is set in ``request_finished`` (``pull_scheduler.py`` L256-269),
an expiry is exported only for a turn-2 readback (L270-272), and D checks one only there
(``pull_worker.py`` L127-136, called at L159 with ``bidirectional_kv_xfer`` on).

With this patch (0.26+, the releases that measure each peer's clock at the handshake):

* **P** (the connector facade's ``request_finished[_all_groups]``, for a request it holds for
  D) adds ``kv_transfer_params["pdpatch_kv_lease_expiry"]``: the expiry its scheduler half set
  (``_reqs_need_send``), in P's scheduler clock -- the clock vLLM's handshake reports.
* **D** carries it with the request's receive (``NixlConnectorMetadata.add_new_req_to_recv``:
  the ``ReqMeta`` travels to the workers) and notes when each worker first sent a heartbeat for
  each P request (``_send_heartbeats``, engines it has met).
* Before the READ (``_read_blocks_for_req``), D's worker asks what the release asks of a
  turn-2 readback: is the deadline, in its own clock (``_engine_clock_offset``), within the
  release's safety margin (``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``)?  If so, and no heartbeat went
  to P at least that margin before the deadline, the READ is declined the way the release
  declines an expired readback (its expired-request counter, its failure path): vLLM's
  ``kv_load_failure_policy`` fails the request (its default) or recomputes it, and the worker
  serves on.  One warning per declined request.
* A deadline not near, a heartbeat in time, a P without pdpatch (no such params), a peer whose
  clock is not measured yet or a request with nothing to read: the release's own READ,
  untouched.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "lease_guard"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.REQUEST_FINISHED, _code("add_lease")),
                      (vllm_sites.REQUEST_FINISHED_ALL_GROUPS, _code("add_lease")),
                      (vllm_sites.ADD_NEW_REQ_TO_RECV, _code("carry_lease")),
                      (vllm_sites.SEND_HEARTBEATS, _code("note_heartbeats")),
                      (vllm_sites.READ_BLOCKS_FOR_REQ, _code("make_read_guard", version)))


PATCH = Patch(
    name=NAME,
    summary="D declines a READ of blocks whose lease on P ran out (no heartbeat in time) "
            "instead of decoding from blocks P may have reused",
    versions=vllm_sites.supported_from(vllm_sites.LEASE_CHECK_FROM),
    why_version="vLLM 0.19-0.25 measure no peer clock at the handshake (0.22-0.25 lease "
                "blocks 30 s, 0.19-0.21 hold them 480 s)",
    targets=_targets,
    relies_on=(vllm_sites.TURN2_EXPIRY, vllm_sites.SCHEDULER_REQUEST_FINISHED,
               vllm_sites.HANDLE_HEARTBEAT, vllm_sites.BACKGROUND_HANDSHAKE,
               vllm_sites.HANDLE_FAILED_TRANSFER),
    object_state=_code("Lease"),
)
