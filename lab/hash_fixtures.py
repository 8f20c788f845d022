#!/usr/bin/env python3
"""Golden block-key fixtures, produced by REAL vLLM's own hashing code, one file per release.

    .venv/bin/python -m scripts.make_hash_fixtures                  # the default releases
    .venv/bin/python -m scripts.make_hash_fixtures 0.19.0 0.33.0    # some of them
    .venv/bin/python -m scripts.make_hash_fixtures --check          # diff, write nothing

Writes ``tests/fixtures/hash/vllm-<release>.json``; ``tests/test_hashing_fixtures.py`` replays
every case through ``pdpatch.hashing`` and demands identical bytes.

How each release runs (a child process per release, ``--capture`` mode):

* the installed vLLM (0.34.0 in the test venv) runs as installed;
* any other release runs from its own wheel's ``.py`` tree: the wheel is downloaded with
  ``pip download --no-deps vllm==X`` and unpacked by ``scripts/fetch_vllm_sources.sh`` (into
  ``~/.cache/pdpatch/vllm-src/X``; ``--sources DIR`` to use another), and the child gets
  ``PYTHONPATH=<tree>``, so ``import vllm`` is that release's code over the venv's torch,
  transformers, cbor2, xxhash.  Releases before 0.24 also import ``diskcache`` (<= 0.11) and
  ``gguf``, which the test venv lacks: they are installed with ``pip install --no-deps --target
  ~/.cache/pdpatch/old-vllm-deps`` and appended to the child's PYTHONPATH (the venv itself is
  not touched).  No compiled vLLM code is needed: hashing is pure Python.

In the child, every key comes from vLLM's own objects, driven by ``tests/release_hashing.py``
(shared with the live differential test ``tests/test_hashing_releases.py``): nothing is copied
from the spec or from pdpatch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests" / "fixtures" / "hash"
# every release on either side of a change in the hashing rules (see pdpatch/hashing/formats.py)
# (0.34.0: hashes as 0.33.0, but holds token ids as int32)
DEFAULT_RELEASES = ("0.10.2", "0.11.0", "0.11.1", "0.12.0", "0.13.0", "0.16.0", "0.17.0", "0.18.0",
                    "0.19.0", "0.23.0", "0.24.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                    "0.32.0", "0.33.0", "0.34.0")
OLD_TREE_DEPS = ("diskcache", "gguf")

# §4.1 of the research note: every CBOR/pickle integer width, a 2-block prompt and a tail
GOLDEN_TOKENS = [1, 23, 24, 255, 256, 65535, 65536, 128000, 151643, 0, 7, 42, 1000, 2000, 30000,
                 100000, *range(500, 516), 9, 8, 7, 6, 5, 4, 3, 2]
RANDOM_CASES_PER_ALGO = 12
RANDOM_SEED = 20261126
ANY_TOKEN_ID = 2**64 - 1
"""The bound of a release whose Request holds any int (up to 0.33): the draws are unchanged."""


# ----------------------------------------------------------------------------- inputs
def _token(rng: random.Random, max_id: int = ANY_TOKEN_ID) -> int:
    """A token id from a width class (CBOR: 1/2/3/5/9 bytes; pickle: BININT1/2/BININT/LONG1), of
    at most ``max_id`` (what the release's Request holds: the classes past it are not drawn)."""
    widths = [(0, 23), (24, 255), (256, 65535), (65536, 262143), (262144, 2**31 - 1),
              (2**31, 2**32 - 1), (2**32, 2**63 - 1)][: 7 if rng.random() < 0.1 else 4]
    lo, hi = rng.choice([(lo, min(hi, max_id)) for lo, hi in widths if lo <= max_id])
    return rng.choice([lo, hi, rng.randint(lo, hi)])


def _ident(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(rng.choice([1, 8, 32])))


def random_cases(algo: str, max_id: int = ANY_TOKEN_ID) -> list[dict[str, Any]]:
    """Deterministic random inputs: the same for every release whose Request holds any token id,
    and for one that holds fewer (``max_id``: 0.34's int32) the same draws without the wider
    ids."""
    rng = random.Random(f"{RANDOM_SEED}-{algo}")
    cases = []
    for i in range(RANDOM_CASES_PER_ALGO):
        bs = rng.choice([1, 2, 3, 4, 5, 8, 16, 23, 24, 25, 32])
        n = rng.randint(0, 6 * bs + 5)
        case: dict[str, Any] = {
            "name": f"random-{i}", "algo": algo, "block_size": bs,
            "seed": rng.choice(["0", "0", "", "random", "12345", "00"]),
            "prompt": [_token(rng, max_id) for _ in range(n)],
            "appends": [[_token(rng, max_id) for _ in range(rng.randint(1, 2 * bs))]
                        for _ in range(rng.randint(0, 3))],
        }
        if rng.random() < 0.35:
            case["lora"] = {"name": rng.choice(["l", "my-lora", _ident(rng)]),
                            "path": rng.choice(["/a/" + _ident(rng), "x"]),
                            "id": rng.randint(1, 9)}
        if rng.random() < 0.35:
            case["cache_salt"] = rng.choice(["", "s", "tenant-" + _ident(rng)])
        if rng.random() < 0.5 and n:
            items, pos = [], rng.randint(0, max(0, n // 3))
            for _ in range(rng.randint(1, 3)):
                length = rng.randint(1, max(1, 2 * bs))
                if pos + length > n:
                    break
                items.append([_ident(rng), pos, length])
                pos += length + rng.choice([0, 0, 1, bs])
            case["mm"] = items
        cases.append(case)
    return cases


def named_cases(algo: str, release: tuple[int, ...]) -> list[dict[str, Any]]:
    t = GOLDEN_TOKENS
    lora = {"name": "my-lora", "path": "/adapters/my-lora", "id": 1}
    mm = [["mmhash-abc123", 5, 20]]
    base = {"algo": algo, "block_size": 16, "seed": "0", "prompt": t}
    cases = [
        {**base, "name": "plain", "appends": [list(range(11, 19))], "event_ints": True,
         "coarse": [2, 3]},
        {**base, "name": "lora", "lora": lora},
        {**base, "name": "cache_salt", "cache_salt": "tenant-a"},
        {**base, "name": "lora+salt", "lora": lora, "cache_salt": "tenant-a"},
        {**base, "name": "mm", "mm": mm, "event_extra_keys": True},
        {**base, "name": "lora+salt+mm", "lora": lora, "cache_salt": "tenant-a", "mm": mm,
         "event_extra_keys": True},
        {**base, "name": "seed-empty", "seed": ""},
        {**base, "name": "seed-random-string", "seed": "random"},
        {**base, "name": "seed-00", "seed": "00"},
        {**base, "name": "seed-unset", "seed": None},
        {**base, "name": "block-size-1", "block_size": 1, "prompt": t[:20]},
        {**base, "name": "block-size-32", "block_size": 32, "appends": [[7] * 30]},
        {**base, "name": "two-mm-in-one-block", "mm": [["img-a", 2, 3], ["img-b", 7, 4]]},
        {**base, "name": "mm-ends-on-boundary", "mm": [["img-a", 4, 12], ["img-b", 16, 16]]},
        # research note §3.3: decode-completed blocks with MM on old releases
        {**base, "name": "mm-decode-earlier-item", "block_size": 32,
         "prompt": list(range(1000, 1056)), "mm": [["img-a", 5, 40], ["img-b", 54, 2]],
         "appends": [list(range(2000, 2008))]},
        {**base, "name": "mm-decode-item-ends-at-block", "block_size": 16,
         "prompt": list(range(1000, 1053)), "mm": [["img-a", 9, 39]],
         "appends": [list(range(2000, 2011))]},
    ]
    if release >= (0, 11):
        cases.append({**base, "name": "prompt-embeds", "prompt": None,
                      "prompt_embeds": {"rows": 40, "cols": 4}, "appends": [[5] * 30]})
    if release >= (0, 33):
        cases.append({**base, "name": "lookahead-1", "lookahead": 1, "mm": mm,
                      "appends": [[3, 4]]})
        cases.append({**base, "name": "lookahead-2", "lookahead": 2, "lora": lora,
                      "appends": [[3]]})
    return cases


# ----------------------------------------------------------------------------- capture (child)
def capture() -> dict[str, Any]:
    import cbor2
    import torch
    import vllm
    import xxhash

    from tests.release_hashing import ReleaseHasher

    rh = ReleaseHasher()
    release = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2])
    unseeded_random = rh.unseeded_random()
    max_id = rh.max_token_id()             # from the release's own Request
    cases = []
    for algo in rh.algorithms:
        for case in named_cases(algo, release):
            if case["seed"] is None and unseeded_random[algo]:
                continue  # nothing reproducible to record; the refusal is tested instead
            cases.append(rh.run(case))
        cases.extend(rh.run(c) for c in random_cases(algo, max_id))
    os.environ.pop("PYTHONHASHSEED", None)
    return {
        "vllm": vllm.__version__,
        "vllm_file": str(Path(vllm.__file__).parent),
        "python": sys.version.split()[0],
        "cbor2": getattr(cbor2, "__version__", None) or _dist_version("cbor2"),
        "xxhash": xxhash.VERSION,
        "torch": torch.__version__,
        "pickle_protocol": __import__("pickle").HIGHEST_PROTOCOL,
        "lookahead_supported": "num_hash_lookahead_tokens" in rh.hasher_params,
        "algorithms": rh.algorithms,
        "unseeded_random": unseeded_random,
        "max_token_id": max_id,
        "cases": cases,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- orchestration
def _installed_vllm() -> str | None:
    return _dist_version("vllm")


def _source_tree(release: str, sources: Path | None) -> Path:
    if sources is not None:
        tree = sources / release
    else:
        root = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_vllm_sources.sh"), release],
                              check=True, capture_output=True, text=True).stdout.strip()
        tree = Path(root.splitlines()[-1]) / release
    if not (tree / "vllm" / "v1" / "core" / "kv_cache_utils.py").is_file():
        raise SystemExit(f"no vLLM {release} source tree at {tree}")
    return tree


def _old_deps(target: Path) -> Path:
    if not all((target / d).is_dir() for d in OLD_TREE_DEPS):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(target), *OLD_TREE_DEPS], check=True)
    return target


def generate(release: str, sources: Path | None, deps: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PDPATCH_") and k not in ("ENABLE_PDPATCH", "PYTHONHASHSEED",
                                                         "PYTHONPATH")}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    if release != _installed_vllm():
        env["PYTHONPATH"] = os.pathsep.join([str(_source_tree(release, sources)),
                                             str(_old_deps(deps))])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "capture.json"
        # -m from the checkout root: the child imports tests/release_hashing.py from there
        proc = subprocess.run([sys.executable, "-m", "lab.hash_fixtures", "--capture",
                               str(out)], env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
            raise SystemExit(f"capture failed for vLLM {release}")
        data = json.loads(out.read_text())
    if data["vllm"].split("+")[0] != release:
        raise SystemExit(f"asked for vLLM {release}, the child imported {data['vllm']} from "
                         f"{data['vllm_file']}")
    data["generated_by"] = "scripts/make_hash_fixtures.py"
    data.pop("vllm_file")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="*", default=list(DEFAULT_RELEASES))
    ap.add_argument("--capture", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--sources", type=Path, help="directory of <release>/vllm/*.py trees")
    ap.add_argument("--deps", type=Path, default=Path.home() / ".cache/pdpatch/old-vllm-deps")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="compare with the committed files")
    args = ap.parse_args(argv)
    if args.capture:  # child: vLLM's logs go to stdout, the result to a file
        args.capture.write_text(json.dumps(capture(), separators=(",", ":")))
        return 0
    status = 0
    for release in args.releases:
        data = generate(release, args.sources, args.deps)
        path = args.out / f"vllm-{release}.json"
        text = json.dumps(data, indent=None, separators=(",", ":"), sort_keys=True) + "\n"
        if args.check:
            same = path.is_file() and json.loads(path.read_text())["cases"] == data["cases"]
            print(f"{release}: {'unchanged' if same else 'DIFFERS'}")
            status |= not same
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"{release}: {len(data['cases'])} cases -> {path.relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
