"""Patch ``block_keys``: P and D prove they mean the same request before D loads P's KV.

vLLM's NIXL connector moves KV blocks by block id only.  Nothing checks that the prefill engine
(P) and the decode engine (D) hold the same request: a proxy or tokenizer mismatch gives D a
different prompt, a routing slip a different LoRA adapter, cache salt or multimodal input.  D
then loads KV computed for something else (and caches it under its own keys: prefix-cache
poisoning).

With this patch:

* **P** (``request_finished`` on the connector facade, for a request that came with
  ``do_remote_decode``) adds ``kv_transfer_params["pdpatch_block_keys"]``: the request's
  *canonical* block keys (:mod:`pdpatch.hashing.verdict`: vLLM's key chain with one fixed
  algorithm, key format and NONE_HASH, at P's hash block size -- a digest, and the keys
  themselves for prompts of at most :data:`MAX_HEX_KEYS` blocks), digests of each hashing
  input, and P's own block-key fingerprint for the log.  JSON; bounded; the proxy forwards it
  to D unchanged.
* **D** (``get_num_new_matched_tokens`` on the connector's scheduler half), before a remote
  load: parses those params with a bounded, validating parser (never ``eval``, never
  ``pickle``), recomputes the canonical keys from its own request, and on any difference
  answers "no external tokens" -- the request is computed locally and P is told to free its
  blocks, as stock vLLM does for a full local prefix hit.  One warning per cause
  (rate-limited) and a counter (:func:`stats`).  A match, or a P without pdpatch (no such
  params), leaves vLLM's answer untouched.  ``PDPATCH_BLOCK_KEYS_ON_MISMATCH=warn`` only warns
  and still loads.
* **What both hash** is the prompt prefix that moves.  Where P's release stops its prefill
  short of the prompt's last tokens, which D recomputes itself (Mamba hybrids 0.19+, MTP's
  lookahead window 0.31+, bounded replay 0.32+, every release through 0.34:
  :data:`pdpatch.vllm_sites.P_PROMPT_TRUNCATION`), P hashes the prompt as vLLM cut it
  (``num_prompt_tokens``) and D the count its own half loads
  (:func:`pdpatch.vllm_sites.remote_prefill_tokens`), multimodal items and prompt embeddings
  clipped to it; elsewhere that is the whole prompt, hashed as before.  A request whose
  connector answer the scheduler ignores (0.31+: one that reads no external KV) is not judged.
* **Every engine** logs its own fingerprint at start (``EngineCore.__init__``) on the
  ``pdpatch`` logger.  Engines that name blocks differently in their prefix caches (different
  ``PYTHONHASHSEED`` -- vLLM's default leaves it unset --, algorithm, block size or release)
  still pair: the canonical keys do not depend on any of it, and D says so once per P.

Cost per remote request, on the path of its first token: the input digests (one sha256 over
the prompt token ids, one per other input), on P when the request finishes and on D before it
loads.  Equal digests mean equal keys (:func:`pdpatch.hashing.verdict.same_request`), so
neither side computes the key chain of a long prompt: P only for prompts of at most
:data:`MAX_HEX_KEYS` blocks, whose keys it sends, D only where the digests differ, to name the
cause and the first differing block.  (P's keys on a background thread, during the prefill,
hid nothing: that thread competes with the engine's own for the GIL.)
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "block_keys"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    p_hook = _code("make_p_hook", version)
    return targets_at(version, (vllm_sites.REQUEST_FINISHED, p_hook),
                      (vllm_sites.REQUEST_FINISHED_ALL_GROUPS, p_hook),
                      (vllm_sites.GET_NUM_NEW_MATCHED_TOKENS, _code("make_d_hook", version)),
                      (vllm_sites.ENGINE_CORE_INIT, _code("make_engine_hook", version)))


PATCH = Patch(
    name=NAME,
    summary="P sends digests of the request's inputs (its block keys up to 32 blocks) + "
            "fingerprint; D loads remote KV only when they match its own",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.SCHEDULER_REQUEST_FINISHED, vllm_sites.UPDATE_STATE_AFTER_ALLOC,
               vllm_sites.REQUEST_INIT, vllm_sites.BLOCK_HASHING,
               vllm_sites.P_PROMPT_TRUNCATION, vllm_sites.REMOTE_PREFILL_TOKEN_COUNT),
    state=_code("BlockKeysState"),
    object_state=_code("Fingerprint"),
)
