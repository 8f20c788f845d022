"""The pure cores stand alone: nothing under ``pdpatch/kv`` or ``pdpatch/hashing`` reaches the
installer, the registry, a patch or the metrics (which reach the installer), directly or through
another module -- imports inside functions included, so none can hide a cycle.  The one
exception is the package ``pdpatch`` itself, which every submodule's import runs: its
``install()``, ``uninstall()`` and ``status()`` import the installer when called, as the public
entry points they are.  (The staging core used to count its READs through ``pdpatch.metrics``:
28 modules, the installer and every patch, on one cycle.)"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pdpatch"
CORES = ("pdpatch.kv", "pdpatch.hashing")
OUTSIDE = ("pdpatch.installer", "pdpatch.registry", "pdpatch.patches", "pdpatch.metrics")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The pdpatch modules ``path`` imports anywhere in its body, functions included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found |= {module, *(f"{module}.{a.name}" for a in node.names)}
    out = set()
    for mod in found:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            out.add(mod)
    return out


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PKG.rglob("*.py")}
    edges = {n: imported(n, p, set(paths)) for n, p in paths.items()}
    # the root package's only pdpatch imports are those of its entry points (see above)
    edges["pdpatch"] = {m for m in edges["pdpatch"] if not m.startswith("pdpatch.installer")}
    return edges


def path_to_outside(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    parent: dict[str, str] = {}
    stack, seen = [start], {start}
    while stack:
        node = stack.pop()
        if node.startswith(OUTSIDE):
            chain = [node]
            while chain[-1] != start:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for nxt in edges[node] - seen:
            seen.add(nxt)
            parent[nxt] = node
            stack.append(nxt)
    return None


def test_the_cores_reach_neither_the_installer_nor_a_patch():
    edges = graph()
    cores = [n for n in edges if n.startswith(CORES)]
    assert len(cores) > 20
    leaks = {n: " -> ".join(p) for n in cores if (p := path_to_outside(n, edges))}
    assert leaks == {}


def test_the_check_sees_imports_inside_functions():
    """The guard above would pass on a graph without function-level edges: it has them."""
    edges = graph()
    assert "pdpatch.installer" in edges["pdpatch.metrics"]          # inside count()
    assert path_to_outside("pdpatch.patches.read_guard", edges) is not None
