"""Throwaway venvs that see the test venv's packages but run none of its .pth files."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

DEPS = sysconfig.get_paths()["purelib"]     # the test venv: wrapt, vllm, torch ...


def bare_venv(path: Path, *extra_paths: Path) -> Path:
    """A venv without pdpatch whose first .pth puts the test venv's packages (and
    ``extra_paths``) on sys.path: path lines only, so no other .pth runs."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = site_packages(path)
    (site / "000-deps.pth").write_text("\n".join([DEPS, *map(str, extra_paths)]) + "\n")
    return path


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python*/site-packages"))


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without any pdpatch setting or PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PDPATCH_") and k not in ("ENABLE_PDPATCH", "PYTHONPATH")}
    return {**env, "VLLM_TARGET_DEVICE": "cpu", **extra}
