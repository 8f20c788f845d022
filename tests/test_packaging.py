"""The wheel carries every way in; a fresh interpreter activates from it, from an editable
install and from PYTHONPATH=sitecustomize/ (chaining to another sitecustomize)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from venvs import DEPS, bare_venv, clean_env, site_packages

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).parent / "activation_child.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built as the README's install section says (``pip wheel --no-deps -w dist ./``)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("vllm_pdpatch-*.whl")
    return whl


def probe(python: Path, **env: str) -> tuple[dict, str]:
    out = subprocess.run([str(python), str(CHILD), "self"], capture_output=True, text=True,
                         env=clean_env(**env), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_wheel_contains_pth_entry_point_and_scripts(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        eps = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "pdpatch_autoload.pth" in names
    assert "pdpatch_bootstrap/sitecustomize.py" in names
    # the fingerprints of the verified releases: what a newer vLLM's code is compared with
    assert "pdpatch/verified_sites.json" in names
    assert "[vllm.general_plugins]\npdpatch = pdpatch.bootstrap.plugin:load" in eps
    assert "pdpatch = pdpatch.cli:main" in eps and "pdpatch-run = pdpatch.bootstrap.run:main" in eps
    # the compiled block encoder (hatch_build.py) makes the wheel platform-specific
    assert any(n.startswith("pdpatch/hashing/_block_items.") and n.endswith((".so", ".pyd"))
               for n in names), names
    assert not wheel.name.endswith("-py3-none-any.whl"), wheel.name
    # lab code stays out (issue 16): the P/D rig, the reference planners, the GPU bench
    lab = [n for n in names if n.startswith(("pdpatch/rig/", "lab/", "rig/", "gpu_bench/"))
           or n in ("pdpatch/kv/coalesce.py", "kv_reference.py")]
    assert not lab, lab
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"pdpatch", "pdpatch_bootstrap", "pdpatch_autoload.pth"}, tops


@pytest.mark.parametrize("required", [False, True], ids=["optional", "required"])
def test_wheel_without_a_c_compiler(tmp_path, required):
    """No compiler on PATH: a pure-Python wheel and a warning that says what is lost, or,
    under PDPATCH_REQUIRE_C_ENCODER=1 (what the test setup uses), a failed build."""
    env = {k: v for k, v in os.environ.items() if k != "PDPATCH_REQUIRE_C_ENCODER"}
    env["PATH"] = str(Path(sys.executable).parent)           # python, no gcc / cc
    if required:
        env["PDPATCH_REQUIRE_C_ENCODER"] = "1"
    out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path),
                          str(ROOT)], env=env, capture_output=True, text=True, timeout=600)
    said = out.stdout + out.stderr
    assert "could not compile pdpatch/hashing/_block_items.c" in said, said[-3000:]
    if required:
        assert out.returncode != 0 and not list(tmp_path.glob("*.whl"))
        return
    assert out.returncode == 0, said[-3000:]
    assert "pure-Python encoders (about 2x slower)" in said
    (whl,) = tmp_path.glob("vllm_pdpatch-*.whl")
    assert whl.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(whl) as z:
        assert not [n for n in z.namelist() if "_block_items" in n]


def test_installed_wheel_activates_in_a_fresh_interpreter(wheel, tmp_path):
    venv = bare_venv(tmp_path / "v")
    site = site_packages(venv)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, timeout=300)
    assert (site / "pdpatch_autoload.pth").is_file()
    assert (site / "bin" / "pdpatch").is_file() and (site / "bin" / "pdpatch-run").is_file()
    result, err = probe(venv / "bin" / "python", ENABLE_PDPATCH="1")
    assert result["wrapped"] and f"pid={result['pid']} role=main" in err
    off, _ = probe(venv / "bin" / "python")
    assert not off["wrapped"]
    code = "import pdpatch.hashing.encoders as e; print(e.C_ENCODER, e.__file__)"
    encoder = subprocess.run([str(venv / "bin" / "python"), "-c", code],
                             capture_output=True, text=True, env=clean_env(), timeout=120)
    assert encoder.stdout.split() == ["True", str(site / "pdpatch/hashing/encoders.py")], \
        encoder.stdout + encoder.stderr
    # the distribution is vllm-pdpatch, its plugin registered, and the command says so
    code = ("import importlib.metadata as md; d = md.distribution('vllm-pdpatch'); "
            "print(d.version, [e.value for e in d.entry_points if e.group == "
            "'vllm.general_plugins'])")
    meta = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                          text=True, env=clean_env(), timeout=120)
    assert meta.stdout.split(None, 1) == ["0.1.0", "['pdpatch.bootstrap.plugin:load']\n"], \
        meta.stdout + meta.stderr
    assert pdpatch(venv, "--version").stdout == "pdpatch vllm-pdpatch 0.1.0\n"
    assert pdpatch(venv, "doctor", "--no-import").returncode == 0


def pdpatch(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pdpatch", *args],
                          capture_output=True, text=True, env=clean_env(**env), timeout=300)


def test_a_foreign_pdpatch_next_to_the_wheel_is_named(wheel, tmp_path):
    """The public index's pdpatch (pandas) installed over ours: its dist-info next to ours and
    its __init__.py in our package.  Doctor fails naming both; the summary line warns."""
    venv = bare_venv(tmp_path / "v")
    site = site_packages(venv)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, timeout=300)
    foreign = site / "pdpatch-0.1.9.dist-info"
    foreign.mkdir()
    (foreign / "METADATA").write_text("Metadata-Version: 2.1\nName: pdpatch\nVersion: 0.1.9\n")
    with (site / "pdpatch" / "__init__.py").open("a") as fh:
        fh.write("\n# written by another package\n")
    out = pdpatch(venv, "doctor", "--no-import")
    assert out.returncode == 1, out.stdout
    assert "PROBLEM: foreign pdpatch: the unrelated 'pdpatch' 0.1.9" in out.stdout
    assert "PROBLEM: foreign pdpatch: pdpatch/__init__.py was overwritten" in out.stdout
    _, err = probe(venv / "bin" / "python", ENABLE_PDPATCH="1")
    [line] = [ln for ln in err.splitlines() if " ready=[" in ln]
    assert "WARNING" in line and " foreign_pdpatch=[the unrelated 'pdpatch' 0.1.9" in line, line


def test_editable_install_of_this_checkout_has_the_pth():
    site = Path(DEPS)
    direct = json.loads(next(site.glob("vllm_pdpatch-*.dist-info/direct_url.json")).read_text())
    assert direct.get("dir_info", {}).get("editable") is True
    assert (site / "pdpatch_autoload.pth").is_file()   # activation itself: test_activation.py


def test_pythonpath_sitecustomize_activates_and_chains(tmp_path):
    venv = bare_venv(tmp_path / "v")
    other = tmp_path / "other"
    other.mkdir()
    marker = tmp_path / "chained"
    lib = tmp_path / "lib"           # what the chained one adds to the path (kvcached's way)
    lib.mkdir()
    (lib / "chained_mod.py").write_text("")
    (other / "sitecustomize.py").write_text(
        f"import site\nopen({str(marker)!r}, 'w').write('ran')\nsite.addsitedir({str(lib)!r})\n")
    path = os.pathsep.join([str(ROOT / "sitecustomize"), str(other)])
    result, err = probe(venv / "bin" / "python", ENABLE_PDPATCH="1", PYTHONPATH=path)
    assert result["wrapped"] and "[pdpatch] pdpatch: pid=" in err
    assert marker.read_text() == "ran"
    kept = subprocess.run([str(venv / "bin" / "python"), "-c", "import chained_mod"],
                          env=clean_env(ENABLE_PDPATCH="1", PYTHONPATH=path),
                          capture_output=True, text=True, timeout=300)
    assert kept.returncode == 0, kept.stderr[-2000:]


def test_pdpatch_run_sets_up_sitecustomize(tmp_path):
    venv = bare_venv(tmp_path / "v")
    runner = Path(sys.executable).parent / "pdpatch-run"
    out = subprocess.run([str(runner), str(venv / "bin" / "python"), str(CHILD), "self"],
                         env=clean_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["wrapped"]
