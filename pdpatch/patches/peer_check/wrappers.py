"""The code of patch ``peer_check``, loaded when vLLM imports the NIXL worker (the patch and why it
exists: :mod:`pdpatch.patches.peer_check`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdpatch import metrics
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.peer_check import NAME

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
