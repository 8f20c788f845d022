"""``pdpatch hash`` and ``pdpatch fingerprint``: block keys and peer fingerprints from a shell.

``pdpatch hash 1 2 3 ... --algo sha256_cbor --block-size 16 --seed 0`` prints one key per full
block (hex, or the KV-event ints with ``--format event-int``).  Token ids come from the
arguments, from ``--input FILE`` (``-``: stdin) or from a pipe; the input may be JSON: a list of
ids, or an object with ``prompt_token_ids`` plus optional ``lora`` ({name, path, id}),
``cache_salt`` and ``mm`` ([{identifier, offset, length}]).

``pdpatch fingerprint`` prints what a peer with that configuration must agree on: algorithm,
seed source, NONE_HASH (and its short id), hash block size, key format, pickle protocol.

The seed defaults to *this* process's PYTHONHASHSEED, the value a vLLM started from the same
environment would use; ``--seed`` / ``--seed-unset`` describe another peer.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from pdpatch.hashing.algorithms import ALGORITHMS
from pdpatch.hashing.errors import HashingError, XxhashUnavailableError
from pdpatch.hashing.extra_keys import LoraSpec, MMItem
from pdpatch.hashing.fingerprint import fingerprint_of
from pdpatch.hashing.formats import DEFAULT_VLLM_VERSION
from pdpatch.hashing.keys import BlockKeyHasher, coarse_keys, to_event_int
from pdpatch.hashing.seed import seed_from_environ

_UNSET = object()


def _default_vllm_version() -> str:
    """The installed vLLM's release (read from package metadata), else 0.33.0."""
    try:
        from pdpatch.versions import vllm_version
    except ImportError:  # pragma: no cover - the lead's module is always shipped
        return DEFAULT_VLLM_VERSION
    v = vllm_version()
    return str(v) if v is not None else DEFAULT_VLLM_VERSION


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algo", choices=ALGORITHMS, default="sha256",
                   help="the peer's --prefix-caching-hash-algo (vLLM's default: sha256)")
    p.add_argument("--block-size", "--hash-block-size", dest="hash_block_size", type=int,
                   default=16, help="the peer's hash_block_size: --block-size for single-group "
                   "models; for hybrid models see --prefix-match-unit / the gcd of group sizes")
    p.add_argument("--vllm-version", default=None,
                   help="the peer's vLLM release (default: the installed one, else "
                   f"{DEFAULT_VLLM_VERSION})")
    seed = p.add_mutually_exclusive_group()
    seed.add_argument("--seed", default=_UNSET, metavar="PYTHONHASHSEED",
                      help="the peer EngineCore's PYTHONHASHSEED, verbatim ('' is a seed too; "
                      "default: this process's)")
    seed.add_argument("--seed-unset", action="store_true",
                      help="the peer runs with PYTHONHASHSEED unset")


def _seed(args: argparse.Namespace) -> str | None:
    if args.seed_unset:
        return None
    if args.seed is not _UNSET:
        return args.seed
    return seed_from_environ()


def _parse_mm(spec: str) -> MMItem:
    m = re.fullmatch(r"(.+):(-?\d+):(\d+)", spec)
    if not m:
        raise HashingError(f"--mm wants IDENTIFIER:OFFSET:LENGTH, got {spec!r}")
    return MMItem(m.group(1), int(m.group(2)), int(m.group(3)))


def _parse_tokens_text(text: str) -> tuple[list[int], dict[str, Any]]:
    text = text.strip()
    if not text:
        return [], {}
    if text[0] in "[{":
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise HashingError(f"token input is not valid JSON: {e}") from None
        if isinstance(doc, dict):
            toks = doc.get("prompt_token_ids", doc.get("tokens"))
            return _int_list(toks), doc
        return _int_list(doc), {}
    return _int_list(re.split(r"[\s,]+", text)), {}


def _int_list(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise HashingError("token ids must be a list of integers")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise HashingError(f"not a token id: {v!r}")
        try:
            out.append(int(v))
        except ValueError:
            raise HashingError(f"not a token id: {v!r}") from None
    return out


def _read_input(args: argparse.Namespace, stdin: TextIO) -> tuple[list[int], dict[str, Any]]:
    if args.tokens:
        return _parse_tokens_text(" ".join(args.tokens))
    if args.input == "-" or (args.input is None and not stdin.isatty()):
        return _parse_tokens_text(stdin.read())
    if args.input is not None:
        with open(args.input, encoding="utf-8") as f:
            return _parse_tokens_text(f.read())
    raise HashingError("no token ids: pass them as arguments, with --input FILE, or on stdin")


def _request_inputs(args: argparse.Namespace, doc: dict[str, Any]) -> dict[str, Any]:
    lora = doc.get("lora")
    if args.lora_name is not None:
        lora = {"name": args.lora_name, "path": args.lora_path, "id": args.lora_id}
    lora_spec = None
    if lora:
        if not isinstance(lora, dict) or not isinstance(lora.get("name"), str):
            raise HashingError("lora must be an object with a 'name' (and 'path', 'id')")
        lora_spec = LoraSpec(lora["name"], lora.get("path") or "", int(lora.get("id") or 1))
    mm = [_parse_mm(s) for s in args.mm] if args.mm else [
        MMItem(str(m["identifier"]), int(m["offset"]), int(m["length"]))
        for m in doc.get("mm") or []]
    salt = args.cache_salt if args.cache_salt is not None else doc.get("cache_salt")
    return {"lora": lora_spec, "mm": mm, "cache_salt": salt}


def _hasher(args: argparse.Namespace, tokens: Sequence[int] = (), **extra: Any
            ) -> BlockKeyHasher:
    return BlockKeyHasher(algo=args.algo, hash_block_size=args.hash_block_size,
                          vllm_version=args.vllm_version or _default_vllm_version(),
                          pythonhashseed=_seed(args), prompt=tokens, **extra)


def cmd_hash(args: argparse.Namespace, stdin: TextIO | None = None,
             stdout: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    tokens, doc = _read_input(args, stdin or sys.stdin)
    hasher = _hasher(args, tokens, lookahead=args.lookahead, **_request_inputs(args, doc))
    keys = hasher.keys
    if args.coarse > 1:
        keys = coarse_keys(keys, args.coarse, hasher.format.release)
    if args.format == "json":
        json.dump({"fingerprint": fingerprint_of(hasher).describe(),
                   "num_tokens": len(tokens),
                   "keys": [k.hex() for k in keys],
                   "event_ints": [to_event_int(k) for k in keys]}, stdout, indent=1)
        stdout.write("\n")
    else:
        for k in keys:
            stdout.write(f"{to_event_int(k) if args.format == 'event-int' else k.hex()}\n")
    return 0


def cmd_fingerprint(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    fp = fingerprint_of(_hasher(args))
    info = fp.describe()
    if args.json:
        json.dump(info, stdout, indent=1)
        stdout.write("\n")
        return 0
    labels = {"algo": "algorithm", "hbs": "hash block size", "seed": "seed source",
              "none_hash": "NONE_HASH", "nh": "NONE_HASH id", "kf": "key format (since)",
              "vllm": "vLLM release", "pp": "pickle protocol", "la": "lookahead tokens"}
    for key, label in labels.items():
        value = info[key]
        stdout.write(f"{label:20} {'-' if value is None else value}\n")
    return 0


def _guard(fn: Any, name: str) -> Any:
    """Errors a user can fix become one line on stderr and exit status 2, not a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (HashingError, XxhashUnavailableError, OSError) as e:
            print(f"pdpatch {name}: error: {e}", file=sys.stderr)
            return 2
    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hash`` and ``fingerprint`` to the ``pdpatch`` command's subparsers."""
    h = subparsers.add_parser("hash", help="vLLM block keys of token ids",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_argument("tokens", nargs="*", help="token ids (spaces or commas)")
    h.add_argument("--input", "-i", help="file with token ids or JSON ('-': stdin)")
    _add_config_args(h)
    h.add_argument("--lora-name", help="LoRA adapter name as the server registered it")
    h.add_argument("--lora-path", default="", help="the path given to --lora-modules name=PATH "
                   "(hashed verbatim by vLLM >= 0.31)")
    h.add_argument("--lora-id", type=int, default=1, help="lora_int_id (hashed by <= 0.11)")
    h.add_argument("--cache-salt", help="the request's cache_salt")
    h.add_argument("--mm", action="append", metavar="ID:OFFSET:LENGTH",
                   help="a multimodal item (repeatable, in prompt order)")
    h.add_argument("--lookahead", type=int, default=0,
                   help="EAGLE lookahead tokens (vLLM 0.33, only without a KV connector)")
    h.add_argument("--coarse", type=int, default=1, metavar="K",
                   help="keys of a KV-cache group with block size K * hash block size")
    h.add_argument("--format", choices=("hex", "event-int", "json"), default="hex")
    h.set_defaults(func=_guard(cmd_hash, "hash"))

    f = subparsers.add_parser("fingerprint", help="what two peers' block keys depend on")
    _add_config_args(f)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=_guard(cmd_fingerprint, "fingerprint"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdpatch")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
