"""``pdpatch hash`` / ``pdpatch fingerprint``: called as functions and as ``python -m``; every
malformed configuration or input is one line and exit status 2 (a hypothesis fuzz feeds
arbitrary JSON to prove no traceback is left)."""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpatch.hashing import KeyConfig, LoraSpec, MMItem, PromptEmbeds, block_keys, commands

T = [1, 23, 24, 255, 256, 65535, 65536, 128000, 151643, 0, 7, 42, 1000, 2000, 30000, 100000,
     *range(500, 516), 9, 8, 7, 6, 5, 4, 3, 2]
# research note §4.2, captured from real vLLM 0.31-0.33
XXHASH_CBOR_PLAIN = ["4413a453ad91f5eeb206be2d1281ef95", "1c922b5671ca6702777cabfea8a70b99"]
SHA256_LORA_SALT = ["5d7a4fa3013ec3677a8b8221b7b30d6dd977811966ab52fa18bd60b6558a125f",
                    "71d73d7cb398bbc2efe824db5fd773ac9e538513ad30124cc986f3d40ae0773d"]
SERVER = ["--vllm-version", "0.33.0", "--algo", "sha256", "--block-size", "16", "--seed", "0"]
CONFIG = KeyConfig(vllm_version="0.33.0", algo="sha256", hash_block_size=16,
                   pythonhashseed="0")


def run(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    """The command in this process, stdin/stdout/stderr captured; SystemExit (argparse) is
    returned as its status."""
    parser = argparse.ArgumentParser(prog="pdpatch")
    commands.register(parser.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    old_in, old_out, old_err = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), out, err
    try:
        args = parser.parse_args(argv)
        rc = args.func(args)
    except SystemExit as e:
        rc = e.code
    finally:
        sys.stdin, sys.stdout, sys.stderr = old_in, old_out, old_err
    return rc, out.getvalue(), err.getvalue()


def assert_clean_error(rc: int, err: str, needle: str = "") -> None:
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("pdpatch "), err
    assert needle in err and "Traceback" not in err, (needle, err)


def test_hash_tokens_from_args() -> None:
    rc, out, _ = run(["hash", *map(str, T), "--algo", "xxhash_cbor", "--seed", "0",
                      "--vllm-version", "0.33.0", "--block-size", "16"])
    assert rc == 0 and out.split() == XXHASH_CBOR_PLAIN


def test_hash_stdin_commas_and_extras() -> None:
    rc, out, _ = run(["hash", *SERVER, "--lora-name", "my-lora", "--lora-path",
                      "/adapters/my-lora", "--cache-salt", "tenant-a"],
                     stdin=",".join(map(str, T)))
    assert rc == 0 and out.split() == SHA256_LORA_SALT


def test_hash_json_document_and_event_ints(tmp_path) -> None:
    doc = {"prompt_token_ids": T, "lora": {"name": "my-lora", "path": "/adapters/my-lora"},
           "cache_salt": "tenant-a"}
    path = tmp_path / "req.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run(["hash", "--input", str(path), *SERVER, "--format", "event-int"])
    assert rc == 0
    assert [int(x) for x in out.split()] == [int(h[-16:], 16) for h in SHA256_LORA_SALT]


def test_hash_json_output_mm_and_coarse() -> None:
    rc, out, _ = run(["hash", *SERVER, "--algo", "sha256_cbor", "--mm", "mmhash-abc123:5:20",
                      "--format", "json", "--block-size", "8", "--coarse", "2"],
                     stdin=json.dumps(T))
    assert rc == 0
    doc = json.loads(out)
    assert doc["num_tokens"] == 40 and len(doc["keys"]) == 2
    assert doc["fingerprint"]["hbs"] == 8 and doc["fingerprint"]["algo"] == "sha256_cbor"
    assert doc["config"] == {"vllm_version": "0.33.0", "algo": "sha256_cbor",
                             "hash_block_size": 8, "pythonhashseed": "0", "lookahead": 0}
    assert doc["event_ints"] == [int(k[-16:], 16) for k in doc["keys"]]
    fine = block_keys(T, KeyConfig(**doc["config"]), mm=[MMItem("mmhash-abc123", 5, 20)])
    assert doc["keys"] == [k.hex() for k in fine[1::2]]


def test_the_library_and_the_cli_agree_input_for_input() -> None:
    """Same configuration object, same seed semantics, same inputs: same keys."""
    lora = LoraSpec("my-lora", "/adapters/my-lora")
    mm = [MMItem("img-1", 2, 10), MMItem("img-2", 12, 4)]
    doc = {"prompt_token_ids": T, "lora": {"name": "my-lora", "path": "/adapters/my-lora"},
           "cache_salt": "s", "mm": [{"identifier": "img-1", "offset": 2, "length": 10},
                                     {"identifier": "img-2", "offset": 12, "length": 4}]}
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        config = KeyConfig(vllm_version="0.33.0", algo=algo, hash_block_size=16,
                           pythonhashseed="0")
        rc, out, _ = run(["hash", "--config", json.dumps(config.to_mapping())],
                         stdin=json.dumps(doc))
        assert rc == 0
        assert out.split() == [k.hex() for k in block_keys(T, config, lora=lora, mm=mm,
                                                           cache_salt="s")]


def test_seed_is_stated_and_read_the_same_way(monkeypatch) -> None:
    """No seed is assumed: the shell's PYTHONHASHSEED is read only when asked
    (--seed-from-env), which is KeyConfig(pythonhashseed=seed_from_environ())."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    base = ["hash", *map(str, T), "--algo", "xxhash_cbor", "--vllm-version", "0.33.0",
            "--block-size", "16"]
    rc, _, err = run(base)
    assert_clean_error(rc, err, "no --seed/--seed-unset/--seed-from-env")
    rc, out, _ = run([*base, "--seed-from-env"])
    assert rc == 0 and out.split() == XXHASH_CBOR_PLAIN
    monkeypatch.delenv("PYTHONHASHSEED")
    rc, _, err = run([*base, "--seed-from-env"])
    assert_clean_error(rc, err, "PYTHONHASHSEED identically on P and D")
    rc, out, _ = run(["hash", *map(str, T), "--algo", "sha256", "--vllm-version", "0.33.0",
                      "--block-size", "16", "--seed-unset"])
    unset = KeyConfig(vllm_version="0.33.0", algo="sha256", hash_block_size=16,
                      pythonhashseed=None)
    assert rc == 0 and out.split() == [k.hex() for k in block_keys(T, unset)]


@pytest.mark.parametrize(("missing", "hint"), [
    ("--vllm-version", "`vllm --version`"), ("--algo", "vLLM's default: sha256"),
    ("--block-size", "16 on most CUDA backends"), ("--seed", "unset (vLLM's default)")])
def test_every_setting_is_required(missing, hint) -> None:
    """The error names the flag and where to read its value (and vLLM's default)."""
    i = SERVER.index(missing)
    rc, _, err = run(["hash", *SERVER[:i], *SERVER[i + 2:], "1"])
    assert_clean_error(rc, err, f"no {missing}")
    assert hint in err


def test_installed_release(monkeypatch) -> None:
    from packaging.version import Version

    from pdpatch import versions

    monkeypatch.setattr(versions, "vllm_version", lambda: Version("0.30.0"))
    rc, out, _ = run(["fingerprint", "--vllm-version", "installed", "--algo", "sha256",
                      "--block-size", "16", "--seed", "0", "--json"])
    assert rc == 0 and json.loads(out)["vllm"] == "0.30.0"


def test_prompt_embeds_input(tmp_path) -> None:
    rows, hidden = 40, 3
    raw = bytes((i * 7) % 256 for i in range(rows * hidden * 2))
    expected = [k.hex() for k in block_keys([0] * rows, CONFIG,
                                            prompt_embeds=PromptEmbeds(raw, hidden * 2))]
    doc = {"prompt_embeds": {"base64": base64.b64encode(raw).decode(), "hidden_size": hidden,
                             "dtype": "bfloat16"}}
    rc, out, _ = run(["hash", *SERVER], stdin=json.dumps(doc))
    assert rc == 0 and out.split() == expected and len(expected) == 2
    path = tmp_path / "embeds.bin"
    path.write_bytes(raw)
    rc, out, _ = run(["hash", *SERVER, "--prompt-embeds", str(path), "--hidden-size",
                      str(hidden), "--embeds-dtype", "float16"])
    assert rc == 0 and out.split() == expected
    rc, _, err = run(["hash", *SERVER, "--prompt-embeds", str(path), "--hidden-size", "7",
                      "--embeds-dtype", "float16"])
    assert_clean_error(rc, err, "whole number")


def test_config_json_and_file(tmp_path) -> None:
    rc, out, _ = run(["fingerprint", *SERVER, "--json"])
    printed = json.loads(out)["config"]
    path = tmp_path / "server.json"
    path.write_text(json.dumps(printed))
    rc1, out1, _ = run(["hash", "--config", f"@{path}", *map(str, T)])
    rc2, out2, _ = run(["hash", *SERVER, *map(str, T)])
    assert rc1 == rc2 == 0 and out1 == out2
    rc, out, _ = run(["hash", "--config", f"@{path}", "--block-size", "8", *map(str, T)])
    assert rc == 0 and len(out.split()) == 5                   # a flag wins over --config


@pytest.mark.parametrize(("argv", "stdin", "needle"), [
    # the tracebacks
    ([], '{"prompt_token_ids": [1], "lora": {"name": "a", "id": "abc"}}', "lora.id"),
    ([], '{"prompt_token_ids": [1, 2], "mm": [{"identifier": "a", "offset": 0}]}', "length"),
    ([], '{"prompt_token_ids": [1], "mm": "img"}', "mm must be a list"),
    ([], "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    # inputs no server produces
    ([], "[1, -2, 3]", "-2"),
    (["1", "-2"], "", "not a token id"),
    ([], '{"prompt_token_ids": [0, 1, 2, 3], "mm": [{"identifier": "a", "offset": -1, '
         '"length": 2}]}', "offset"),
    ([], '{"prompt_token_ids": [0, 1, 2, 3], "mm": [{"identifier": "a", "offset": 0, '
         '"length": 3}, {"identifier": "b", "offset": 2, "length": 1}]}', "overlap"),
    ([], '{"prompt_token_ids": [0, 1, 2, 3], "mm": [{"identifier": "a", "offset": 2, '
         '"length": 1}, {"identifier": "b", "offset": 0, "length": 1}]}', "prompt order"),
    ([], '{"prompt_token_ids": [0, 1, 2, 3], "mm": [{"identifier": "a", "offset": 2, '
         '"length": 3}]}', "past the prompt"),
    ([], '{"prompt_token_ids": [1], "cache_salt": 5}', "cache_salt"),
    (["--coarse", "0", "1"], "", "coarse factor"),
    (["--lora-name", "a", "1"], "", "hashes the LoRA adapter's path"),
    ([], '{"prompt_token_ids": [1], "lora": {"name": "a", "path": ""}}', "path"),
    # shapes and sizes
    ([], '{"prompt_token_ids": [1], "cache-salt": "x"}', "unknown field"),
    ([], '{"prompt_token_ids": "1 2"}', "prompt_token_ids"),
    ([], "[1.5]", "float"),
    ([], "[true]", "bool"),
    ([], "[1e999]", "float"),
    ([], "[" + "9" * 5000 + "]", "not valid JSON"),
    ([], "{", "not valid JSON"),
    ([], "", "no token ids"),
    ([], "[]", "no token ids"),
    ([], '{"prompt_token_ids": [1], "mm": [{"identifier": "\\ud800", "offset": 0, '
         '"length": 1}]}', "surrogate"),
    ([], '{"prompt_embeds": {"base64": "!!", "hidden_size": 2, "dtype": "float16"}}',
     "base64"),
    ([], '{"prompt_embeds": {"base64": "AAAA", "hidden_size": 2, "dtype": "int8"}}', "dtype"),
    (["--mm", "bad", "1"], "", "IDENTIFIER:OFFSET:LENGTH"),
    (["--lora-path", "/a", "1"], "", "--lora-name"),
    (["--hidden-size", "4", "1"], "", "--prompt-embeds"),
    (["--input", "/nonexistent/tokens"], "", "No such file"),
    (["--input", "/"], "", "directory"),
    (["--vllm-version", "0.9.2", "1"], "", "integers"),
    (["--algo", "xxhash", "--vllm-version", "0.12.0", "1"], "", "has no 'xxhash'"),
    (["--block-size", "0", "1"], "", "hash_block_size"),
    (["--block-size", "x", "1"], "", "invalid int"),
    (["--lookahead", "1", "--vllm-version", "0.32.0", "1"], "", "lookahead"),
    (["--seed-unset", "1"], "", "not allowed with argument --seed"),
])
def test_errors_are_one_line_and_status_2(argv, stdin, needle) -> None:
    rc, _, err = run(["hash", *SERVER, *argv], stdin)
    assert_clean_error(rc, err, needle)


SEEDLESS = '{"algo": "sha256", "vllm_version": "0.33", "hash_block_size": 16'


@pytest.mark.parametrize(("config", "needle"), [
    ("[1]", "--config is not a JSON object"), ("{", "--config is not a JSON object"),
    ("@/nonexistent/server.json", "No such file"),
    (SEEDLESS + "}", "no --seed/--seed-unset/--seed-from-env"),
    (SEEDLESS + ', "pythonhashseed": 0}', "string"),
    (SEEDLESS + ', "pythonhashseed": null, "block_size": 16}', "unknown"),
    (SEEDLESS + ', "pythonhashseed": null, "lookahead": true}', "lookahead"),
])
def test_config_errors(config, needle) -> None:
    rc, _, err = run(["hash", "--config", config, "1"])
    assert_clean_error(rc, err, needle)


def test_fingerprint_errors_and_oversized_input() -> None:
    rc, _, err = run(["fingerprint", "--vllm-version", "0.33.0", "--algo", "xxhash",
                      "--block-size", "16", "--seed-unset"])
    assert_clean_error(rc, err, "not reproducible")
    rc, _, err = run(["hash", *SERVER], stdin=" " * (64 << 20) + "1")
    assert_clean_error(rc, err, "larger than 64 MiB")


def test_fingerprint_text_and_json() -> None:
    rc, out, _ = run(["fingerprint", "--algo", "sha256", "--seed-unset",
                      "--vllm-version", "0.33.0", "--block-size", "16"])
    assert rc == 0
    assert "default" in out and \
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198" in out
    rc, out, _ = run(["fingerprint", "--algo", "xxhash_cbor", "--seed", "0", "--json",
                      "--block-size", "64", "--vllm-version", "0.33.0"])
    doc = json.loads(out)
    assert doc["none_hash"] == "1ebe36576dcb573f26b99533a20aaeca" and doc["hbs"] == 64
    assert doc["seed"] == "PYTHONHASHSEED" and doc["pp"] is None


def test_help_is_a_reference() -> None:
    """What each input means and which values are vLLM's defaults, in `pdpatch hash --help`."""
    rc, out, _ = run(["hash", "--help"])
    text = " ".join(out.split())
    assert rc == 0
    for needle in ("vLLM's default is sha256", "16 on most CUDA backends",
                   "PYTHONHASHSEED of the server's EngineCore", "not set, vLLM's default",
                   "prompt_token_ids", "multi_modal_uuids", "lora_int_id",
                   "--lora-modules NAME=PATH", "model's --dtype on 0.21+", "string identity",
                   "never pass one cached or interned string object", "exit status 2"):
        assert needle in text, needle


# ---------------------------------------------------------------------------- fuzz

json_scalar = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.floats(allow_nan=True) | st.text(max_size=12))
json_value = st.recursive(
    json_scalar,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=20)
fields = st.sampled_from(["prompt_token_ids", "prompt_embeds", "lora", "cache_salt", "mm"])
near_valid = st.one_of(
    st.dictionaries(fields, json_value, max_size=5),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(-3, 2**65), max_size=40)},
                          optional={"lora": st.dictionaries(
                              st.sampled_from(["name", "path", "id", "x"]), json_scalar),
                              "mm": st.lists(st.dictionaries(
                                  st.sampled_from(["identifier", "offset", "length"]),
                                  json_scalar | st.integers(-2, 50)), max_size=3),
                              "cache_salt": json_scalar,
                              "prompt_embeds": st.dictionaries(
                                  st.sampled_from(["base64", "hidden_size", "dtype"]),
                                  json_scalar | st.sampled_from(["AAAA", "float16", 2]))}),
)
server = st.sampled_from([
    SERVER, ["--vllm-version", "0.30.0", "--algo", "xxhash", "--block-size", "3", "--seed", ""],
    ["--vllm-version", "0.11.0", "--algo", "sha256_cbor", "--block-size", "1", "--seed", "7"],
])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(server=server, doc=st.one_of(json_value, near_valid), as_text=st.booleans())
def test_fuzz_arbitrary_json_never_raises_a_traceback(server, doc, as_text) -> None:
    """Arbitrary JSON on stdin: keys (0) or one clean error line (2); anything else --
    an exception escaping, a multi-line message -- fails."""
    text = json.dumps(doc) if as_text else json.dumps(doc, indent=1)
    rc, out, err = run(["hash", *server], text)
    if rc == 0:
        assert err == "" and all(len(k) in (32, 64) for k in out.split())
    else:
        assert_clean_error(rc, err)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_fuzz_arbitrary_text_and_arguments(text) -> None:
    rc, _, err = run(["hash", *SERVER], text)
    assert rc == 0 or (assert_clean_error(rc, err) is None)
    rc, _, err = run(["hash", *SERVER, "--", *text.split()])
    assert rc == 0 or (assert_clean_error(rc, err) is None)


# ---------------------------------------------------------------------------- processes


@pytest.mark.parametrize("mode", ["module", "main"])
def test_python_dash_m(mode: str) -> None:
    argv = ["hash", "--algo", "xxhash_cbor", "--seed", "0", "--vllm-version", "0.33.0",
            "--block-size", "16", *map(str, T)]
    if mode == "main":
        assert commands.main(["fingerprint", *SERVER, "--json"]) == 0
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.run([sys.executable, "-m", "pdpatch.hashing.commands", *argv],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == XXHASH_CBOR_PLAIN


@pytest.mark.parametrize("stdin", [b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe[1]",
                                   b'{"prompt_token_ids": [1], "lora": {"id": "abc"}}'])
def test_a_real_process_exits_2_with_one_line(stdin: bytes) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdpatch.hashing.commands", "hash", *SERVER],
                          input=stdin, capture_output=True)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
