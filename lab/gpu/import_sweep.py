"""Import every module under some packages and say which imports fail, and for want of what.

A stage is built on the CPU machine for a device with other packages (no registry there), so
a module vLLM imports only on the GPU path, or only once serving, shows its absence one engine
start at a time.  One sweep in the first device call names every missing distribution at once:
``python3 -m lab.gpu.import_sweep vllm.entrypoints.openai vllm.model_executor.model_loader``
with the unpacked stage on ``PYTHONPATH``.  Many of vLLM's modules import optional packages
(other hardware, other quantizations), so the report is what to look at, not a verdict.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
from collections import defaultdict
from typing import Any


def sweep(packages: list[str]) -> dict[str, dict[str, list[str]]]:
    """``{"missing": {module name: [importers]}, "failed": {module: [error]}}`` for every
    module under ``packages``; a package that cannot itself be imported counts as failed."""
    missing: dict[str, list[str]] = defaultdict(list)
    failed: dict[str, list[str]] = {}
    names: list[str] = []
    for pkg in packages:
        mod = _imported(pkg, missing, failed)
        if mod is not None and hasattr(mod, "__path__"):
            names += [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".",
                                                            onerror=lambda _n: None)]
    for name in names:
        _imported(name, missing, failed)
    return {"missing": dict(missing), "failed": failed}


def _imported(name: str, missing: dict[str, list[str]],
              failed: dict[str, list[str]]) -> Any:
    """The module, or None with why it could not be imported recorded."""
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as exc:  # a module may even call sys.exit
        _record(name, exc, missing, failed)
        return None


def _record(name: str, exc: BaseException, missing: dict[str, list[str]],
            failed: dict[str, list[str]]) -> None:
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        missing[exc.name.split(".")[0]].append(name)
    else:
        failed[name] = [f"{type(exc).__name__}: {exc}"[:300]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("packages", nargs="+")
    ap.add_argument("--json", help="also write the whole report here")
    args = ap.parse_args(argv)
    report = sweep(args.packages)
    for top, importers in sorted(report["missing"].items(), key=lambda kv: -len(kv[1])):
        print(f"missing {top}: {len(importers)} modules, e.g. {importers[0]}")
    for name, (err,) in sorted(report["failed"].items()):
        print(f"failed {name}: {err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
