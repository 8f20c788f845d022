"""Patch ``readback_guard``: a KV readback the engine will never start is computed locally
instead of leaving its request waiting forever.

Found from issue 25, case 3 ("a request that never ends": ``do_remote_decode: true`` sent to a
decode engine, no answer, nothing logged).  From 0.21 the pull scheduler supports a *readback*
("bidirectional KV transfer", ``kv_connector_extra_config.bidirectional_kv_xfer``): a request
with ``do_remote_decode`` that also names ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host`` and ``remote_port`` loads the prefix another engine
cached for it.  ``get_num_new_matched_tokens`` promises that load (``(count, True)``, once
``count`` reaches ``kv_recompute_threshold``) on *every* engine, but ``update_state_after_alloc``
queues the receive only with ``bidirectional_kv_xfer`` on, no host buffer taking the request
first and no receive queued for it before (``_remote_blocks_processed``; a preempted request
asks again).  Otherwise nothing ever reports the load done: the request sits in
``WAITING_FOR_REMOTE_KVS`` for good (0.33 and 0.34: any ``kv_role``, default settings, a prompt
of 64+ tokens; 0.34.0 ``pull_scheduler.py`` L66-103 promises, L126-134 queues).  0.19-0.20 have
no readback (such a request is computed locally), the push scheduler neither.

The wrapper asks the release's own question after ``get_num_new_matched_tokens`` promised a
readback (``do_remote_decode`` set, ``do_remote_prefill`` not): will ``update_state_after_alloc``
queue it (:func:`pdpatch.vllm_sites.readback_receive_queued`, the same conditions in the same
order)?  If not, it answers the release's own "no external tokens" (what the release answers
itself below ``kv_recompute_threshold``): the prompt is computed locally, the request is served
and then handled as the release handles any ``do_remote_decode`` request, and one warning names
the setting.  A readback the release will start is left to it.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from

NAME = "readback_guard"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return [Target(s.module, s.qualname, _code("guard_readback"))
            for s in vllm_sites.lookup_all(vllm_sites.READBACK_MATCH, version)]


PATCH = Patch(
    name=NAME,
    summary="a KV readback the engine would never start is computed locally, not waited on",
    versions=vllm_sites.supported_from("0.21"),
    why_version="vLLM 0.19-0.20 have no KV readback (such requests are computed locally)",
    targets=_targets,
    relies_on=(vllm_sites.UPDATE_STATE_AFTER_ALLOC,),
)
