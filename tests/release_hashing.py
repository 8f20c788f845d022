"""vLLM's own block hasher, driven by case dicts, in a process whose ``import vllm`` is the
release under test (the installed one, or an old release's source tree first on ``sys.path``).

Shared by ``scripts/make_hash_fixtures.py`` (golden fixtures) and
``tests/test_hashing_releases.py`` (live randomized differential tests on every release).  Every
key comes from the release's own objects: ``get_hash_fn_by_name`` (``vllm.utils`` <= 0.11,
``vllm.utils.hashing`` after), ``init_none_hash`` under the case's ``PYTHONHASHSEED`` (it reads
``os.environ`` at call time), ``get_request_block_hasher``, a real ``vllm.v1.request.Request``
with real ``LoRARequest`` / ``MultiModalFeatureSpec`` / ``PlaceholderRange`` / prompt-embeds
tensor, ``Request.append_output_token_ids`` for decode appends, ``BlockHashListWithBlockSize``
for coarse keys, ``maybe_convert_block_hash`` for the KV-event ints and ``to_event_extra_keys``
(0.31+).  Nothing is copied from pdpatch.

A case is a JSON object: ``algo``, ``block_size``, ``seed`` (PYTHONHASHSEED, null: unset),
``prompt`` (ids; null with ``prompt_embeds``), ``appends`` (decode chunks), ``lora``
(``name``/``path``/``id``), ``cache_salt``, ``mm`` (``[identifier, offset, length]``),
``prompt_embeds`` (``rows``/``cols``: the fixtures' ``arange/7`` float16 tensor, or with
``dtype``/``hex``: those raw bytes), ``lookahead``, and what to report besides the keys:
``event_ints``, ``coarse`` (factors), ``event_extra_keys``.  Token ids are ints the release's
``Request`` holds (:meth:`ReleaseHasher.max_token_id`: int32 from 0.34); a larger one is an
error of vLLM's, reported as such.

Every string handed to vLLM is a fresh object, as a server's JSON decoder makes them (pickle's
identity memo, see ``pdpatch.hashing.extra_keys``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# token ids a Request may be asked to hold, widest first: up to 0.33 any Python int, from 0.34
# an int32 TokenBuffer (ids past 2**31-1 raise OverflowError)
TOKEN_ID_BOUNDS = (2**64 - 1, 2**63 - 1, 2**32 - 1, 2**31 - 1, 2**16 - 1, 2**15 - 1)


def fresh(s: str) -> str:
    """An equal str that is a new object (the empty and one-character Latin-1 strings are
    CPython singletons anyway, in vLLM and in a JSON-decoded replay alike)."""
    return "".join(list(s)) if len(s) > 1 else s


def _jsonable(x: Any) -> Any:
    if isinstance(x, bytes):
        return {"hex": x.hex()}
    if isinstance(x, (tuple, list)):
        return [_jsonable(i) for i in x]
    return x


def _set_seed(seed: str | None) -> None:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed


class ReleaseHasher:
    """The imported release's hashing objects and what its API accepts."""

    def __init__(self) -> None:
        import vllm
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.request import Request

        try:
            from vllm.utils.hashing import get_hash_fn_by_name
        except ImportError:  # <= 0.11
            from vllm.utils import get_hash_fn_by_name

        self.version = vllm.__version__
        self.K = kv_cache_utils
        self.Request, self.SamplingParams = Request, SamplingParams
        self.LoRARequest = LoRARequest
        self.Feature, self.Placeholder = MultiModalFeatureSpec, PlaceholderRange
        self.hash_fn = get_hash_fn_by_name
        self.request_params = inspect.signature(Request.__init__).parameters
        self.mm_fields = {f.name for f in dataclasses.fields(MultiModalFeatureSpec)}
        self.hasher_params = inspect.signature(kv_cache_utils.get_request_block_hasher).parameters
        self.algorithms = []
        for algo in ALGOS:
            try:
                get_hash_fn_by_name(algo)
                self.algorithms.append(algo)
            except ValueError:
                pass

    @property
    def takes_prompt_embeds(self) -> bool:
        return "prompt_embeds" in self.request_params

    def unseeded_random(self) -> dict[str, bool]:
        """Per algorithm: does NONE_HASH change between two inits with PYTHONHASHSEED unset?"""
        _set_seed(None)
        out = {}
        for algo in self.algorithms:
            fn = self.hash_fn(algo)
            self.K.init_none_hash(fn)
            first = self.K.NONE_HASH
            self.K.init_none_hash(fn)
            out[algo] = first != self.K.NONE_HASH
        return out

    def max_token_id(self) -> int:
        """The largest id of :data:`TOKEN_ID_BOUNDS` the release's own ``Request`` holds, in
        its prompt and in a decode append (read from the code, not from a release list)."""
        algo = self.algorithms[0]
        for bound in TOKEN_ID_BOUNDS:
            try:
                req = self.request({"algo": algo, "seed": "0", "block_size": 1,
                                    "prompt": [bound]})
                req.append_output_token_ids([bound])
            except OverflowError:
                continue
            return bound
        raise AssertionError("the release holds no token id of 2**15-1")

    def _embeds(self, spec: dict[str, Any]) -> Any:
        import torch

        rows, cols = spec["rows"], spec["cols"]
        if "hex" in spec:
            dtype = getattr(torch, spec["dtype"])
            return torch.frombuffer(bytearray.fromhex(spec["hex"]), dtype=dtype).reshape(
                rows, cols)
        return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 7
                ).to(torch.float16)

    def request(self, case: dict[str, Any]) -> Any:
        """A real Request for ``case``, with the release's own block hasher."""
        fn = self.hash_fn(case["algo"])
        _set_seed(case["seed"])
        self.K.init_none_hash(fn)
        bs = case["block_size"]
        kwargs: dict[str, Any] = {}
        if case.get("lookahead"):
            kwargs["num_hash_lookahead_tokens"] = case["lookahead"]
        hasher = self.K.get_request_block_hasher(bs, fn, **kwargs)
        kw: dict[str, Any] = dict(request_id="r", pooling_params=None, block_hasher=hasher,
                                  sampling_params=self.SamplingParams(max_tokens=1))
        if "eos_token_id" in self.request_params:
            kw["eos_token_id"] = None
        if case.get("prompt_embeds"):
            kw["prompt_token_ids"] = None
            kw["prompt_embeds"] = self._embeds(case["prompt_embeds"])
        else:
            kw["prompt_token_ids"] = list(case["prompt"])
        if case.get("lora"):
            lo = case["lora"]
            kw["lora_request"] = self.LoRARequest(lora_name=fresh(lo["name"]),
                                                  lora_int_id=lo["id"],
                                                  lora_path=fresh(lo["path"]))
        if case.get("cache_salt") is not None:
            kw["cache_salt"] = fresh(case["cache_salt"])
        if case.get("mm"):
            feats = []
            for ident, off, length in case["mm"]:
                f = dict(data=None, modality="image", identifier=fresh(ident),
                         mm_position=self.Placeholder(offset=off, length=length))
                if "mm_hash" in self.mm_fields:
                    f["mm_hash"] = f["identifier"]
                feats.append(self.Feature(**f))
            kw["mm_features"] = feats
        return self.Request(**kw)

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        """``case`` plus what vLLM computed: ``none_hash``, ``keys`` (after every append),
        ``keys_after_prompt`` and the reports the case asks for."""
        K = self.K
        req = self.request(case)
        bs = case["block_size"]
        after_prompt = len(req.block_hashes)
        for chunk in case.get("appends", []):
            req.append_output_token_ids(list(chunk))
        keys = list(req.block_hashes)
        out = {**case, "none_hash": K.NONE_HASH.hex(), "keys": [k.hex() for k in keys],
               "keys_after_prompt": after_prompt}
        if case.get("event_ints"):
            out["event_ints"] = [K.maybe_convert_block_hash(k) for k in keys]
        out.pop("coarse", None)
        if case.get("coarse") and hasattr(K, "BlockHashListWithBlockSize"):
            out["coarse"] = {str(f): [k.hex() for k in K.BlockHashListWithBlockSize(
                keys, bs, f * bs)] for f in case["coarse"]}
        out.pop("event_extra_keys", None)
        if case.get("event_extra_keys") and hasattr(K, "to_event_extra_keys"):
            extras, idx = [], 0
            for s in range(0, after_prompt * bs, bs):
                e, idx = K.generate_block_hash_extra_keys(req, s, s + bs, idx)
                extras.append(e)
            out["event_extra_keys"] = _jsonable(K.to_event_extra_keys(extras))
        return out


def drive(payload: dict[str, Any]) -> dict[str, Any]:
    """Every case of ``payload["cases"]`` through the release (for ``tests/release_pool.py``):
    the release's algorithms, its unseeded-randomness per algorithm, and per case the result
    of :meth:`ReleaseHasher.run` -- or the error vLLM raised, or ``skipped`` for an algorithm
    or an input the release does not have."""
    rh = ReleaseHasher()
    results = []
    for case in payload["cases"]:
        if case["algo"] not in rh.algorithms or (case.get("prompt_embeds")
                                                 and not rh.takes_prompt_embeds):
            results.append({"skipped": True})
            continue
        try:
            results.append(rh.run(case))
        except Exception as e:  # vLLM refusing an input is a result too
            results.append({"error": f"{type(e).__name__}: {e}"})
    return {"vllm": rh.version, "algorithms": rh.algorithms,
            "unseeded_random": rh.unseeded_random(), "max_token_id": rh.max_token_id(),
            "results": results}
