"""vLLM-compatible prefix-cache block keys, computed without importing vLLM.

The keys a vLLM server (0.10.2 .. 0.34) puts in ``request.block_hashes`` and in KV events,
byte for byte, for all four ``--prefix-caching-hash-algo`` values, with LoRA, multimodal,
cache-salt and prompt-embeds extra keys, the NONE_HASH seed rules of each release, coarse keys
for hybrid models and the KV-event integer form.  Golden fixtures captured from real vLLM
(``scripts/make_hash_fixtures.py``) and live randomized comparisons against the own hasher of
every release (``tests/test_hashing_releases.py``, ``tests/test_hashing_vllm_live.py``) keep it
honest.

Typical use: one :class:`KeyConfig` per server (every setting explicit: a wrong one gives keys
that look right and never match), then the keys of each request::

    from pdpatch.hashing import KeyConfig, LoraSpec, block_keys
    server = KeyConfig(vllm_version="0.33.0", algo="sha256", hash_block_size=16,
                       pythonhashseed=None)           # None: PYTHONHASHSEED unset on the server
    keys = block_keys(prompt_ids, server, lora=LoraSpec("adapter", "/adapters/adapter"))

Every bad configuration or input raises a :class:`HashingError`.  For the pickle algorithms
(``sha256``, ``xxhash``) give each string input its own object, as a JSON decoder does (see
:mod:`pdpatch.hashing.extra_keys`).
"""

from pdpatch.hashing.algorithms import ALGORITHMS, Algorithm, get_algorithm
from pdpatch.hashing.config import INSTALLED, KeyConfig
from pdpatch.hashing.errors import (
    HashingError,
    InputError,
    KeyConfigError,
    PeerParamsError,
    UnreproducibleSeedError,
    XxhashUnavailableError,
)
from pdpatch.hashing.extra_keys import LoraSpec, MMItem, PromptEmbeds, to_event_extra_keys
from pdpatch.hashing.fingerprint import Fingerprint, fingerprint_of
from pdpatch.hashing.formats import HashFormat, format_for
from pdpatch.hashing.keys import (
    BlockKeyHasher,
    block_keys,
    coarse_keys,
    to_event_int,
    with_group_id,
)
from pdpatch.hashing.seed import DEFAULT_NONE_HASH_SEED, resolve_seed, seed_from_environ

__all__ = [
    "ALGORITHMS",
    "DEFAULT_NONE_HASH_SEED",
    "INSTALLED",
    "Algorithm",
    "BlockKeyHasher",
    "Fingerprint",
    "HashFormat",
    "HashingError",
    "InputError",
    "KeyConfig",
    "KeyConfigError",
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
