"""Patch ``params_check``: a malformed ``kv_transfer_params`` is a 400 for that request, not an
engine crash or a silent read of the wrong blocks.

Found by a bad-input sweep against a real vLLM 0.33 decode engine (replayed by
``tests/e2e/test_robustness_e2e.py``).  The NIXL connector trusts the proxy's
``kv_transfer_params`` completely:

* ``{"do_remote_prefill": true}`` without ``remote_block_ids`` (or with ``[]``):
  ``get_num_new_matched_tokens`` promises remote tokens, then ``update_state_after_alloc``
  hits ``assert num_external_tokens == 0`` in the scheduler -- EngineCore dies, every request
  on the engine fails (0.33 ``pull_scheduler.py``; 0.34.0 L189);
* ``remote_block_ids`` of the wrong shape or type (a string, floats, flat, nested, negative,
  out of range, 200 000 ids) reach the worker's read path, where they crash the worker
  (without ``read_guard``) or, for floats, are truncated to valid ids and read *another
  request's* blocks: a wrong answer with no error;
* a non-numeric ``remote_port`` or ``tp_size`` and friends fail late, deep in the handshake;
* from 0.34, ``remote_num_tokens`` pairs blocks of different P/D sizes
  (``_pair_blocks_by_last_token``, 0.34.0 ``base_worker.py`` L3683-3727): a string or a float
  raises ``TypeError`` in the decode worker (``read_guard`` contains it), a count past
  ``max_model_len`` is no count P computed;
* a readback's ``remote_num_tokens`` (``do_remote_decode`` with P's block ids and address,
  0.21+) that is no integer: the pull scheduler's ``min`` raises in EngineCore (0.34.0
  ``pull_scheduler.py`` L85-87).

This patch validates the parameters of a decode-side request (``do_remote_prefill`` true) in
the front end, where vLLM validates every other sampling parameter
(``InputProcessor._validate_params``, 0.34.0 ``input_processor.py`` L130, called at L377): types,
ranges, and sizes bounded by the model (``remote_block_ids``: at most one group per layer, at
most ``max_model_len`` blocks per group, since a block holds at least one token;
``remote_num_tokens``: at most ``max_model_len``).  The optional fields are checked only where
the running release reads them (:data:`pdpatch.vllm_sites.RECV_PARAMS_READ`: ``tp_size``
always, ``pp_size`` 0.26+, ``dcp_size`` 0.29+, ``remote_blocks_expiry_time`` 0.26+,
``remote_num_tokens`` 0.30+, ``remote_registration_generation`` 0.33+, each as 0.34.0's
``metadata.py`` L308-350 reads it): a field the release ignores cannot hurt it.  A failure raises
vLLM's own ``VLLMValidationError`` naming the field: HTTP 400 on the OpenAI server,
``ValueError`` from ``LLM``.  Engine ids cannot be checked here (they are only known after a
handshake); an unknown one fails the handshake and the request, cleanly.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "params_check"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.VALIDATE_REQUEST_PARAMS, _code("make_check", version)))


PATCH = Patch(
    name=NAME,
    summary="reject malformed kv_transfer_params with a 400 before they reach the engine",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.PROCESS_INPUTS, vllm_sites.REQUEST_INIT, vllm_sites.ADD_RECV_METADATA,
               vllm_sites.GET_NUM_NEW_MATCHED_TOKENS, vllm_sites.READ_BLOCKS_FOR_REQ),
)
