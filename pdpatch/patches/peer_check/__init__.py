"""Patch ``peer_check``: a prefill peer's handshake metadata with impossible values is rejected
at handshake time, naming the field, instead of being used.

Found by a bad-input sweep (a fake side channel serving P's real handshake reply with one field
corrupted, against a real vLLM 0.33 decode engine; replayed by
``tests/e2e/test_robustness_e2e.py``).  msgspec's typed decode already rejects wrong *types*;
nothing checks *values*.  A peer advertising ``num_blocks`` of -5, 0 or
10**12 is accepted and read from (0.33 and 0.34 build their descriptors from
``region_num_blocks``, one strided descriptor per region -- 0.34.0 ``base_worker.py``
L2289-2291, L2318-2322 -- and happen to read the right bytes; up to 0.29 the count sizes the
descriptor list itself -- ``range(num_blocks)`` in 0.19-0.25, ``np.arange`` in 0.26-0.29 -- so
10**12 exhausts the decode worker's memory).  Other corruptions (zero block size, zero strides,
empty regions) fail deep inside the release's validation with bare asserts.

The pre-hook on ``add_remote_agent`` (handshake thread: only that peer's requests fail) checks
the values every release relies on: positive ``num_blocks``, ``block_size``, block lengths and
(0.21+) ``physical_blocks_per_logical_kv_block``; one block length and one base address per
region; non-negative addresses and device id; (0.29+) strides no shorter than the block;
(0.30+) positive per-region counts; and that every region fits a 48-bit address space
(``count x stride``, and ``num_blocks x block length``), which bounds the descriptor count by
what the peer could have registered.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "peer_check"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.ADD_REMOTE_AGENT, _code("check_peer")))


PATCH = Patch(
    name=NAME,
    summary="reject at handshake a peer whose metadata has impossible values",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.VALIDATE_HANDSHAKE, vllm_sites.BUILD_FA_REMOTE, vllm_sites.DESC_IDS,
               vllm_sites.PAIR_REGIONS, vllm_sites.CONNECTOR_VERSION),
)
