#!/usr/bin/env python3
"""Block keys of a 32k-token request: pdpatch.hashing vs vLLM's own ``hash_block_tokens`` chain.

    VLLM_TARGET_DEVICE=cpu .venv/bin/python -m scripts.bench_block_keys [--tokens 32768] \
        [--record | --json PATH]

For each algorithm, in the same process and the same run: vLLM's chain (``init_none_hash`` then
``hash_block_tokens`` per full block, exactly what ``get_request_block_hasher`` does for a plain
request) and ``pdpatch.hashing.block_keys`` (the public API: config, NONE_HASH, keys) on the
same tokens.  The keys are asserted byte-identical before any time is reported.  The runs are
interleaved (vLLM, pdpatch, vLLM, ...); times are this process's CPU time
(``time.process_time``, which other processes on a shared machine disturb less than wall time:
``--wall`` for wall time), the median of ``--repeat`` runs with the minimum in brackets;
ratio = vLLM / pdpatch.

pdpatch runs with its compiled block encoder (built by the wheel's build hook; the header says
whether it is present) and, in the last column, with its pure-Python encoders and input checks
only (what a build without a C compiler gets), both in the same interleaved runs.

A second baseline, vLLM's full request path (a real ``Request`` with
``get_request_block_hasher``, i.e. with its per-block extra-key calls), is printed alongside.

A second table (:func:`path_table`) prices what the ``block_keys`` patch leaves on a P/D
request's path to its first token (D's check, P's params at finish) against that ``Request``
path at 100, 1,500, 4,000 and 16,000 tokens (``--path-tokens``): the GPU runs' lengths.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from lab.bench import record

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936, help="token ids drawn below this")
    ap.add_argument("--repeat", type=int, default=25)
    ap.add_argument("--seed", default="0", help="PYTHONHASHSEED of both sides")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    ap.add_argument("--path-tokens", type=lambda v: [int(x) for x in v.split(",")],
                    default=[100, 1500, 4000, 16000], metavar="N,N,...",
                    help="prompt lengths of the request-path table")
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    rec = record.Recorder("block_keys", args, argv)

    os.environ["PYTHONHASHSEED"] = args.seed  # vLLM's init_none_hash reads it at call time
    import vllm
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as K
    from vllm.v1.request import Request

    from pdpatch.hashing import KeyConfig, block_keys, encoders, inputs

    rng = random.Random(1234)
    tokens = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    bs = args.block_size
    print(f"vLLM {vllm.__version__}, Python {sys.version.split()[0]}, {args.tokens} tokens, "
          f"hash_block_size {bs}, vocab {args.vocab}, median (min) of {args.repeat} runs, "
          f"{'wall' if args.wall else 'CPU'} time; load average {os.getloadavg()[0]:.1f}")

    compiled, first_non_id = encoders._compiled, inputs._first_non_id
    rec.data["compiled_encoder"] = bool(compiled)
    rec.samples["unit"] = f"ms of {'wall' if args.wall else 'CPU'} time per call"
    print(f"pdpatch's compiled block encoder: {'present' if compiled else 'ABSENT'}; "
          "last column: pdpatch with its pure-Python encoders only, ratio vs the vLLM chain")
    print(f"{'algorithm':12} {'vLLM chain':>18} {'pdpatch':>18} {'ratio':>14}   "
          f"{'vLLM Request':>12} {'ratio':>6}   {'pure Python':>11} {'ratio':>6}")
    worst_cbor = None
    clock = time.perf_counter if args.wall else time.process_time
    for algo in ALGOS:
        fn = get_hash_fn_by_name(algo)
        K.init_none_hash(fn)
        hash_block_tokens = K.hash_block_tokens

        def vllm_chain(fn=fn, hash_block_tokens=hash_block_tokens) -> list[bytes]:
            out, parent = [], None
            for s in range(0, len(tokens) - bs + 1, bs):
                parent = hash_block_tokens(fn, parent, tokens[s:s + bs], None)
                out.append(parent)
            return out

        def vllm_request(fn=fn) -> list[bytes]:
            req = Request(request_id="b", prompt_token_ids=tokens,
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                          block_hasher=K.get_request_block_hasher(bs, fn))
            return req.block_hashes

        config = KeyConfig(vllm_version="0.33.0", algo=algo, hash_block_size=bs,
                           pythonhashseed=args.seed)

        def ours(config=config) -> list[bytes]:
            return block_keys(tokens, config)

        def ours_pure() -> list[bytes]:
            encoders._compiled, inputs._first_non_id = None, None
            try:
                return ours()
            finally:
                encoders._compiled, inputs._first_non_id = compiled, first_non_id

        expected = vllm_chain()
        assert ours() == expected, f"{algo}: pdpatch keys differ from vLLM's"
        assert ours_pure() == expected, f"{algo}: pdpatch's pure-Python keys differ"
        assert vllm_request() == expected
        times: dict[str, list[float]] = {"chain": [], "ours": [], "request": [], "pure": []}
        for _ in range(args.repeat):
            for name, fn_ in (("chain", vllm_chain), ("ours", ours), ("request", vllm_request),
                              ("pure", ours_pure)):
                t = clock()
                fn_()
                times[name].append(clock() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        low = {k: min(v) * 1e3 for k, v in times.items()}
        ratio = med["chain"] / med["ours"]
        rec.samples[algo] = {k: [x * 1e3 for x in v] for k, v in times.items()}
        rec.derived.update({f"{algo}: vLLM chain ms": med["chain"],
                            f"{algo}: pdpatch ms": med["ours"],
                            f"{algo}: vLLM chain / pdpatch": ratio,
                            f"{algo}: vLLM chain / pdpatch, minima": low["chain"] / low["ours"],
                            f"{algo}: vLLM Request / pdpatch": med["request"] / med["ours"],
                            f"{algo}: pure Python ms": med["pure"],
                            f"{algo}: vLLM chain / pure Python": med["chain"] / med["pure"]})
        if algo.endswith("_cbor"):
            worst_cbor = ratio if worst_cbor is None else min(worst_cbor, ratio)
        print(f"{algo:12} {med['chain']:5.2f} ({low['chain']:5.2f}) ms "
              f"{med['ours']:5.2f} ({low['ours']:5.2f}) ms {ratio:5.2f}x "
              f"({low['chain'] / low['ours']:4.2f}x)   {med['request']:5.2f} ms "
              f"{med['request'] / med['ours']:5.2f}x   {med['pure']:5.2f} ms "
              f"{med['chain'] / med['pure']:5.2f}x")
    print(f"keys byte-identical for all algorithms; cbor algorithms (median): >= "
          f"{worst_cbor:.2f}x (goal 3x)")
    path_table(args.path_tokens, args.repeat, clock, bs, rec.samples, rec.derived)
    rec.finish()
    return 0


def path_table(lengths: list[int], repeat: int, clock: Callable[[], float], bs: int,
               samples: dict[str, Any] | None = None,
               derived: dict[str, Any] | None = None) -> None:
    """What the ``block_keys`` patch leaves on a P/D request's path to its first token, per
    prompt length, against vLLM's own work on the same prompt: its ``Request``'s block hashes
    (sha256, computed when every request arrives, P and D alike).

    D's check of P's params (:func:`pdpatch.hashing.key_params.parse_params`, then
    :func:`pdpatch.hashing.verdict.judge`) and P's params for a
    finished request (:func:`pdpatch.hashing.verdict.build_p_params`): the input digests, and
    the keys only up to 32 blocks.  For comparison, one side's whole canonical key chain: what
    each side computed before the digests stood for it (D still does where a digest
    differs)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as K
    from vllm.v1.request import Request

    from pdpatch.hashing.key_params import parse_params
    from pdpatch.hashing.verdict import RequestInputs, build_p_params, engine_keys, judge

    fn = get_hash_fn_by_name("sha256")
    K.init_none_hash(fn)
    engine = engine_keys(algo="sha256", hash_block_size=bs, vllm_version="0.33.0",
                         none_hash=K.NONE_HASH, pythonhashseed=os.environ["PYTHONHASHSEED"])
    print(f"\non a P/D request's path to its first token (hash block size {bs}), median of "
          f"{repeat} runs; ratio = pdpatch / vLLM's own block hashes of the same prompt")
    print(f"{'tokens':>7} {'vLLM Request':>12}   {'D check':>8} {'ratio':>6}   "
          f"{'P params':>8} {'ratio':>6}   {'key chain':>9} {'ratio':>6}")
    rng = random.Random(99)
    for n in lengths:
        tokens = [rng.randrange(151936) for _ in range(n)]
        sent = build_p_params(engine, RequestInputs(tokens, {}), 32)

        def vllm_request(tokens=tokens) -> object:
            return Request(request_id="b", prompt_token_ids=tokens,
                           sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                           block_hasher=K.get_request_block_hasher(bs, fn))

        def d_check(tokens=tokens, sent=sent) -> object:
            verdict = judge(engine, RequestInputs(tokens, {}), parse_params(sent))
            assert verdict.status == "match", verdict
            return verdict

        def p_params(tokens=tokens) -> object:
            return build_p_params(engine, RequestInputs(tokens, {}), 32)

        def key_chain(tokens=tokens) -> object:
            return RequestInputs(tokens, {}).canonical(bs)

        runs = (("vllm", vllm_request), ("check", d_check), ("p", p_params),
                ("chain", key_chain))
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        for _ in range(repeat):
            for name, fn_ in runs:
                t = clock()
                fn_()
                times[name].append(clock() - t)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        if samples is not None and derived is not None:
            samples[f"path, {n} tokens"] = {k: [x * 1e3 for x in v] for k, v in times.items()}
            derived[f"path, {n} tokens: vLLM Request ms"] = med["vllm"]
            for key, what in (("check", "D check"), ("p", "P params"), ("chain", "key chain")):
                derived[f"path, {n} tokens: {what} ms"] = med[key]
                derived[f"path, {n} tokens: {what} / vLLM Request"] = med[key] / med["vllm"]
        print(f"{n:7d} {med['vllm']:9.3f} ms   {med['check']:5.3f} ms "
              f"{med['check'] / med['vllm']:5.2f}x   {med['p']:5.3f} ms "
              f"{med['p'] / med['vllm']:5.2f}x   {med['chain']:6.3f} ms "
              f"{med['chain'] / med['vllm']:5.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
