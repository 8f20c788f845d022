"""A vLLM release newer than every release pdpatch verified, made from the installed one's real
source: the modules holding the patches' sites, copied into a directory that ``find_spec``
resolves ``vllm`` to, optionally with one site's code edited.  What pdpatch reads of a newer
release is its sources (:mod:`pdpatch.verified`), so this is that release as pdpatch sees it."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from packaging.version import Version

from pdpatch import verified
from pdpatch.patches import all_patches
from pdpatch.site_sources import SourceTree, module_file
from pdpatch.vllm_sites import SUPPORTED

NEXT = Version(f"{SUPPORTED.upper()}.0")        # the first release past the supported range


def newer_release(dest: Path, edit: tuple[str, str] | None = None, line: str = "") -> Path:
    """``dest/vllm/...``: every module holding a patch's site (and each package's
    ``__init__.py`` on the way).  With ``edit`` = (module, qualname), ``line`` is inserted as
    the first line of that function's body (after its docstring).  Returns ``dest``."""
    src = verified.installed_root()
    modules = {m for p in all_patches() if p.versions.upper() == SUPPORTED.upper()
               for m, _ in p.sites(verified.newest_verified(p))}
    for module in modules:
        parts = module.split(".")
        for i in range(1, len(parts)):
            pkg = module_file(src, ".".join(parts[:i]))
            if pkg is not None and pkg.name == "__init__.py":
                target = dest / pkg.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(pkg, target)
        path = module_file(src, module)
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    if edit is not None:
        insert_line(module_file(dest, edit[0]), edit[1], line)
    return dest


def insert_line(path: Path, qualname: str, line: str) -> None:
    """Put ``line`` before the first statement of function ``qualname``'s body that is not its
    docstring, indented as that statement is."""
    tree = SourceTree(path.parent)          # any root: the node is looked up by file below
    node = tree.node(path.stem, qualname)
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    first = body[0]
    lines = path.read_text().splitlines(keepends=True)
    indent = " " * first.col_offset
    lines.insert(first.lineno - 1, f"{indent}{line}\n")
    path.write_text("".join(lines))
