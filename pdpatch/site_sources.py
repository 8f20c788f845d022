"""The source of one vLLM site (a function, method, class or module-level name), normalized and
fingerprinted, read from the ``.py`` files without importing vLLM.

Why: a patch stays on by itself on a vLLM release newer than the ones it was verified on only
where the vLLM code its correctness rests on is unchanged (:mod:`pdpatch.verified`).  "Unchanged"
must ignore what cannot change behaviour -- comments, docstrings, whitespace, line numbers -- and
must not depend on the Python that computes it: the fingerprints shipped with pdpatch are made on
one Python and compared on another.  ``ast.dump`` is not stable across Pythons (3.12 added
``type_params`` to every function node) and tokens are not either (3.12 splits f-strings), so the
tree is written out here with every empty or ``None`` field left out, which keeps the output of
3.10-3.13 equal for the syntax vLLM uses.

What a site's fingerprint covers:
* a function or method: its whole definition (decorators, arguments, body);
* a class: its header only (name, bases, keywords, decorators) -- a patch that relies on a
  class's behaviour names the methods it relies on;
* a module-level name bound by assignment (an alias, a constant): that statement;
* a name a module imports (``from .metadata import compute_nixl_compatibility_hash``): the
  definition it is imported from, followed through the package's relative imports.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from pathlib import Path

FOLLOW_IMPORTS = 4                     # re-exports followed before giving up


def module_file(root: Path, module: str) -> Path | None:
    """The file of ``module`` (dotted, ``vllm.x.y``) under ``root``, the directory holding the
    top-level package (``root/vllm/x/y.py`` or ``root/vllm/x/y/__init__.py``)."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        return body[1:]
    return body


def _write(node: object, out: list[str]) -> None:
    """A canonical text of ``node``: class names and the non-empty fields, recursively."""
    if isinstance(node, ast.AST):
        out.append(type(node).__name__)
        out.append("(")
        for name in node._fields:
            value = getattr(node, name, None)
            if name == "body" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.ClassDef)):
                value = _strip_docstring(value)
            if value is None or value == []:
                continue
            out.append(name)
            out.append("=")
            _write(value, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for item in node:
            _write(item, out)
            out.append(",")
        out.append("]")
    else:
        out.append(repr(node))


def canonical(node: ast.AST) -> str:
    out: list[str] = []
    _write(node, out)
    return "".join(out)


def _class_header(node: ast.ClassDef) -> ast.ClassDef:
    return ast.ClassDef(name=node.name, bases=node.bases, keywords=node.keywords, body=[],
                        decorator_list=node.decorator_list)


def _binds(stmt: ast.stmt, name: str) -> bool:
    """Whether ``stmt`` binds ``name`` at its own level."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    return False


def _binding(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The last statement of ``body`` that binds ``name`` at that level (Python's own rule:
    the last binding wins)."""
    return next((stmt for stmt in reversed(body) if _binds(stmt, name)), None)


def _imported_from(stmt: ast.ImportFrom, name: str, module: str, is_package: bool
                   ) -> tuple[str, str] | None:
    """(module, name) that ``from ... import`` statement ``stmt`` takes ``name`` from."""
    alias = next(a for a in stmt.names if (a.asname or a.name) == name)
    if stmt.level:
        parts = module.split(".")
        keep = len(parts) - stmt.level + (1 if is_package else 0)
        if keep <= 0:
            return None
        base = ".".join(parts[:keep])
        source = f"{base}.{stmt.module}" if stmt.module else base
    else:
        source = stmt.module or ""
    return source, alias.name


class SourceTree:
    """The ``.py`` files of one vLLM tree, each parsed once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._parsed: dict[str, tuple[ast.Module, bool] | None] = {}

    def _module(self, module: str) -> tuple[ast.Module, bool] | None:
        if module not in self._parsed:
            path = module_file(self.root, module)
            self._parsed[module] = None if path is None else (
                ast.parse(path.read_bytes(), str(path)), path.name == "__init__.py")
        return self._parsed[module]

    def node(self, module: str, qualname: str, _depth: int = 0) -> ast.AST | None:
        """The definition ``qualname`` names in ``module`` (None where there is none)."""
        parsed = self._module(module)
        if parsed is None:
            return None
        tree, is_package = parsed
        head, *rest = qualname.split(".")
        node = _binding(tree.body, head)
        if isinstance(node, ast.ImportFrom) and _depth < FOLLOW_IMPORTS:
            source = _imported_from(node, head, module, is_package)
            if source is None:
                return None
            return self.node(source[0], ".".join([source[1], *rest]), _depth + 1)
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return None
            node = _binding(node.body, part)
        return node

    def text(self, module: str, qualname: str) -> str | None:
        """The canonical text of the site (see the module docstring); None if absent."""
        node = self.node(module, qualname)
        if node is None or isinstance(node, (ast.Import, ast.ImportFrom)):
            return None
        return canonical(_class_header(node) if isinstance(node, ast.ClassDef) else node)

    def fingerprint(self, module: str, qualname: str) -> str | None:
        text = self.text(module, qualname)
        return None if text is None else digest(text)


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def readable(module: str, qualname: str, tree: SourceTree) -> str | None:
    """The site as Python source without comments and docstrings, for a human-readable diff
    between releases (``ast.unparse``; not used for fingerprints, whose text must not depend on
    the Python)."""
    node = tree.node(module, qualname)
    if node is None or isinstance(node, (ast.Import, ast.ImportFrom)):
        return None
    node = _class_header(node) if isinstance(node, ast.ClassDef) else copy.deepcopy(node)
    _drop_docstrings(node)
    return ast.unparse(node)


def _drop_docstrings(node: ast.AST) -> None:
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            sub.body = _strip_docstring(sub.body) or [ast.Pass()]
