"""Hatchling build hook: compile pdpatch's C block encoder (``pdpatch/hashing/_block_items.c``).

The encoder writes the serialized token ids of every block in one call, which is where most of
a key chain's time goes in pure Python (``scripts/bench_block_keys.py`` measures both builds
against vLLM's own chain; docs/proof.md's benchmark table has the figures).
pdpatch is correct without it: where no C compiler or Python headers are found the wheel is
built pure-Python, a warning says so, and ``pdpatch doctor`` reports "pure Python".
``PDPATCH_REQUIRE_C_ENCODER=1`` turns that warning into a build error (the test setup sets it,
so CI cannot silently test the slow path only).

A regular wheel gets the compiled module and a platform tag; an editable install builds it next
to the source, where the editable ``.pth`` finds it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "pdpatch/hashing/_block_items.c"
REQUIRE_ENV = "PDPATCH_REQUIRE_C_ENCODER"


def compile_extension(source: Path, target: Path) -> None:
    """One ``cc -shared`` call with this interpreter's own compiler flags."""
    cfg = sysconfig.get_config_var
    partial = target.with_name(target.name + ".partial")
    cmd = [*shlex.split(cfg("LDSHARED") or "cc -shared"), *shlex.split(cfg("CCSHARED") or ""),
           "-O2", "-fno-strict-aliasing", f"-I{sysconfig.get_paths()['include']}",
           str(source), "-o", str(partial)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    # replaced, not overwritten: a process may have the previous build loaded
    os.replace(partial, target)


class BlockItemsBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        source = Path(self.root) / SOURCE
        name = "_block_items" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        self._scratch: Path | None = None
        if version == "editable":
            target = source.with_name(name)
        else:
            self._scratch = Path(tempfile.mkdtemp(prefix="pdpatch-ext-"))
            target = self._scratch / name
        try:
            compile_extension(source, target)
        except (OSError, subprocess.CalledProcessError) as exc:
            self.finalize(version, build_data, "")
            detail = getattr(exc, "stderr", "") or str(exc)
            if os.environ.get(REQUIRE_ENV) == "1":
                raise RuntimeError(f"pdpatch: could not compile {SOURCE} "
                                   f"({REQUIRE_ENV}=1): {detail}") from exc
            print(f"pdpatch: WARNING: could not compile {SOURCE}; block keys use the "
                  f"pure-Python encoders (about 2x slower): {detail}", file=sys.stderr)
            return
        if version != "editable":
            build_data["force_include"][str(target)] = f"pdpatch/hashing/{name}"
            build_data["pure_python"] = False
            build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if getattr(self, "_scratch", None) is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
