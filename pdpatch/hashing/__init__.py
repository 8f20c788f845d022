"""vLLM-compatible prefix-cache block keys, computed without importing vLLM.

The keys a vLLM server (0.10.2 .. 0.33) puts in ``request.block_hashes`` and in KV events,
byte for byte, for all four ``--prefix-caching-hash-algo`` values, with LoRA, multimodal,
cache-salt and prompt-embeds extra keys, the NONE_HASH seed rules of each release, coarse keys
for hybrid models and the KV-event integer form.  Golden fixtures captured from real vLLM
(``scripts/make_hash_fixtures.py``) and live comparisons against vLLM 0.33 keep it honest.

Typical use::

    from pdpatch.hashing import block_keys, fingerprint_of, BlockKeyHasher
    keys = block_keys(prompt_ids, algo="sha256_cbor", hash_block_size=16,
                      vllm_version="0.33.0", pythonhashseed="0")
"""

from pdpatch.hashing.algorithms import ALGORITHMS, Algorithm, get_algorithm
from pdpatch.hashing.errors import (
    HashingError,
    PeerParamsError,
    UnreproducibleSeedError,
    XxhashUnavailableError,
)
from pdpatch.hashing.extra_keys import LoraSpec, MMItem, PromptEmbeds, to_event_extra_keys
from pdpatch.hashing.fingerprint import Fingerprint, fingerprint_of
from pdpatch.hashing.formats import HashFormat, format_for
from pdpatch.hashing.keys import (
    BlockKeyHasher,
    KeyConfig,
    block_keys,
    coarse_keys,
    to_event_int,
    with_group_id,
)
from pdpatch.hashing.seed import DEFAULT_NONE_HASH_SEED, resolve_seed, seed_from_environ

__all__ = [
    "ALGORITHMS",
    "DEFAULT_NONE_HASH_SEED",
    "Algorithm",
    "BlockKeyHasher",
    "Fingerprint",
    "HashFormat",
    "HashingError",
    "KeyConfig",
    "LoraSpec",
    "MMItem",
    "PeerParamsError",
    "PromptEmbeds",
    "UnreproducibleSeedError",
    "XxhashUnavailableError",
    "block_keys",
    "coarse_keys",
    "fingerprint_of",
    "format_for",
    "get_algorithm",
    "resolve_seed",
    "seed_from_environ",
    "to_event_extra_keys",
    "to_event_int",
    "with_group_id",
]
