"""``pdpatch hash`` and ``pdpatch fingerprint``: block keys and peer fingerprints from a shell.

Both build one :class:`~pdpatch.hashing.config.KeyConfig` from their flags (or its JSON form,
``--config``), with no default for any of its four settings, and read the request with
:mod:`pdpatch.hashing.request_json`.  Every error a user can cause -- a bad configuration or
input, a missing file -- is one line on stderr and exit status 2; a traceback would be a bug
(``tests/test_hashing_commands.py`` feeds arbitrary JSON to prove there is none).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from pdpatch.hashing.algorithms import ALGORITHMS
from pdpatch.hashing.config import FIELD_HINTS, INSTALLED, REQUIRED_FIELDS, KeyConfig
from pdpatch.hashing.errors import HashingError, InputError, KeyConfigError
from pdpatch.hashing.extra_keys import LoraSpec, MMItem
from pdpatch.hashing.fingerprint import fingerprint_of
from pdpatch.hashing.keys import BlockKeyHasher, coarse_keys, to_event_int
from pdpatch.hashing.request_json import (
    EMBEDS_DTYPES,
    MAX_INPUT_BYTES,
    RequestSpec,
    decode_input,
    embeds_from,
)
from pdpatch.hashing.seed import seed_from_environ

MAX_EMBEDS_BYTES = 4 << 30
_FLAGS = {"vllm_version": "--vllm-version", "algo": "--algo", "hash_block_size": "--block-size",
          "pythonhashseed": "--seed/--seed-unset/--seed-from-env"}
_MM_FLAG = re.compile(r"(.+):([0-9]{1,20}):([0-9]{1,20})", re.DOTALL)

SERVER_HELP = """\
the server (each required, from a flag or --config; a wrong one gives keys that look right
and never match):
  --vllm-version  the server's release (`vllm --version`), or 'installed' for the vLLM
                  installed next to pdpatch
  --algo          its --prefix-caching-hash-algo; vLLM's default is sha256 (xxhash and
                  xxhash_cbor need the xxhash package, here and on the server)
  --block-size    its hash block size: for a model with one KV-cache group the KV-cache block
                  size (--block-size; when not given the platform and attention backend
                  choose it, 16 on most CUDA backends); for a hybrid model vLLM's
                  hash_block_size (the block size every group's size is a multiple of), with
                  --coarse K for a group of K times that size
  --seed S / --seed-unset / --seed-from-env
                  the PYTHONHASHSEED of the server's EngineCore processes, verbatim ('' and
                  '0' are seeds too, and '0' differs from '00'); --seed-unset when it is not
                  set, vLLM's default: NONE_HASH is then fixed for sha256/sha256_cbor on 0.29+
                  and random -- no key is reproducible, pdpatch refuses -- otherwise;
                  --seed-from-env reads this shell's PYTHONHASHSEED (for a shell that has the
                  server's environment)
  --config        the same four as JSON, e.g. {"vllm_version": "0.33.0", "algo": "sha256",
                  "hash_block_size": 16, "pythonhashseed": null} ('@FILE' reads a file;
                  `pdpatch fingerprint --json` prints it); flags win over it
"""

HASH_HELP = f"""\
Print vLLM's prefix-cache block keys of one request: one key per full block of the prompt,
as the server puts them in request.block_hashes (hex) and in its KV events
(--format event-int).

{SERVER_HELP}
the request: token ids as arguments, from --input FILE ('-': stdin) or piped on stdin --
separated by spaces or commas, a JSON list, or a JSON object with vLLM's field names:
  {{"prompt_token_ids": [...], "lora": {{"name": ..., "path": ..., "id": ...}},
   "cache_salt": "...", "mm": [{{"identifier": ..., "offset": ..., "length": ...}}],
   "prompt_embeds": {{"base64": ..., "hidden_size": ..., "dtype": ...}}}}
  prompt_token_ids  the prompt exactly as the server tokenized it (chat template and special
                  tokens included): integers >= 0
  lora            the adapter as the server registered it (none by default): name (what the
                  request's model field selects); path, hashed verbatim by vLLM 0.31+ (PATH
                  of --lora-modules NAME=PATH); id, hashed instead of the name by <= 0.11.0
                  (lora_int_id: the order the server registered its adapters in, first 1)
  cache_salt      the request's cache_salt (none by default)
  mm              each multimodal item, in prompt order: identifier (the server's hash of the
                  item, or the request's multi_modal_uuids entry) and its placeholder range
                  (offset, length) in the prompt; items may touch, not overlap
  prompt_embeds   a prompt given as embeddings (token ids may be left out: each position
                  counts as id 0): the tensor's raw bytes, row-major (tokens x hidden_size),
                  in the dtype the server hashes -- the model's --dtype on 0.21+ (vLLM casts
                  the request's tensor), the request's own dtype before; for large tensors
                  --prompt-embeds FILE
  The flags --lora-name/--lora-path/--lora-id, --cache-salt, --mm and --prompt-embeds give
  the same inputs (each input once: as a flag or in the JSON).  An input no server accepts
  (negative ids, overlapping or out-of-prompt items, an unknown field, a LoRA without the
  field the release hashes) is an error, never a key.

string identity (algorithms sha256 and xxhash, which pickle): a key depends on whether two
equal strings in one block are one Python object or two.  A vLLM server holds a separate
object for every field of a request; so does this command (each JSON value and flag is
decoded on its own).  A program calling pdpatch.hashing must do the same -- never pass one
cached or interned string object for two fields (e.g. for an image that occurs twice).  The
CBOR algorithms (sha256_cbor, xxhash_cbor) do not depend on identity.

Errors (a bad configuration or input) are one line on stderr and exit status 2.
"""

FINGERPRINT_HELP = f"""\
Print what a server's block keys depend on: algorithm, NONE_HASH (the parent of block 0) and
where its seed comes from, hash block size, key format (the release era of the extra keys),
pickle protocol, lookahead.  Two servers share keys only where all of these agree; --json also
prints the configuration in the form --config reads.

{SERVER_HELP}"""


def _one_line_error(parser: argparse.ArgumentParser) -> None:
    """Usage errors as one line (argparse prints the whole usage first)."""
    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")
    parser.error = error  # type: ignore[method-assign]


def _read_file(path: str, stdin: TextIO | None, limit: int, what: str) -> bytes:
    """The bytes of ``path`` ('-': stdin), refused past ``limit``."""
    if path == "-":
        if stdin is None:
            raise InputError(f"{what}: there is no stdin")
        buffer = getattr(stdin, "buffer", None)
        raw = (buffer.read(limit + 1) if buffer is not None  # a text stream without bytes
               else stdin.read(limit + 1).encode("utf-8", "surrogatepass"))  # (tests)
    else:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    if len(raw) > limit:
        raise InputError(f"{what} is larger than {limit >> 20} MiB")
    return raw


def key_config(args: argparse.Namespace) -> KeyConfig:
    """The server's configuration from ``--config`` and the flags (flags win)."""
    data: dict[str, Any] = {}
    if args.config is not None:
        text = args.config
        try:
            if text.startswith("@"):
                text = _read_file(text[1:], sys.stdin, MAX_INPUT_BYTES, "--config").decode()
            loaded = json.loads(text)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise KeyConfigError("--config is not a JSON object") from None
        if not isinstance(loaded, dict):
            raise KeyConfigError("--config is not a JSON object")
        data.update(loaded)
    for name in ("vllm_version", "algo", "hash_block_size", "lookahead"):
        if getattr(args, name, None) is not None:
            data[name] = getattr(args, name)
    if args.seed is not None:
        data["pythonhashseed"] = args.seed
    elif args.seed_unset:
        data["pythonhashseed"] = None
    elif args.seed_from_env:
        data["pythonhashseed"] = seed_from_environ()
    for name in REQUIRED_FIELDS:
        if name not in data:
            raise KeyConfigError(f"no {_FLAGS[name]}: {FIELD_HINTS[name]}")
    return KeyConfig.from_mapping(data)


def _request(args: argparse.Namespace, stdin: TextIO | None) -> RequestSpec:
    """The request from the arguments, --input or stdin, with the input flags merged in."""
    if args.tokens:
        spec = decode_input(" ".join(args.tokens).encode("utf-8", "surrogatepass"))
    elif args.input is not None or (stdin is not None and not stdin.isatty()):
        spec = decode_input(_read_file(args.input or "-", stdin, MAX_INPUT_BYTES, "the input"))
    else:
        spec = RequestSpec([])
    flags: dict[str, Any] = {}
    if args.lora_name is not None:
        flags["lora"] = LoraSpec(args.lora_name, args.lora_path, args.lora_id)
    elif args.lora_path is not None or args.lora_id is not None:
        raise InputError("--lora-path and --lora-id describe the adapter --lora-name names")
    if args.cache_salt is not None:
        flags["cache_salt"] = args.cache_salt
    if args.mm:
        flags["mm"] = [_parse_mm(s) for s in args.mm]
    if args.prompt_embeds is not None:
        data = _read_file(args.prompt_embeds, stdin, MAX_EMBEDS_BYTES, "--prompt-embeds")
        flags["prompt_embeds"] = embeds_from(data, args.hidden_size, args.embeds_dtype)
    elif args.hidden_size is not None or args.embeds_dtype is not None:
        raise InputError("--hidden-size and --embeds-dtype describe the --prompt-embeds file")
    for name in flags:
        if name in spec.inputs:
            raise InputError(f"{name} is given twice: as a flag and in the JSON input")
    spec.inputs.update(flags)
    embeds = spec.inputs.get("prompt_embeds")
    if not spec.tokens and embeds is not None:
        spec.tokens = [0] * embeds.num_rows
    if not spec.tokens:
        raise InputError("no token ids: pass them as arguments, with --input FILE, or on "
                         "stdin (vLLM refuses an empty prompt)")
    return spec


def _parse_mm(spec: str) -> MMItem:
    m = _MM_FLAG.fullmatch(spec)
    if not m:
        raise InputError(f"--mm wants IDENTIFIER:OFFSET:LENGTH, got {spec[:60]!r}")
    return MMItem(m.group(1), int(m.group(2)), int(m.group(3)))


def cmd_hash(args: argparse.Namespace, stdin: TextIO | None = None,
             stdout: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    config = key_config(args)
    spec = _request(args, stdin if stdin is not None else sys.stdin)
    hasher = BlockKeyHasher(config, spec.tokens, **spec.inputs)
    keys = hasher.keys
    if args.coarse is not None:
        keys = coarse_keys(keys, args.coarse, config.vllm_version)
    if args.format == "json":
        json.dump({"config": config.to_mapping(),
                   "fingerprint": fingerprint_of(hasher).describe(),
                   "num_tokens": len(hasher.tokens),
                   "keys": [k.hex() for k in keys],
                   "event_ints": [to_event_int(k) for k in keys]}, stdout, indent=1)
        stdout.write("\n")
    else:
        for k in keys:
            stdout.write(f"{to_event_int(k) if args.format == 'event-int' else k.hex()}\n")
    return 0


def cmd_fingerprint(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    stdout = stdout or sys.stdout
    config = key_config(args)
    info = fingerprint_of(config.validate()).describe()
    if args.json:
        json.dump({**info, "config": config.to_mapping()}, stdout, indent=1)
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
        except (HashingError, OSError) as e:
            print(f"pdpatch {name}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
    return run


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-version", metavar="RELEASE",
                   help=f"the server's vLLM release, or '{INSTALLED}'")
    p.add_argument("--algo", choices=ALGORITHMS,
                   help="the server's --prefix-caching-hash-algo (vLLM's default: sha256)")
    p.add_argument("--block-size", "--hash-block-size", dest="hash_block_size", type=int,
                   metavar="N", help="the server's hash block size (see above)")
    p.add_argument("--lookahead", type=int, metavar="N",
                   help="EAGLE lookahead tokens (vLLM 0.33+: the engine's "
                   "num_hash_lookahead_tokens; 0, the default, unless EAGLE drops the trailing "
                   "block, and on 0.33 with any KV connector -- 0.34 keeps it with NIXL)")
    seed = p.add_mutually_exclusive_group()
    seed.add_argument("--seed", metavar="PYTHONHASHSEED",
                      help="the server EngineCore's PYTHONHASHSEED, verbatim")
    seed.add_argument("--seed-unset", action="store_true",
                      help="the server runs with PYTHONHASHSEED unset (vLLM's default)")
    seed.add_argument("--seed-from-env", action="store_true",
                      help="use this process's PYTHONHASHSEED (unset if it is unset)")
    p.add_argument("--config", metavar="JSON|@FILE",
                   help="the configuration as JSON (see above)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``hash`` and ``fingerprint`` to the ``pdpatch`` command's subparsers."""
    h = subparsers.add_parser("hash", help="vLLM block keys of a request", description=HASH_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_argument("tokens", nargs="*", help="token ids (spaces or commas), or JSON")
    h.add_argument("--input", "-i", metavar="FILE", help="the request: ids or JSON ('-': stdin)")
    _add_config_args(h)
    h.add_argument("--lora-name", help="the LoRA adapter's name as the server registered it")
    h.add_argument("--lora-path", help="the PATH of --lora-modules NAME=PATH (vLLM >= 0.31)")
    h.add_argument("--lora-id", type=int, help="lora_int_id (vLLM <= 0.11.0)")
    h.add_argument("--cache-salt", help="the request's cache_salt")
    h.add_argument("--mm", action="append", metavar="ID:OFFSET:LENGTH",
                   help="a multimodal item (repeatable, in prompt order)")
    h.add_argument("--prompt-embeds", metavar="FILE",
                   help="a prompt given as embeddings: the tensor's raw row-major bytes")
    h.add_argument("--hidden-size", type=int, metavar="N",
                   help="the --prompt-embeds tensor's hidden size")
    h.add_argument("--embeds-dtype", choices=tuple(EMBEDS_DTYPES),
                   help="the --prompt-embeds tensor's dtype")
    h.add_argument("--coarse", type=int, metavar="K",
                   help="keys of a KV-cache group with block size K * hash block size")
    h.add_argument("--format", choices=("hex", "event-int", "json"), default="hex")
    h.set_defaults(func=_guard(cmd_hash, "hash"))
    _one_line_error(h)

    f = subparsers.add_parser("fingerprint", help="what a server's block keys depend on",
                              description=FINGERPRINT_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(f)
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=_guard(cmd_fingerprint, "fingerprint"))
    _one_line_error(f)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdpatch")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
