"""``pdpatch-run <command>``: run a command with pdpatch activated through ``sitecustomize``.

Like ``ddtrace-run``: it prepends pdpatch's bootstrap directory to ``PYTHONPATH`` (every child
Python inherits it, spawned vLLM workers included), sets ``ENABLE_PDPATCH=true`` unless the
caller set it, and replaces itself with the command.  Useful where ``.pth`` files do not run
(``python -S``, a pdpatch checkout that is not installed).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

USAGE = "usage: pdpatch-run <command> [args...]   (e.g. pdpatch-run vllm serve MODEL ...)"


def bootstrap_dir() -> Path:
    """The directory holding pdpatch's ``sitecustomize.py``: ``pdpatch_bootstrap/`` next to
    the installed package (wheel and editable installs), or ``sitecustomize/`` in a checkout."""
    root = Path(__file__).resolve().parents[2]
    for candidate in (root / "pdpatch_bootstrap", root / "sitecustomize"):
        if (candidate / "sitecustomize.py").is_file():
            return candidate
    import sysconfig

    installed = Path(sysconfig.get_paths()["purelib"]) / "pdpatch_bootstrap"
    if (installed / "sitecustomize.py").is_file():
        return installed
    raise FileNotFoundError("pdpatch's sitecustomize.py is missing from this installation")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    env = os.environ
    paths = [str(bootstrap_dir())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("ENABLE_PDPATCH", "true")
    exe = shutil.which(argv[0])
    if exe is None:
        print(f"pdpatch-run: command not found: {argv[0]}", file=sys.stderr)
        return 127
    os.execv(exe, argv)
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    raise SystemExit(main())
