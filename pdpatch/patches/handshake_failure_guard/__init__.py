"""Patch ``handshake_failure_guard``: on vLLM 0.19-0.29 a failed handshake no longer kills the
decode worker or the engine core through ``get_finished``.

Found by fault injection (bad peers).  Two faults of the release's own failure path:

* **Unknown engine (0.19-0.21).**  When the handshake with a prefill engine fails before
  ``add_remote_agent`` registered it -- the prefill engine is dead (ZMQ times out after 5 s),
  the compatibility hash differs, the peer's metadata is rejected -- the release marks the
  waiting requests failed, and its ``get_finished`` then runs the heterogeneous-block-size
  post-processing for them too, looking the unknown engine up: ``KeyError`` on the
  model-runner thread, the worker dies (0.19.0 ``nixl_connector.py`` L2302, 0.20.2
  ``nixl/worker.py`` L1685, same in 0.21.0).  0.22 skips failed requests there ("Skip KV sync
  and post-processing for failed requests").  The wrapper does what 0.22 does: requests
  listed as failed whose remote engine is unknown are taken out of ``_failed_recv_reqs``
  before the original runs and added to its ``done_recving`` afterwards, with their metadata
  dropped.  Their blocks were already marked invalid by the release's own handshake-failure
  callback, so the scheduler recomputes or fails them.  The same is done for failed requests
  whose engine *is* known (a handshake refused after registration, as by ``layout``'s
  blocks-first guard): the post-processing would reorder blocks that never arrived, and on a
  blocks-first cache with a block-size ratio that reorder raises ``ValueError`` -- the worker
  dies the same way.  On a hybrid (HMA) layout the callback marks nothing (those releases
  cannot express the failure) and a report would have the scheduler decode from KV that never
  arrived (vllm#52234): there the release's own error stands, as ``read_guard`` leaves it.
* **Notify-only receive of an HMA model (0.19-0.29).**  A full local prefix hit (or a request
  aborted before it was scheduled) still queues a receive, with no local blocks: the worker
  only owes P the notification that frees P's blocks, and the scheduler never parks the
  request on it.  When that receive's handshake fails, an HMA model's failure path lists the
  request as failed (the others raise IndexError inside the callback first, before listing
  it), ``get_finished`` reports it as done receiving, and the scheduler's
  ``_update_from_kv_xfer_finished`` asserts the request is parked or finished: the engine
  core dies (see :data:`pdpatch.vllm_sites.NOTIFY_ONLY_UNFLAGGED`).  The wrapper does what 0.30
  does, which never stores such a receive: it is taken out of the failed requests and its
  metadata dropped, unreported.  Its KV is already local (the request runs on), and P frees
  its blocks after its own timeout -- what every release does when this notification fails.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "handshake_failure_guard"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.GET_FINISHED, _code("make_guard", version)))


PATCH = Patch(
    name=NAME,
    summary="a failed handshake fails its requests without crashing get_finished (0.19-0.21) "
            "and leaves notify-only receives unreported (0.19-0.29)",
    versions=vllm_sites.supported_until("0.30"),
    why_version="fixed upstream: get_finished skips failed requests from vLLM 0.22.0, "
                "notify-only receives are never stored from vLLM 0.30.0",
    targets=_targets,
    relies_on=(vllm_sites.BACKGROUND_HANDSHAKE, vllm_sites.HANDLE_FAILED_TRANSFER,
               vllm_sites.START_LOAD_KV),
)
