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

from collections.abc import Sequence
from typing import Any

from packaging.version import Version

from pdpatch import metrics, vllm_sites
from pdpatch.patches.common import allowed, arg
from pdpatch.registry import Patch, Target

NAME = "peer_check"
ADDRESS_SPACE = 1 << 48            # x86-64 / aarch64 user virtual address space


class PeerMetadataInvalid(ValueError):
    """A prefill peer advertised handshake metadata no vLLM engine can produce."""


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(xs: Any) -> bool:
    return isinstance(xs, Sequence) and not isinstance(xs, (str, bytes)) and \
        all(_int(x) for x in xs)


def problems(meta: Any) -> list[str]:
    out: list[str] = []
    num_blocks = getattr(meta, "num_blocks", None)
    if not _int(num_blocks) or num_blocks < 1:
        out.append(f"num_blocks is {num_blocks!r}, not a positive integer")
    block_size = getattr(meta, "block_size", None)
    if not _int(block_size) or block_size < 1:
        out.append(f"block_size is {block_size!r}, not a positive integer")
    ppl = getattr(meta, "physical_blocks_per_logical_kv_block", 1)
    if not _int(ppl) or ppl < 1:
        out.append(f"physical_blocks_per_logical_kv_block is {ppl!r}, not a positive integer")
    device_id = getattr(meta, "device_id", 0)
    if not _int(device_id) or device_id < 0:
        out.append(f"device_id is {device_id!r}, not a non-negative integer")
    addrs = getattr(meta, "kv_caches_base_addr", None)
    lens = getattr(meta, "block_lens", None)
    if not _ints(addrs) or not addrs or any(a < 0 for a in addrs):
        out.append("kv_caches_base_addr must be a non-empty list of non-negative addresses")
        return out
    if not _ints(lens) or any(n < 1 for n in lens):
        out.append("block_lens must be positive integers")
        return out
    if len(lens) != len(addrs):
        out.append(f"{len(lens)} block_lens for {len(addrs)} regions")
        return out
    strides = getattr(meta, "block_strides", None)
    if strides is not None and (not _ints(strides) or len(strides) != len(addrs)
                                or any(s < n for s, n in zip(strides, lens, strict=False))):
        out.append("block_strides must be one integer per region, each at least that "
                   "region's block length")
        strides = None
    counts = getattr(meta, "region_num_blocks", None)
    if counts is not None and (not _ints(counts) or len(counts) != len(addrs)
                               or any(c < 1 for c in counts)):
        out.append("region_num_blocks must be one positive integer per region")
        counts = None
    if not out and num_blocks * max(lens) > ADDRESS_SPACE:
        out.append(f"num_blocks {num_blocks} x block length {max(lens)} B is beyond a 48-bit "
                   "address space")
    if not out:
        for i, base in enumerate(addrs):
            count = counts[i] if counts is not None else num_blocks
            span = count * (strides[i] if strides is not None else lens[i])
            if base + span > ADDRESS_SPACE:
                out.append(f"region {i} would span {count} blocks x "
                           f"{strides[i] if strides is not None else lens[i]} B from "
                           f"{base:#x}, beyond a 48-bit address space")
                break
    return out


# What every release reads from a peer's metadata before it builds descriptors.
REQUIRED_FIELDS = ("engine_id", "num_blocks", "block_size", "kv_caches_base_addr", "block_lens")


def check_peer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    meta = arg(args, kwargs, 0, "nixl_agent_meta", None)
    # metadata without the fields is not a peer's (msgspec decodes every one of them): the
    # release fails on it with its own error
    if allowed(NAME, instance) and all(hasattr(meta, f) for f in REQUIRED_FIELDS):
        found = problems(meta)
        if found:
            metrics.count(instance, metrics.REFUSALS, NAME)
            raise PeerMetadataInvalid(
                f"pdpatch: NIXL handshake rejected, peer {getattr(meta, 'engine_id', '?')} "
                "advertised impossible metadata: " + "; ".join(found) + " [peer_check]")
    return wrapped(*args, **kwargs)


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.ADD_REMOTE_AGENT, version)
    return [] if site is None else [Target(site.module, site.qualname, check_peer)]


PATCH = Patch(
    name=NAME,
    summary="reject at handshake a peer whose metadata has impossible values",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.VALIDATE_HANDSHAKE, vllm_sites.BUILD_FA_REMOTE, vllm_sites.DESC_IDS,
               vllm_sites.PAIR_REGIONS, vllm_sites.CONNECTOR_VERSION),
)
