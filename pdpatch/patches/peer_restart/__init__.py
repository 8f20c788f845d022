"""Patch ``peer_restart``: a prefill engine that restarts, is replaced or stalls never leaves the
decode engine stuck, and dead peers are forgotten.

Stock vLLM's decode worker keeps the NIXL agent of a prefill engine (P) for as long as its
engine id is in use.  When P is killed and started again under the same ``engine_id``
(deployments that set ``kv_transfer_config.engine_id``), every later request is READ through
the dead agent and fails (``NIXL_ERR_REMOTE_DISCONNECT``, HTTP 500) until D restarts: no release
0.19-0.34 forgets the agent (the TTL of 0.24+ is re-stamped by every read, failing ones too;
0.32+'s ``check_remote_metadata`` probe stays True; 0.31+'s address tracking needs another
engine id).  With a new engine id (vLLM's default uuid), D handshakes anew but keeps the dead
engine's agents and tables forever (0.19-0.23), for an idle hour (0.24-0.30), or until its
address answers again (0.31+).  A READ posted to a stopped P waits as long as P is stopped.

With this patch (:mod:`.receive`, :mod:`.prefill`, :mod:`.watch`, :mod:`.forget`): P names its
incarnation in the params of each request (a digest of its NIXL agent's bytes, which D loads
at the handshake); D compares before reading, forgets an engine whose agent is disconnected or
superseded once its READs are over (vLLM's own teardown, 0.24+; the same NIXL calls and tables
by hand, 0.19-0.23) and lets the next request handshake anew; a request whose params name a
retired incarnation is failed unread (never a READ of another incarnation's blocks); another
engine id at a held engine's address retires it (0.19-0.30, as 0.31+ do); a READ or a wait for
a handshake longer than ``PDPATCH_PEER_DEADLINE_S`` fails that request, its READs released.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "peer_restart"
# Its modules, each imported when vLLM imports a module it wraps (or a worker's book is first
# kept): none of them at install.
_prefill = lazy_from(f"{__name__}.prefill")
_receive = lazy_from(f"{__name__}.receive")
_book = lazy_from(f"{__name__}.book")


def _targets(version: Version) -> list[Target]:
    if vllm_sites.recv_failure_style(version) is None:
        return []
    step = vllm_sites.GET_TRANSFER_RESULTS if vllm_sites.lookup(
        vllm_sites.GET_TRANSFER_RESULTS, version) else vllm_sites.GET_FINISHED
    return targets_at(version, (vllm_sites.SET_HANDSHAKE_METADATA, _prefill("note_own_tokens")),
                      (vllm_sites.REQUEST_FINISHED, _prefill("add_tokens")),
                      (vllm_sites.REQUEST_FINISHED_ALL_GROUPS, _prefill("add_tokens")),
                      (vllm_sites.SCHEDULER_BUILD_META, _prefill("carry_incarnation")),
                      (vllm_sites.ADD_REMOTE_AGENT, _receive("note_agent")),
                      (vllm_sites.START_LOAD_KV, _receive("make_load_hook", version)),
                      (vllm_sites.READ_BLOCKS_FOR_REQ, _receive("make_read_guard", version)),
                      (step, _receive("make_step_hook", version)))


PATCH = Patch(
    name=NAME,
    summary="a prefill engine that restarts (same or new engine id), is replaced or stalls is "
            "handshaken anew, its dead agent forgotten; requests naming a retired incarnation "
            "fail unread; READs past PDPATCH_PEER_DEADLINE_S fail",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.BACKGROUND_HANDSHAKE, vllm_sites.NIXL_HANDSHAKE,
               vllm_sites.HANDLE_FAILED_TRANSFER, vllm_sites.CLEANUP_REMOTE_ENGINE,
               vllm_sites.ADDRESS_REPLACEMENT, vllm_sites.POP_DONE_TRANSFERS,
               vllm_sites.ADD_RECV_METADATA),
    object_state=_book("PeerBook"),
)
