"""Patch ``hma_failed_recv``: a failed KV receive of a hybrid (HMA) model is reported failed to
the scheduler, not finished (vllm#52234, vLLM 0.22-0.29).

Where: every failure of a decode worker's receive goes through ``_handle_failed_transfer``
(0.22.1 worker.py L1915-1931, 0.24.0 base_worker.py L2052-2066, 0.29.0 L2424-2438), which marks
the request's blocks invalid -- the scheduler's only per-request failure signal before 0.30's
``failed_recving`` -- *unless the model is HMA* (a sliding-window or Mamba group:
``_is_hma_required``; "TODO handle failed transfer for HMA"), and queues it.  ``get_finished``
then lists it as done receiving (0.22.1 L1706-1714, 0.29.0 L2220-2228), the scheduler caches
its blocks as loaded and decodes from KV that never arrived: HTTP 200 with wrong tokens.  The
scheduler could not take invalid blocks of several groups anyway
(``_update_requests_with_invalid_blocks`` unpacks one group).

The channel (each end the release's own): the worker notes the HMA requests it failed
(``_handle_failed_transfer``) and, once its ``get_finished`` reports them, hands their ids to
the scheduler in the step's ``KVConnectorOutput.kv_connector_worker_meta`` -- the field vLLM
fills from the connector's ``build_connector_worker_meta()`` right after ``get_finished`` in the
same step (0.22.1 kv_connector_model_runner_mixin.py L109-116, 0.29.0 L97-104) and folds across
workers with ``aggregate`` (kv_connector/utils.py); NIXL itself sends none (the base returns
None).  The scheduler (``update_from_output``) takes the ids of requests still waiting for their
KV and lets the release's own invalid-block path fail them as it fails a one-group model's:
``kv_load_failure_policy="fail"`` finishes them with an error (``_handle_invalid_blocks``
returns them, the release finishes them ``FINISHED_ERROR``), ``"recompute"`` computes them
again (``num_computed_tokens`` 0, ``failed_recving_kv_req_ids``: the release's
``_update_waiting_for_remote_kv`` frees the blocks and the prompt is prefilled locally).  0.30+
report the failure themselves (``failed_recving``).
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "hma_failed_recv"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.HANDLE_FAILED_TRANSFER, _code("note_failure")),
                      (vllm_sites.GET_FINISHED, _code("collect_reported")),
                      (vllm_sites.CONNECTOR_WORKER_META, _code("send_reported")),
                      (vllm_sites.SCHEDULER_UPDATE_FROM_OUTPUT, _code("take_failures")),
                      (vllm_sites.SCHEDULER_INVALID_BLOCKS, _code("fail_waiting")))


PATCH = Patch(
    name=NAME,
    summary="a failed KV receive of a hybrid (HMA) model is reported failed to the scheduler "
            "(failed or recomputed by kv_load_failure_policy), not decoded as loaded "
            "(vllm#52234)",
    versions=vllm_sites.HMA_FAILURE_UNREPORTED,
    why_version="vLLM 0.30 reports a failed receive itself (failed_recving); 0.19-0.21 with "
                "the hybrid manager raise in get_finished instead (handshake_failure_guard "
                "leaves that error)",
    targets=_targets,
    relies_on=(vllm_sites.UPDATE_WAITING_FOR_REMOTE_KV, vllm_sites.KV_XFER_FINISHED,
               vllm_sites.WORKER_META_CALLER),
    object_state=_code("WorkerFailures"),
)
