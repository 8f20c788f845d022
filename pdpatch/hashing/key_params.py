"""Block-key params: prove that a prefill (P) and a decode (D) peer mean the same blocks.

(Not the ``peer_check`` patch, which bounds a peer's handshake metadata.)

P describes its keys for a request with :func:`build_params` (a small JSON-able dict for
``kv_transfer_params``); D parses what arrives with :func:`parse_params` (bounded, validating:
only dicts/lists/str/int of known shapes, hex of exact lengths, never ``eval`` or ``pickle``)
and checks it against its own keys with :func:`compare`, which returns the causes of a
mismatch (empty list: the keys are equal).

The dict is O(1) in the prompt length: the number of blocks, short digests of each input that
shapes the keys (``prompt``, ``lora``, ``cache_salt``, ``mm``, ``prompt_embeds``: they name the
cause of a mismatch, besides the configuration causes of
:func:`pdpatch.hashing.fingerprint.fingerprint_diff`) and, from :func:`build_params`, a digest of
all keys (the last key alone chains over the whole prefix, the digest also covers every
intermediate key), optionally with the keys themselves for short prompts.

:func:`digest_params` leaves the keys out: the key chain is a function of the configuration
(the fingerprint) and of the inputs (the digests), so the digests decide equality as the keys
would, and the sender need not compute the chain (P's canonical keys of a long prompt, on the
path of its first token).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdpatch.hashing.algorithms import ALGORITHMS, cbor_dumps
from pdpatch.hashing.errors import PeerParamsError
from pdpatch.hashing.extra_keys import ExtraKeys
from pdpatch.hashing.fingerprint import fingerprint_diff, fingerprint_of
from pdpatch.hashing.formats import KEY_FORMATS
from pdpatch.hashing.keys import BlockKeyHasher

PARAMS_VERSION = 3
"""3: ``kd`` optional (:func:`digest_params`); a peer speaking another version is not parsed."""
DIGEST_HEX = 32
REQUEST_CAUSES = ("prompt", "lora", "cache_salt", "mm", "prompt_embeds")
SEED_SOURCES = ("PYTHONHASHSEED", "default", "reported")
_HEX = re.compile(r"[0-9a-f]*")
_RELEASE = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){0,3}")


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may send."""

    max_keys: int = 256
    max_blocks: int = 1 << 22
    max_tokens: int = 1 << 26
    max_hash_block_size: int = 1 << 20
    max_fields: int = 16
    max_json_bytes: int = 64 * 1024


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class PeerBlockKeys:
    """Validated block-key params of a peer."""

    fingerprint: dict[str, Any]
    num_blocks: int
    keys_digest: str | None
    """None where the peer sent digests only (:func:`digest_params`)."""
    keys: tuple[bytes, ...] | None
    summary: dict[str, Any]
    engine: dict[str, Any] | None = None
    """The sender engine's own fingerprint (``efp``), when the keys are not its own."""


def _digest(tag: bytes, data: bytes) -> str:
    return hashlib.sha256(b"pdpatch/" + tag + b"/v1\0" + data).hexdigest()[:DIGEST_HEX]


def keys_digest(keys: Sequence[bytes]) -> str:
    """A digest of the whole key list (order and every key)."""
    return _digest(b"keys", b"".join(keys))


def tokens_digest(tokens: Sequence[int]) -> str:
    try:
        data = struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error:  # an id outside int64: fall back to a self-delimiting encoding
        data = cbor_dumps([int(t) for t in tokens])
    return _digest(b"tokens", data)


def request_summary(hasher: BlockKeyHasher) -> dict[str, Any]:
    """Digests of each input that goes into ``hasher``'s keys."""
    return summary_of(hasher.tokens, hasher.extra)


def summary_of(tokens: Sequence[int], ek: ExtraKeys) -> dict[str, Any]:
    """Digests of each input that goes into the keys, shaped by the release's key format
    (e.g. the LoRA path only counts where vLLM hashes it, 0.31+).  Every input a key depends
    on is here: equal summaries mean equal keys for one key configuration."""
    pe = ek.prompt_embeds
    return {
        "nt": len(tokens),
        "td": tokens_digest(tokens),
        "ld": _digest(b"lora", cbor_dumps(ek.lora_keys)) if ek.lora_keys else None,
        "sd": _digest(b"salt", cbor_dumps(ek.salt_keys(0))) if ek.salt_keys(0) else None,
        "md": (_digest(b"mm", cbor_dumps([(m.identifier, m.offset, m.length) for m in ek.mm]))
               if ek.mm else None),
        "ed": (_digest(b"embeds", pe.row_bytes.to_bytes(8, "big") + bytes(pe.data))
               if pe is not None else None),
    }


def build_params(hasher: BlockKeyHasher, *, include_keys: int = 0) -> dict[str, Any]:
    """P's description of its keys (JSON-able; hex strings; bounded).

    ``include_keys``: also send the keys themselves when there are at most this many.
    """
    keys = hasher.keys
    params: dict[str, Any] = {
        "v": PARAMS_VERSION,
        "fp": fingerprint_of(hasher).to_dict(),
        "n": len(keys),
        "kd": keys_digest(keys),
        "x": request_summary(hasher),
    }
    if 0 < len(keys) <= include_keys:
        params["keys"] = [k.hex() for k in keys]
    return params


def digest_params(fingerprint: dict[str, Any], num_blocks: int, summary: dict[str, Any]
                  ) -> dict[str, Any]:
    """:func:`build_params` without the keys: the configuration ``fingerprint`` (of
    :func:`fingerprint_of`), the number of full blocks its keys have and the digests of the
    inputs (``summary``, of :func:`summary_of`)."""
    return {"v": PARAMS_VERSION, "fp": fingerprint, "n": num_blocks, "x": summary}


def _fail(what: str, value: Any = None) -> PeerParamsError:
    shown = "" if value is None else f" (got {type(value).__name__} {str(value)[:40]!r})"
    return PeerParamsError(f"block-key params: {what}{shown}")


def _int(d: dict[str, Any], key: str, lo: int, hi: int, *, optional: bool = False) -> int | None:
    v = d.get(key)
    if v is None and optional:
        return None
    if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
        raise _fail(f"'{key}' must be an int in [{lo}, {hi}]", v)
    return v


def _hex(v: Any, length: int, what: str) -> str:
    if type(v) is not str or len(v) != length or not _HEX.fullmatch(v):
        raise _fail(f"{what} must be {length} lowercase hex characters", v)
    return v


def _dict(v: Any, what: str, limits: Limits) -> dict[str, Any]:
    if type(v) is not dict or len(v) > limits.max_fields \
            or not all(type(k) is str for k in v):
        raise _fail(f"{what} must be an object with at most {limits.max_fields} string keys", v)
    return v


def _fingerprint(v: Any, limits: Limits) -> dict[str, Any]:
    d = _dict(v, "'fp'", limits)
    algo = d.get("algo")
    if algo not in ALGORITHMS:
        raise _fail(f"'fp.algo' must be one of {', '.join(ALGORITHMS)}", algo)
    if d.get("seed") not in SEED_SOURCES:
        raise _fail(f"'fp.seed' must be one of {', '.join(SEED_SOURCES)}", d.get("seed"))
    if d.get("kf") not in KEY_FORMATS:
        raise _fail("'fp.kf' is not a known key format", d.get("kf"))
    release = d.get("vllm")
    if type(release) is not str or len(release) > 20 or not _RELEASE.fullmatch(release):
        raise _fail("'fp.vllm' must be a release like 0.33.0", release)
    return {
        "algo": algo,
        "hbs": _int(d, "hbs", 1, limits.max_hash_block_size),
        "nh": _hex(d.get("nh"), 16, "'fp.nh'"),
        "seed": d["seed"],
        "kf": d["kf"],
        "vllm": release,
        "pp": _int(d, "pp", 0, 255, optional=True),
        "la": _int(d, "la", 0, 64, optional=True) or 0,
    }


def _summary(v: Any, limits: Limits) -> dict[str, Any]:
    d = _dict(v, "'x'", limits)
    out: dict[str, Any] = {"nt": _int(d, "nt", 0, limits.max_tokens),
                           "td": _hex(d.get("td"), DIGEST_HEX, "'x.td'")}
    for key in ("ld", "sd", "md", "ed"):
        out[key] = None if d.get(key) is None else _hex(d[key], DIGEST_HEX, f"'x.{key}'")
    return out


def parse_params(obj: Any, limits: Limits = DEFAULT_LIMITS) -> PeerBlockKeys:
    """Validate block-key params received from a peer (already JSON-decoded).

    Raises :class:`PeerParamsError` for anything malformed, unknown or oversized.
    """
    d = _dict(obj, "params", limits)
    if d.get("v") != PARAMS_VERSION or type(d.get("v")) is not int:
        raise _fail(f"unsupported params version (this pdpatch speaks {PARAMS_VERSION})",
                    d.get("v"))
    fp = _fingerprint(d.get("fp"), limits)
    n = _int(d, "n", 0, limits.max_blocks)
    assert n is not None
    kd = None if d.get("kd") is None else _hex(d["kd"], DIGEST_HEX, "'kd'")
    keys = None
    raw = d.get("keys")
    if raw is not None:
        if kd is None:
            raise _fail("'keys' come with their digest 'kd'")
        if type(raw) is not list or len(raw) != n or len(raw) > limits.max_keys:
            raise _fail(f"'keys' must be a list of exactly 'n' (<= {limits.max_keys}) keys",
                        raw)
        width = 32 if fp["algo"].startswith("xxhash") else 64
        keys = tuple(bytes.fromhex(_hex(k, width, "each key")) for k in raw)
        if keys_digest(keys) != kd:
            raise _fail("'keys' do not match 'kd'")
    engine = None if d.get("efp") is None else _fingerprint(d["efp"], limits)
    return PeerBlockKeys(fp, n, kd, keys, _summary(d.get("x"), limits), engine)


def parse_params_json(text: str | bytes, limits: Limits = DEFAULT_LIMITS) -> PeerBlockKeys:
    """:func:`parse_params` for raw JSON text, with a size bound before decoding."""
    if len(text) > limits.max_json_bytes:
        raise _fail(f"params larger than {limits.max_json_bytes} bytes")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _fail(f"params are not JSON: {type(e).__name__}") from None
    return parse_params(obj, limits)


def compare(hasher: BlockKeyHasher, peer: PeerBlockKeys) -> list[str]:
    """Why ``hasher``'s keys differ from the peer's; ``[]`` when they are equal.

    Causes, in order: configuration (``algo``, ``hash_block_size``, ``seed``, ``key_format``,
    ``pickle_protocol``, ``lookahead``), then request inputs (``prompt``, ``lora``,
    ``cache_salt``, ``mm``, ``prompt_embeds``); ``keys`` when none of them explains it.  A
    peer that sent digests only (no ``kd``) has the same keys where the block count, the
    configuration and every input digest are the same.
    """
    keys = hasher.keys
    if peer.keys_digest is not None and len(keys) == peer.num_blocks \
            and keys_digest(keys) == peer.keys_digest \
            and (peer.keys is None or tuple(keys) == peer.keys):
        return []
    causes = fingerprint_diff(fingerprint_of(hasher).to_dict(), peer.fingerprint)
    # the LoRA and salt digests are shaped by the key format; across formats only the
    # key_format cause is certain
    causes += input_causes(request_summary(hasher), peer.summary,
                           lora_and_salt="key_format" not in causes)
    if peer.keys_digest is None and not causes and len(keys) == peer.num_blocks:
        return []
    return causes or ["keys"]


def input_causes(mine: dict[str, Any], theirs: dict[str, Any], *,
                 lora_and_salt: bool = True) -> list[str]:
    """The request inputs whose digests differ (``prompt`` covers every token, the partial
    last block included)."""
    causes = []
    if mine["nt"] != theirs["nt"] or mine["td"] != theirs["td"]:
        causes.append("prompt")
    for key, cause in (("ld", "lora"), ("sd", "cache_salt"), ("md", "mm"),
                       ("ed", "prompt_embeds")):
        if (lora_and_salt or key not in ("ld", "sd")) and mine[key] != theirs[key]:
            causes.append(cause)
    return causes
