"""The full-width models' seeded weights (lab/gpu/weights.py), on the CPU at a tiny width: the
same recipe and writer the device runs on its GPU at full width.

What must hold for the GPU runs' answers to mean anything: the configs are the named models';
each one's KV cache is its narrow twin's (so transfer sizes match the recorded runs); the
checkpoint is what vLLM's own model classes load, tensor for tensor; the same seed gives the
same tensors whatever the order or sharding, another seed others; and the answers depend on the
KV cache -- a corrupted-KV control changes the first token or its logprob far beyond the drift
the oracle tolerates, through real torch (transformers' models) and through real vLLM engines
doing P/D over NIXL on the CPU (the rig's engines, marked e2e) -- while vLLM's dummy weights
(``--load-format dummy``) give answers no control can change.
"""

from __future__ import annotations

import math

import pytest
import vllm_meta_load

from lab.gpu import aged, oracle, weights
from lab.gpu import pd as gpu_pd
from lab.rig.model import tiny_config

ARCHS = sorted(weights.FULL)


def test_full_configs_are_the_named_models():
    """Parameter counts as the models publish them (Llama-3-8B 8,030,261,248; Qwen2.5-7B
    7,615,616,512, its q/k/v biases included); DeepSeek-V2-Lite's dense MLP within 3 % of the
    width one of its tokens runs through (6 routed + 2 shared experts of 1408)."""
    assert weights.parameters(weights.FULL["llama3-8b-full"]) == 8_030_261_248
    assert weights.parameters(weights.FULL["qwen2.5-7b-full"]) == 7_615_616_512
    ds = weights.FULL["deepseek-v2-lite-full"]
    active = (ds["num_experts_per_tok"] + ds["n_shared_experts"]) * ds["moe_intermediate_size"]
    assert abs(ds["intermediate_size"] - active) / active < 0.03
    assert ds["first_k_dense_replace"] >= ds["num_hidden_layers"]
    assert weights.checkpoint_bytes(weights.FULL["llama3-8b-full"]) == 2 * 8_030_261_248


@pytest.mark.parametrize("name", ARCHS)
def test_a_full_width_model_moves_its_narrow_twins_kv(name):
    """The full-width model's KV cache per token is its narrow geometry's (the recorded runs'):
    the same bytes over NIXL, only the compute differs."""
    twin = {**tiny_config(), **gpu_pd.GEOMETRIES[weights.NARROW_TWIN[name]]}
    assert aged.kv_bytes_per_token(weights.FULL[name]) == aged.kv_bytes_per_token(twin)
    assert gpu_pd.is_full_width(name) and not gpu_pd.is_full_width(weights.NARROW_TWIN[name])
    assert gpu_pd.is_mla(name) == gpu_pd.is_mla(weights.NARROW_TWIN[name])


@pytest.mark.parametrize("name", ["llama3-8b-full", "deepseek-v2-lite-full"])
def test_the_recipe_names_and_shapes_are_the_rigs(name):
    """The same tensors, names and shapes as the rig's recipe (lab/rig/model.py), whose MLA
    checkpoint vLLM's DeepseekV2 is shown to load (tests/test_gpu_rig.py)."""
    from lab.rig.model import _weights

    cfg = weights.narrow(name)
    rig = _weights(cfg, 1)
    assert {s.name: tuple(s.shape) for s in weights.specs(cfg)} == \
        {k: tuple(v.shape) for k, v in rig.items()}


_CLASSES = {"LlamaForCausalLM": "vllm.model_executor.models.llama",
            "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
            "DeepseekV2ForCausalLM": "vllm.model_executor.models.deepseek_v2"}


@pytest.mark.parametrize("name", ARCHS)
def test_vllm_loads_every_parameter_from_the_checkpoint(name, tmp_path):
    """vLLM's own model class of each architecture (built on the meta device in a subprocess:
    it sets up vLLM's process-wide parallel state) loads every one of its parameters from the
    written shards through its ``load_weights``, whose loaders check shapes."""
    cfg = weights.narrow(name)
    weights.write(tmp_path / "m", cfg, shard_bytes=1 << 20)    # several shards and an index
    arch = cfg["architectures"][0]
    got = vllm_meta_load.run(tmp_path / "m", _CLASSES[arch], arch, cwd=tmp_path)
    assert sorted(got["params"]) == got["loaded"]


def test_the_seed_alone_decides_the_checkpoint(tmp_path):
    """Same seed: the same tensors, byte for byte, whatever the sharding (each tensor has its
    own generator), and the same fingerprint; another seed: other tensors and fingerprint."""
    import torch

    cfg = weights.narrow("qwen2.5-7b-full")
    a = weights.write(tmp_path / "a", cfg, seed=5)
    b = weights.write(tmp_path / "b", cfg, seed=5, shard_bytes=1 << 20)
    c = weights.write(tmp_path / "c", cfg, seed=6)
    assert b["shards"] > a["shards"] == 1
    assert a["fingerprint"] == b["fingerprint"] != c["fingerprint"]
    ta, tb, tc = (dict(weights.tensors(tmp_path / x)) for x in "abc")
    assert ta.keys() == tb.keys() == tc.keys() == {s.name for s in weights.specs(cfg)}
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    drawn = [s.name for s in weights.specs(cfg) if s.kind in ("lin", "embed")]
    assert not any(torch.equal(ta[k], tc[k]) for k in drawn)
    assert weights.write(tmp_path / "a", cfg, seed=5) == a       # kept, not drawn again
    assert weights.manifest_of(tmp_path / "a")["generator"] == "cpu"


def test_linear_weights_are_scaled_by_their_fan_in():
    """N(0, gain^2 / fan-in): the query's gain 3 and lm_head's 4 included."""
    cfg = weights.narrow("llama3-8b-full")
    for spec in weights.specs(cfg):
        if spec.kind != "lin":
            continue
        t = weights.make(spec, 1234, dtype="float32")
        want = spec.gain / math.sqrt(spec.shape[1])
        assert abs(float(t.std()) / want - 1) < 0.05, spec.name


def _answers(model, ids, other, corrupt=None):
    """First-token log-probabilities: D's own prefill of ``ids``; D decoding from the prompt's
    KV computed apart (P's), the last token computed on it (vLLM's P/D); and the controls: the
    first block's KV in every block, another prompt's KV."""
    import torch

    def last(cache):
        return torch.log_softmax(model(ids[:, -1:], past_key_values=cache).logits[0, -1]
                                 .float(), -1)

    def kv(x):
        return model(x[:, :-1], use_cache=True).past_key_values

    with torch.no_grad():
        base = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        intact = last(kv(ids))
        wrong = kv(ids)
        for layer in wrong.layers:
            for attr in ("keys", "values"):
                t = getattr(layer, attr)
                n = t.shape[-2]
                first = t[..., :16, :]
                reps = [1] * (t.dim() - 2) + [math.ceil(n / 16), 1]
                setattr(layer, attr, first.repeat(*reps)[..., :n, :].clone())
        return base, intact, last(wrong), last(kv(other))


def _decoded(lp) -> oracle.Decoded:
    t = int(lp.argmax())
    return oracle.Decoded([t], [float(lp[t])])


def _model(tmp_path, name, dummy=False):
    import torch
    from transformers import AutoModelForCausalLM

    weights.write(tmp_path / name, weights.narrow(name, layers=4))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
    if dummy:
        from vllm.model_executor.model_loader.weight_utils import (
            initialize_single_dummy_weight,
        )

        for p in model.state_dict().values():
            initialize_single_dummy_weight(p)
    return model


def _verdicts(model, prompts=6, n=200):
    """Per prompt: the intact decode's and both controls' verdicts, each judged against D's
    own prefill with the tolerance the oracle would calibrate from the intact decodes."""
    import torch

    g = torch.Generator().manual_seed(7)
    got = []
    for _ in range(prompts):
        ids = torch.randint(3, 512, (1, n), generator=g)
        other = torch.randint(3, 512, (1, n), generator=g)
        got.append([_decoded(x) for x in _answers(model, ids, other)])
    cal = oracle.calibrate({str(i): [(intact, base, None)]
                            for i, (base, intact, _, _) in enumerate(got)}, "intact")
    return [[oracle.judge(x, base, cal.tol[str(i)], None, cal.ties.get(str(i), ())).intact
             for x in (intact, wrong, other)]
            for i, (base, intact, wrong, other) in enumerate(got)]


@pytest.mark.parametrize("name", ARCHS)
def test_a_corrupted_kv_control_changes_the_answer(name, tmp_path):
    """Real torch (transformers' model of each architecture, four layers of the recipe at a
    tiny width): decoding the last token from the prompt's KV computed apart is judged intact,
    and both of the oracle's controls -- the first block's KV in every block, another prompt's
    KV -- are caught on every prompt."""
    verdicts = _verdicts(_model(tmp_path, name))
    assert verdicts == [[True, False, False]] * len(verdicts)


def test_vllms_dummy_weights_make_every_control_pass(tmp_path):
    """Why not ``--load-format dummy``: with vLLM's own initializer (U(-1e-3, 1e-3) for every
    parameter) another prompt's KV gives the same first token and logprob as the prompt's own:
    the oracle cannot catch it."""
    verdicts = _verdicts(_model(tmp_path, "llama3-8b-full", dummy=True))
    assert [v[2] for v in verdicts] == [True] * len(verdicts)


# ----------------------------------------------------------------- real vLLM engines (CPU)

@pytest.fixture(scope="module")
def cpu_pair(tmp_path_factory):
    """A P and a D of the venv's vLLM on the CPU (the rig's engines, NixlConnector, stock),
    serving the narrow Llama the recipe writes (one folder: vLLM's NIXL compatibility hash
    covers the model's path, so P and D must name the same one, as the device's engines do)."""
    from lab.rig import proxy
    from lab.rig.servers import EngineGroup, EngineSpec

    root = tmp_path_factory.mktemp("full-width-cpu")
    weights.write(root / "m", weights.narrow("llama3-8b-full", layers=4))
    group = EngineGroup([EngineSpec("P", "kv_producer", pdpatch=False, model=root / "m"),
                         EngineSpec("D", "kv_consumer", pdpatch=False, model=root / "m")],
                        root / "logs")
    try:
        group.start(progress=None)
        proxy.warm_up(group["P"], group["D"])
        yield group
    finally:
        group.stop()


@pytest.mark.e2e
def test_cpu_engines_pd_answer_from_the_kv_and_the_control_is_caught(cpu_pair):
    """Real vLLM P/D over NIXL on the CPU on the seeded checkpoint: D's decode from P's KV is
    D's own prefill's answer, token for token; with P's first block read into every block it
    is not (the oracle catches it)."""
    import random

    from lab.rig import proxy
    from lab.rig.proxy import PREFILL_KV_PARAMS

    p, d = cpu_pair["P"], cpu_pair["D"]
    rng = random.Random(3)
    results = []
    for k in range(3):
        prompt = [rng.randrange(3, 512) for _ in range(300 + 40 * k)]   # >= 2 CPU blocks
        base = proxy.complete(d, prompt, 4, body={"cache_salt": f"base-{k}"})
        pre = proxy.complete(p, prompt, 1, kv_transfer_params=dict(PREFILL_KV_PARAMS),
                             body={"cache_salt": f"pd-{k}"})
        got = proxy.complete(d, prompt, 4, kv_transfer_params=pre.kv_transfer_params,
                             body={"cache_salt": f"pd-{k}"})
        pre = proxy.complete(p, prompt, 1, kv_transfer_params=dict(PREFILL_KV_PARAMS),
                             body={"cache_salt": f"ctl-{k}"})
        kvp = gpu_pd.repeat_first_block(pre.kv_transfer_params)
        wrong = proxy.complete(d, prompt, 4, kv_transfer_params=kvp,
                               body={"cache_salt": f"ctl-{k}"})
        results.append((base, got, wrong))
    for base, got, _ in results:
        assert got.token_ids == base.token_ids
    cal = oracle.calibrate({str(i): [(oracle.Decoded(g.token_ids, g.logprobs),
                                      oracle.Decoded(b.token_ids, b.logprobs), None)]
                            for i, (b, g, _) in enumerate(results)}, "cpu")
    caught = [not oracle.judge(oracle.Decoded(w.token_ids, w.logprobs),
                               oracle.Decoded(b.token_ids, b.logprobs), cal.tol[str(i)]).intact
              for i, (b, _, w) in enumerate(results)]
    assert caught == [True] * len(results)
