"""``pdpatch hash`` / ``pdpatch fingerprint``: called as functions and as ``python -m``."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys

import pytest

from pdpatch.hashing import commands

T = [1, 23, 24, 255, 256, 65535, 65536, 128000, 151643, 0, 7, 42, 1000, 2000, 30000, 100000,
     *range(500, 516), 9, 8, 7, 6, 5, 4, 3, 2]
# research note §4.2, captured from real vLLM 0.31-0.33
XXHASH_CBOR_PLAIN = ["4413a453ad91f5eeb206be2d1281ef95", "1c922b5671ca6702777cabfea8a70b99"]
SHA256_LORA_SALT = ["5d7a4fa3013ec3677a8b8221b7b30d6dd977811966ab52fa18bd60b6558a125f",
                    "71d73d7cb398bbc2efe824db5fd773ac9e538513ad30124cc986f3d40ae0773d"]


def run(argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="pdpatch")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    old_in, old_out, old_err = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), out, err
    try:
        rc = args.func(args)
    finally:
        sys.stdin, sys.stdout, sys.stderr = old_in, old_out, old_err
    return rc, out.getvalue(), err.getvalue()


def test_hash_tokens_from_args() -> None:
    rc, out, _ = run(["hash", *map(str, T), "--algo", "xxhash_cbor", "--seed", "0",
                      "--vllm-version", "0.33.0"])
    assert rc == 0 and out.split() == XXHASH_CBOR_PLAIN


def test_hash_stdin_commas_and_extras() -> None:
    rc, out, _ = run(["hash", "--algo", "sha256", "--seed", "0", "--lora-name", "my-lora",
                      "--lora-path", "/adapters/my-lora", "--cache-salt", "tenant-a",
                      "--vllm-version", "0.33"], stdin=",".join(map(str, T)))
    assert rc == 0 and out.split() == SHA256_LORA_SALT


def test_hash_json_document_and_event_ints(tmp_path) -> None:
    doc = {"prompt_token_ids": T, "lora": {"name": "my-lora", "path": "/adapters/my-lora"},
           "cache_salt": "tenant-a"}
    path = tmp_path / "req.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run(["hash", "--input", str(path), "--seed", "0", "--format", "event-int",
                      "--vllm-version", "0.33.0"])
    assert rc == 0
    assert [int(x) for x in out.split()] == [int(h[-16:], 16) for h in SHA256_LORA_SALT]


def test_hash_json_output_mm_and_coarse() -> None:
    rc, out, _ = run(["hash", "--seed", "0", "--algo", "sha256_cbor", "--mm",
                      "mmhash-abc123:5:20", "--format", "json", "--block-size", "8",
                      "--coarse", "2"], stdin=json.dumps(T))
    assert rc == 0
    doc = json.loads(out)
    assert doc["num_tokens"] == 40 and len(doc["keys"]) == 2
    assert doc["fingerprint"]["hbs"] == 8 and doc["fingerprint"]["algo"] == "sha256_cbor"
    assert doc["event_ints"] == [int(k[-16:], 16) for k in doc["keys"]]


def test_seed_defaults_to_this_process_environment(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    rc, out, _ = run(["hash", *map(str, T), "--algo", "xxhash_cbor"])
    assert rc == 0 and out.split() == XXHASH_CBOR_PLAIN
    monkeypatch.delenv("PYTHONHASHSEED")
    rc, _, err = run(["hash", *map(str, T), "--algo", "xxhash_cbor"])
    assert rc == 2 and "PYTHONHASHSEED identically on P and D" in err


def test_errors_are_one_line_and_status_2() -> None:
    for argv, stdin, needle in [
        (["hash", "1", "x"], "", "not a token id"),
        (["hash", "--mm", "bad"], "1 2", "IDENTIFIER:OFFSET:LENGTH"),
        (["hash", "--vllm-version", "0.9.2", "1"], "", "integers"),
        (["hash", "--algo", "xxhash", "--vllm-version", "0.12.0", "--seed", "0", "1"], "",
         "has no 'xxhash'"),
        (["hash", "--input", "/nonexistent/tokens"], "", "No such file"),
        (["fingerprint", "--algo", "xxhash", "--seed-unset"], "", "not reproducible"),
    ]:
        rc, _, err = run(argv, stdin)
        assert rc == 2 and needle in err and "Traceback" not in err, (argv, err)


def test_fingerprint_text_and_json() -> None:
    rc, out, _ = run(["fingerprint", "--algo", "sha256", "--seed-unset",
                      "--vllm-version", "0.33.0"])
    assert rc == 0
    assert "default" in out and \
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198" in out
    rc, out, _ = run(["fingerprint", "--algo", "xxhash_cbor", "--seed", "0", "--json",
                      "--block-size", "64"])
    doc = json.loads(out)
    assert doc["none_hash"] == "1ebe36576dcb573f26b99533a20aaeca" and doc["hbs"] == 64
    assert doc["seed"] == "PYTHONHASHSEED" and doc["pp"] is None


@pytest.mark.parametrize("mode", ["module", "main"])
def test_python_dash_m(mode: str) -> None:
    argv = ["hash", "--algo", "xxhash_cbor", "--seed", "0", *map(str, T)]
    if mode == "main":
        assert commands.main(["fingerprint", "--seed", "0", "--json"]) == 0
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.run([sys.executable, "-m", "pdpatch.hashing.commands", *argv],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == XXHASH_CBOR_PLAIN
