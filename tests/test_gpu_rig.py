"""The GPU P/D rig's setup that CI can check without a GPU (lab/gpu/pd.py, lab/gpu/engines.py,
lab/rig/model.py): the ``--geometry`` configs carry the real models' KV geometry, the MLA model's
seeded weights are exactly what vLLM's DeepseekV2 model loads, TP scenarios are placed on the
two GPUs (and refused on one), and the engines' command lines and start order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_meta_load

from lab.gpu import engines, unpack
from lab.gpu import pd as gpu_pd
from lab.rig.model import tiny_config


def _cfg(geometry: str) -> dict:
    return {**tiny_config(), **gpu_pd.GEOMETRIES[geometry]}


@pytest.mark.parametrize(("geometry", "layers", "kv_heads", "kib_per_token"), [
    ("llama3-8b", 32, 8, 128),
    ("qwen2.5-7b", 28, 4, 56),
    ("llama3-70b", 80, 8, 320),
    ("llama3-70b-tp2", 80, 4, 160),
])
def test_llama_geometries_carry_the_real_models_kv_cache(geometry, layers, kv_heads,
                                                          kib_per_token):
    """K and V of ``kv_heads`` heads of 128 per layer, in bf16; query heads divide into KV
    heads (and both by 2 for 70B at TP 2); the tiny hidden size and vocabulary stay."""
    cfg = _cfg(geometry)
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (layers, kv_heads, 128)
    assert 2 * layers * kv_heads * 128 * 2 == kib_per_token << 10
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["hidden_size"] <= 512 and cfg["vocab_size"] == 512
    assert not gpu_pd.is_mla(geometry)
    from transformers import LlamaConfig

    LlamaConfig(**cfg)       # transformers' own checks, which refused Qwen's heads on hidden 256
    overrides, max_len = gpu_pd.model_config(geometry, (600, 8000))
    assert overrides["max_position_embeddings"] == max_len >= 8000 + gpu_pd.MAX_TOKENS
    big = _cfg("llama3-70b")
    assert big["num_attention_heads"] % 2 == big["num_key_value_heads"] % 2 == 0
    assert _cfg("llama3-70b-tp2")["num_key_value_heads"] == big["num_key_value_heads"] // 2


def test_deepseek_geometry_is_v2_lite_mla_with_dense_layers():
    """DeepSeek-V2-Lite's cache: one latent of 512 + 64 per token and layer (30.4 KiB a token
    over 27 layers in bf16); no layer is MoE, no q LoRA."""
    cfg = _cfg("deepseek-v2-lite")
    assert gpu_pd.is_mla("deepseek-v2-lite")
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * cfg["num_hidden_layers"] * 2 == \
        31104
    assert cfg["first_k_dense_replace"] >= cfg["num_hidden_layers"]
    assert cfg["q_lora_rank"] is None and cfg["num_attention_heads"] == 16


def test_mla_weights_are_what_vllms_deepseek_v2_loads(tmp_path):
    """The DeepSeek-V2 recipe, two layers of the ``deepseek-v2-lite`` geometry: vLLM's own
    ``DeepseekV2ForCausalLM`` (built on the meta device, in a subprocess: it sets up vLLM's
    process-wide parallel state) takes it as MLA, loads every parameter from it through its
    ``load_weights`` (whose loaders check shapes) and finds no tensor it has no place for."""
    from lab.rig.model import model_dir

    geometry = {**gpu_pd.GEOMETRIES["deepseek-v2-lite"], "num_hidden_layers": 2,
                "first_k_dense_replace": 2}
    model = model_dir(tmp_path / "mla", **geometry)
    got = vllm_meta_load.run(model, "vllm.model_executor.models.deepseek_v2",
                             "DeepseekV2ForCausalLM", cwd=tmp_path)
    assert got["mla"]
    assert sorted(got["params"]) == got["loaded"]
    for name, shape in got["shapes"].items():   # the unfused ones, as written
        if name in got["params"]:
            assert got["params"][name] == shape, name
    attn = "model.layers.1.self_attn."
    assert got["shapes"][attn + "kv_a_proj_with_mqa.weight"] == [512 + 64, 256]
    assert got["shapes"][attn + "kv_b_proj.weight"] == [16 * (128 + 128), 512]


def test_unknown_architecture_has_no_recipe(tmp_path):
    from lab.rig.model import model_dir

    with pytest.raises(ValueError, match="no weight recipe for MistralForCausalLM"):
        model_dir(tmp_path / "m", architectures=["MistralForCausalLM"])


@pytest.mark.parametrize(("name", "p_gpus", "d_gpus"), [
    ("ref", "0", "1"),
    ("kvc", "0", "1"),
    ("ref-tp12", "0", "0,1"),
    ("kvc-tp12", "0", "0,1"),
    ("fa-triton-tp12", "0", "0,1"),
    ("ref-tp21", "0,1", "1"),
    ("tp21", "0,1", "1"),
])
def test_two_gpu_placement(name, p_gpus, d_gpus):
    sc = gpu_pd.SCENARIOS[name]
    assert engines.placement(sc, two_gpus=True) == (p_gpus, d_gpus)
    if sc.p_tp == sc.d_tp == 1:
        assert engines.placement(sc, two_gpus=False) == (None, None)


def test_a_tp_scenario_without_two_gpus_stops_before_anything_runs(tmp_path, capsys):
    argv = ["--stage", str(tmp_path), "--out", str(tmp_path / "out"), "ref-tp12", "tp12"]
    with pytest.raises(SystemExit) as exc:
        gpu_pd.main(argv)
    assert exc.value.code == 2
    assert "ref-tp12: P TP 1 -> D TP 2 needs two GPUs: run with --two-gpus" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="1 or 2 only"):
        engines.placement(engines.Scenario(False, "A", "A", d_tp=4), two_gpus=True)


def test_a_kvcached_scenario_on_a_stage_without_kvcached_stops_before_anything_runs(
        tmp_path, capsys):
    """Run dj lost a device call to this: the stage was built without ``--kvcached`` and the
    run died in pip's arguments after unpacking, with a traceback instead of the fix."""
    argv = ["--stage", str(tmp_path), "--out", str(tmp_path / "out"), "kvc", "ref"]
    with pytest.raises(SystemExit) as exc:
        gpu_pd.main(argv)
    assert exc.value.code == 2
    assert ("kvc: a kvcached D needs the stage's kvcached/ folder (scripts/gpu_stage.sh "
            "--kvcached)" in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_a_run_without_reference_or_tolerances_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_pd.main(["--stage", str(tmp_path), "--out", str(tmp_path / "o"), "fa-triton"])
    assert ("name a reference scenario (ref, ref-triton, ref-load, ref-tp12, ref-tp21, "
            "ref-triton-tp12, ref-triton-tp21, ref-load-tp12, ref-load-tp21, ref-aged)"
            in capsys.readouterr().err)


class _Proc:
    def __init__(self, cmd: list[str], env: dict, **_: object) -> None:
        self.cmd, self.env = cmd, env

    def poll(self) -> None:
        return None


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Engines that record their command line and environment instead of starting, and
    report healthy at once; yields the list of (name, cmd, env) in start order."""
    started: list[tuple[str, list[str], dict]] = []

    def popen(cmd, env, **kw):
        started.append((Path(kw["stdout"].name).stem, cmd, env))
        return _Proc(cmd, env)

    monkeypatch.setattr(engines.subprocess, "Popen", popen)
    monkeypatch.setattr(engines.Engine, "healthy", lambda self: True)
    yield started


def _arg(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def _site(path: Path, release: str = "0.25.1") -> Path:
    """A site directory that says which vLLM release it holds, as an unpacked stage does."""
    (path / f"vllm-{release}.dist-info").mkdir(parents=True, exist_ok=True)
    return path


def _tar_xz(files: dict[str, bytes]) -> bytes:
    import io
    import lzma
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue())


def _stage(path: Path, release: str, cutlass: bool = False) -> Path:
    """A stage as ``lab/gpu/stage.py`` writes one: the site's archive (vLLM's package and its
    dist-info) and the two compressed kernels, here of a few bytes; with ``cutlass`` (0.34.0's)
    also the CUTLASS DSL's tree and its MLIR library, which the site's archive names."""
    import lzma

    path.mkdir(parents=True)
    site = {"vllm/__init__.py": f"# {release}\n".encode(),
            "vllm/vllm_flash_attn/__init__.py": b"",
            f"vllm-{release}.dist-info/METADATA": b"Name: vllm\n"}
    if cutlass:
        site[unpack.NEEDS] = "\n".join(
            ["site.tar.xz", *unpack.KERNELS, *unpack.OPTIONAL]).encode()
        dsl = f"{unpack.CUTLASS_DSL}/cutlass"
        (path / "cutlass.tar.xz").write_bytes(_tar_xz({
            f"{dsl}/__init__.py": b"from cutlass._mlir import _mlir_libs\n",
            f"{dsl}/_mlir/__init__.py": b"", f"{dsl}/_mlir/_mlir_libs/__init__.py": b"",
            "cuda/bindings/__init__.py": b""}))
        (path / "cutlass_ir.so.xz").write_bytes(lzma.compress(f"IR of {release}".encode()))
    (path / "site.tar.xz").write_bytes(_tar_xz(site))
    for name in unpack.KERNELS:
        (path / name).write_bytes(lzma.compress(f"{name} of {release}".encode()))
    return path


def test_a_site_holds_the_stage_carried_or_is_unpacked_again(tmp_path):
    """A warm device machine keeps ``/tmp``: run bz carried 0.33.0's stage and ran the 0.30.0
    left unpacked by the call before.  The same stage is not unpacked twice; another one
    replaces everything in the site."""
    site = tmp_path / "site"
    old, new = _stage(tmp_path / "a", "0.30.0"), _stage(tmp_path / "b", "0.33.0")
    assert unpack.ensure(old, site) is not None
    assert unpack.ensure(old, site) is None
    (site / "vllm" / "left_behind.py").write_text("")
    assert unpack.ensure(new, site) is not None
    assert unpack.site_release(site) == "0.33.0"
    assert (site / "vllm" / "__init__.py").read_text() == "# 0.33.0\n"
    assert not (site / "vllm" / "left_behind.py").exists()
    assert (site / unpack.KERNELS["fa3.so.xz"]).read_bytes() == b"fa3.so.xz of 0.33.0"


def test_a_stage_with_the_cutlass_dsl_unpacks_it_where_python_finds_it(tmp_path):
    """0.34.0's kernel warmup imports ``cutlass`` on every CUDA platform (run dn): its stage
    carries the DSL in two more archives, which the site's digest covers and without which it
    is not unpacked (a split stage whose machine went back between its calls); with the site's
    path (the DSL's packages folder too: its wheels' ``.pth`` is not read from a PYTHONPATH
    folder) Python imports it."""
    site = tmp_path / "site"
    stage = _stage(tmp_path / "s", "0.34.0", cutlass=True)
    assert unpack.archives(stage) == ["site.tar.xz", *unpack.KERNELS, *unpack.OPTIONAL]
    assert unpack.ensure(stage, site) is not None
    ir = site / unpack.OPTIONAL["cutlass_ir.so.xz"]
    assert ir.read_bytes() == b"IR of 0.34.0" and os.access(ir, os.X_OK)
    assert unpack.python_path(site) == [site, site / unpack.CUTLASS_DSL]
    assert unpack.python_path(_site(tmp_path / "old")) == [tmp_path / "old"]
    got = subprocess.run([sys.executable, "-c", "import cutlass, cuda.bindings; "
                          "print(cutlass.__file__)"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             map(str, unpack.python_path(site)))})
    assert got.returncode == 0 and unpack.CUTLASS_DSL in got.stdout, got.stderr

    assert unpack.ensure(stage, site) is None
    (stage / "cutlass_ir.so.xz").write_bytes((stage / "fa3.so.xz").read_bytes())
    assert unpack.ensure(stage, site) is not None       # the digest covers the DSL's archives
    (stage / "cutlass_ir.so.xz").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks cutlass_ir\.so\.xz"):
        unpack.ensure(stage, site)
    assert not site.exists()


def test_engines_put_the_cutlass_dsl_on_their_path_where_the_site_has_it(launched, tmp_path):
    site = tmp_path / "site"
    unpack.ensure(_stage(tmp_path / "s", "0.34.0", cutlass=True), site)
    for pair, sc in (("ref", "ref"), ("coalesce", "coalesce")):
        engines.start_pair(pair, gpu_pd.SCENARIOS[sc], engines.Paths(site, tmp_path, tmp_path))
    assert len(launched) == 4
    for _, _, env in launched:
        path = env["PYTHONPATH"].split(os.pathsep)
        assert path.index(str(site)) + 1 == path.index(str(site / unpack.CUTLASS_DSL))


def test_engines_get_tp_a_fixed_kv_cache_and_mla_backends(launched, tmp_path):
    paths = engines.Paths(_site(tmp_path), tmp_path / "model", tmp_path, tmp_path / "kvc",
                          mla=True)
    p, d, _ = engines.start_pair("fa-triton-tp12", gpu_pd.SCENARIOS["fa-triton-tp12"], paths,
                                 two_gpus=True)
    by_name = {n: (cmd, env) for n, cmd, env in launched}
    p_cmd, p_env = by_name["fa-triton-tp12-P"]
    d_cmd, d_env = by_name["fa-triton-tp12-D"]
    assert (_arg(p_cmd, "--tensor-parallel-size"), _arg(d_cmd, "--tensor-parallel-size")) == \
        ("1", "2")
    assert (p_env["CUDA_VISIBLE_DEVICES"], d_env["CUDA_VISIBLE_DEVICES"]) == ("0", "0,1")
    assert (_arg(p_cmd, "--attention-backend"), _arg(d_cmd, "--attention-backend")) == \
        ("FLASH_ATTN_MLA", "TRITON_MLA") == (p.backend, d.backend)
    for cmd, env in ((p_cmd, p_env), (d_cmd, d_env)):
        assert _arg(cmd, "--kv-cache-memory-bytes") == str(engines.KV_CACHE_BYTES)
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"


@pytest.mark.parametrize(("release", "runner_v2"), [("0.25.1", "0"), ("0.30.0", "1")])
def test_kvcached_d_sizes_its_own_pool_and_starts_first_on_a_shared_gpu(launched, tmp_path,
                                                                       release, runner_v2):
    """...on the model runner kvcached adapts for the release (V1 below 0.29, Model Runner V2
    from 0.29: it refuses V1 there); P is left to its release's default."""
    paths = engines.Paths(_site(tmp_path, release), tmp_path / "model", tmp_path,
                          tmp_path / "kvc")
    engines.start_pair("kvc", gpu_pd.SCENARIOS["kvc"], paths)
    (d_name, d_cmd, d_env), (p_name, p_cmd, p_env) = launched
    assert (d_name, p_name) == ("kvc-D", "kvc-P")
    assert "--kv-cache-memory-bytes" not in d_cmd
    assert _arg(p_cmd, "--kv-cache-memory-bytes") == str(engines.KV_CACHE_BYTES)
    assert _arg(p_cmd, "--attention-backend") == "FLASH_ATTN"
    assert d_env["VLLM_USE_V2_MODEL_RUNNER"] == runner_v2
    assert p_env.get("VLLM_USE_V2_MODEL_RUNNER") == os.environ.get("VLLM_USE_V2_MODEL_RUNNER")


@pytest.mark.parametrize(("name", "two_gpus", "d_first"), [
    ("ref", False, False),           # fixed KV caches: no profiling race on the shared GPU
    ("kvc", True, False),            # kvcached D alone on GPU 1
    ("kvc", False, True),            # kvcached D sizes its pool from GPU 0's free memory
    ("kvc-tp12", True, True),        # kvcached D at TP 2 shares GPU 0 with P
])
def test_p_starts_with_d_unless_kvcached_d_shares_its_gpu(monkeypatch, tmp_path, name, two_gpus,
                                                         d_first):
    """D turns healthy on its third health check; how many D had had when P was launched
    says whether P waited for it."""
    polls: dict[str, int] = {}
    at_p_launch: list[int] = []

    def popen(cmd, env, **kw):
        if Path(kw["stdout"].name).stem.endswith("-P"):
            at_p_launch.append(polls.get(f"{name}-D", 0))
        return _Proc(cmd, env)

    def healthy(self):
        polls[self.name] = polls.get(self.name, 0) + 1
        return polls[self.name] > 2

    monkeypatch.setattr(engines.subprocess, "Popen", popen)
    monkeypatch.setattr(engines.Engine, "healthy", healthy)
    monkeypatch.setattr(engines.time, "sleep", lambda s: None)
    paths = engines.Paths(_site(tmp_path), tmp_path / "model", tmp_path, tmp_path / "kvc")
    engines.start_pair(name, gpu_pd.SCENARIOS[name], paths, two_gpus=two_gpus)
    assert at_p_launch == ([3] if d_first else [0])


def _intact_result(name: str, sc, prompts: dict) -> dict:
    """What ``run_scenario`` returns for a scenario whose every answer matches D's own."""
    answer = {"ids": [7, 8], "lp": [-1.0, -1.0]}
    return {"scenario": name, "pdpatch": sc.pdpatch, "P": sc.p_backend, "D": sc.d_backend,
            "hashseed": "0", "note": "", "start_s": 1.0, "controls": {},
            "requests": {n: {"pd": answer, "base": answer, "p_lp0": None, "ms": 5.0}
                         for n in prompts}}


def _run_rig(monkeypatch, tmp_path: Path, *argv: str, kvcached: bool = False) -> Path:
    """``gpu_pd.main`` on this CPU machine: a stage of a few bytes to unpack (with an empty
    ``kvcached/`` where asked), no block-key encoder build, no GPU name; returns ``--out``."""
    import torch

    stage = _stage(tmp_path / "stage", "0.25.1")
    if kvcached:
        (stage / "kvcached").mkdir()
    monkeypatch.setattr(gpu_pd, "build_encoder", lambda: "skipped")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "no GPU")
    out = tmp_path / "out"
    assert gpu_pd.main(["--stage", str(stage), "--site", str(tmp_path / "site"),
                        "--out", str(out), "--work", str(tmp_path / "work"), *argv]) == 0
    return out


class _Side:
    """An engine of a pair that only records being stopped, into ``stopped``."""

    def __init__(self, name: str, stopped: list[str]) -> None:
        self.name, self._stopped = name, stopped

    def stop(self) -> None:
        self._stopped.append(self.name)


def test_a_run_stopped_by_timeout_writes_the_scenarios_it_finished(tmp_path, monkeypatch):
    """``timeout`` sends SIGTERM: the finished scenarios are judged and written with the logs
    (a device run that hit its time limit returned nothing before)."""
    import signal

    ran: list[str] = []

    def fake_run(name, sc, prompts, paths, two_gpus, started=None, repeat=0):
        ran.append(name)
        if len(ran) == 2:
            os.kill(os.getpid(), signal.SIGTERM)      # as `timeout` would, mid-scenario
        return _intact_result(name, sc, prompts)

    monkeypatch.setattr(gpu_pd, "run_scenario", fake_run)
    out = _run_rig(monkeypatch, tmp_path, "--prompt-lengths", "20,40", "ref", "coalesce",
                   "fa-triton")
    record = json.loads((out / "gpu_pd.json").read_text())
    assert ran == ["ref", "coalesce"]
    assert [r["scenario"] for r in record["results"]] == ["ref"]
    assert record["stopped"] == "stopped during coalesce"
    assert record["results"][0]["requests"]["len20"]["intact"]
    assert (out / "logs.tar.xz").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_speed_run_stopped_by_timeout_writes_the_rounds_it_finished(tmp_path, monkeypatch):
    """SIGTERM midway through ``--speed``: the paired rounds measured so far are written to
    ``gpu_speed.json``, marked stopped (two crossed speed runs cut by their limits returned
    nothing, 570 s of device time, 2026-11-29), and both pairs are stopped."""
    import signal

    from lab.rig.proxy import Completion, PDResult

    stopped: list[str] = []

    def fake_start_pair(name, sc, paths, two_gpus=False):
        return _Side(f"{name}-P", stopped), _Side(f"{name}-D", stopped), 1.0

    sent: list[int] = []

    def fake_request(p, d, prompt, max_tokens, timeout_s):
        sent.append(len(prompt))
        if len(sent) == 2 * (3 + 2) * 2 + 1:     # 3 warm-up rounds and 2 measured, 2 lengths
            os.kill(os.getpid(), signal.SIGTERM)
        done = Completion([1, 2, 3], [0.0] * 3, 0.1, 0.05, [0.05, 0.06, 0.07])
        return PDResult(done, done, 0.05 if "on" in p.name else 0.04, None)

    monkeypatch.setattr(gpu_pd, "start_pair", fake_start_pair)
    monkeypatch.setattr(gpu_pd, "streamed_pd_request", fake_request)
    out = _run_rig(monkeypatch, tmp_path, "--speed", "12", "--speed-lengths", "20,40")
    timed = json.loads((out / "gpu_speed.json").read_text())
    assert timed["rounds"] == 4 and len(timed["paired"]["ttft_on_off"]) == 4
    assert timed["stopped"] == "stopped (signal 15) after 4 paired rounds"
    assert timed["ratio_ttft_on_off"][0] == 1.25
    assert sorted(stopped) == ["speed-off-D", "speed-off-P", "speed-on-D", "speed-on-P"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_speed_alone_and_unknown_scenarios_are_parsed_on_every_python(tmp_path, capsys):
    """``--speed`` with no scenario parses (argparse of Python 3.11 refused an empty scenario
    list checked by ``choices``); an unknown scenario is still refused by name."""
    with pytest.raises(SystemExit):
        gpu_pd.main(["--stage", str(tmp_path), "--out", str(tmp_path / "o"), "--speed", "1",
                     "--speed-on-env", "FOO=1"])
    assert "--speed-on-env takes PDPATCH_NAME=VALUE settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_pd.main(["--stage", str(tmp_path), "--out", str(tmp_path / "o"), "ref", "nope"])
    assert "unknown scenario(s) nope" in capsys.readouterr().err


def test_together_starts_the_pairs_first_and_stops_those_a_stopped_run_left(tmp_path,
                                                                            monkeypatch):
    """``--together``: every pair but a kvcached D's is started before the first scenario
    runs and handed to its scenario; a run stopped midway stops the pairs it never used."""
    import signal

    stopped: list[str] = []

    def fake_start_pairs(scenarios, paths, two_gpus):
        assert paths.kv_cache_bytes == 6 << 30 and two_gpus
        return {n: (_Side(f"{n}-P", stopped), _Side(f"{n}-D", stopped), 1.0)
                for n, sc in scenarios.items() if not sc.d_kvcached}

    ran: list[tuple[str, object]] = []

    def fake_run(name, sc, prompts, paths, two_gpus, started=None, repeat=0):
        assert sc.load == 0                               # --no-load
        ran.append((name, started and started[0].name))
        if len(ran) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return _intact_result(name, sc, prompts)

    monkeypatch.setattr(gpu_pd, "start_pairs", fake_start_pairs)
    monkeypatch.setattr(gpu_pd, "install_kvcached", lambda stage, dest: dest)
    monkeypatch.setattr(gpu_pd, "run_scenario", fake_run)
    _run_rig(monkeypatch, tmp_path, "--prompt-lengths", "20,40", "--two-gpus", "--together",
             "--kv-cache-gib", "6", "--no-load", "ref-tp12", "kvc", "tp12", "ref-tp21",
             kvcached=True)
    assert ran == [("ref-tp12", "ref-tp12-P"), ("kvc", None)]
    assert sorted(stopped) == ["ref-tp21-D", "ref-tp21-P", "tp12-D", "tp12-P"]


def test_start_pairs_leaves_kvcached_pairs_to_their_turn(launched, tmp_path):
    paths = engines.Paths(tmp_path, tmp_path / "model", tmp_path, tmp_path / "kvc",
                          kv_cache_bytes=6 << 30)
    pairs = engines.start_pairs({n: gpu_pd.SCENARIOS[n] for n in ("ref-tp12", "kvc", "tp21")},
                                paths, two_gpus=True)
    assert sorted(pairs) == ["ref-tp12", "tp21"]
    assert sorted(n for n, _, _ in launched) == ["ref-tp12-D", "ref-tp12-P", "tp21-D", "tp21-P"]
    assert {_arg(cmd, "--kv-cache-memory-bytes") for _, cmd, _ in launched} == {str(6 << 30)}


def test_step_clock_reaches_stock_engines_and_the_wrapper_clock_only_pdpatch_ones():
    """A TTFT comparison sets a stock engine's steps beside a pdpatch engine's: the step clock
    goes on every engine's path, each engine recording into a directory of its own."""
    both = {"PDLAB_WRAPPER_CLOCK": "/c/w", "PDLAB_STEP_CLOCK": "/c/s"}
    stock, patched = dict(both), dict(both)
    assert engines.lab_clocks(stock, "speed-off-D", pdpatch=False) == \
        [str(engines.WRAPPER_CLOCK)]
    assert stock == {"PDLAB_STEP_CLOCK": "/c/s/speed-off-D"}
    assert engines.lab_clocks(patched, "speed-on-D", pdpatch=True) == \
        [str(engines.WRAPPER_CLOCK)]
    assert patched == {"PDLAB_WRAPPER_CLOCK": "/c/w/speed-on-D",
                       "PDLAB_STEP_CLOCK": "/c/s/speed-on-D"}
    assert engines.lab_clocks({"PDLAB_WRAPPER_CLOCK": "/c/w"}, "ref-D", pdpatch=False) == []


def test_cross_runs_the_scenarios_again_reversed_into_their_own_record(tmp_path, monkeypatch):
    """``--cross``: after the scenarios as given, the same again in the reverse order, each
    judged by its own record's reference; both records say their start order; ``--repeat``
    reaches every scenario."""
    ran: list[tuple[str, int]] = []

    def fake_run(name, sc, prompts, paths, two_gpus, started=None, repeat=0):
        ran.append((name, repeat))
        return _intact_result(name, sc, prompts)

    monkeypatch.setattr(gpu_pd, "run_scenario", fake_run)
    out = _run_rig(monkeypatch, tmp_path, "--prompt-lengths", "20,40", "--repeat", "5",
                   "--cross", "ref", "coalesce")
    assert ran == [("ref", 5), ("coalesce", 5), ("coalesce", 5), ("ref", 5)]
    first = json.loads((out / "gpu_pd.json").read_text())
    crossed = json.loads((out / "gpu_pd-crossed.json").read_text())
    assert (first["order"], first["crossed"]) == (["ref", "coalesce"], False)
    assert (crossed["order"], crossed["crossed"]) == (["coalesce", "ref"], True)
    assert [r["scenario"] for r in crossed["results"]] == ["coalesce", "ref"]
    assert crossed["results"][0]["requests"]["len40"]["intact"]
    assert "FLASH_ATTN" in crossed["tolerances"] and (out / "gpu_pd-crossed.md").is_file()


def test_speed_starts_alternate_the_order_and_write_a_file_each(tmp_path, monkeypatch):
    from lab.rig.proxy import Completion, PDResult

    starts: list[list[str]] = []

    def fake_start_pair(name, sc, paths, two_gpus=False):
        if name == "speed-off" and (not starts or len(starts[-1]) == 2):
            starts.append([])
        if name == "speed-on" and (not starts or len(starts[-1]) == 2):
            starts.append([])
        starts[-1].append(name)
        return _Side(f"{name}-P", []), _Side(f"{name}-D", []), 1.0

    def fake_request(p, d, prompt, max_tokens, timeout_s):
        done = Completion([1, 2, 3], [0.0] * 3, 0.1, 0.05, [0.05, 0.06, 0.07])
        return PDResult(done, done, 0.05 if "on" in p.name else 0.04, None)

    monkeypatch.setattr(gpu_pd, "start_pair", fake_start_pair)
    monkeypatch.setattr(gpu_pd, "streamed_pd_request", fake_request)
    out = _run_rig(monkeypatch, tmp_path, "--speed", "2", "--speed-warmup", "1",
                   "--speed-starts", "3", "--speed-lengths", "20,40")
    assert starts == [["speed-off", "speed-on"], ["speed-on", "speed-off"],
                      ["speed-off", "speed-on"]]
    got = [json.loads((out / f"gpu_speed-{k}.json").read_text()) for k in (1, 2, 3)]
    assert [g["started_first"] for g in got] == ["off", "on", "off"]
    assert all(g["warmup"] == 1 and len(g["rounds_detail"]) == 4 for g in got)
    assert not (out / "gpu_speed.json").exists()
