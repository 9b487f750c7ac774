"""No import cycle among the project's modules (flash_msa and msa_train) at module level.

Imports inside functions are not counted: they run after every module is loaded. ``from pkg
import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``; a
module's own package ``__init__`` is not counted as a dependency of it (Python runs it first
anyway, and a package re-exporting its submodules would otherwise always form a cycle).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"flash_msa": ROOT / "kernels" / "flash_msa", "msa_train": ROOT / "msa_train"}


def _modules() -> dict[str, Path]:
    mods = {}
    for root in PACKAGES.values():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _module_level_imports(name: str, path: Path, mods: dict, in_functions: bool = False) -> set[str]:
    is_pkg = path.name == "__init__.py"
    found = set()
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not in_functions:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        else:
            stack.extend(ast.iter_child_nodes(node))  # class bodies, if / try blocks
    deps = set()
    for dep in found:
        while dep and dep not in mods:
            dep = dep.rpartition(".")[0]
        if dep and dep != name:
            deps.add(dep)
    return deps


def _cycles(graph: dict[str, set]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph(prefix: str) -> dict[str, set]:
    mods = _modules()
    return {m: {d for d in _module_level_imports(m, p, mods) if d.startswith(prefix)}
            for m, p in mods.items() if m.startswith(prefix)}


@pytest.mark.parametrize("package", ["flash_msa", "msa_train"])
def test_no_import_cycle(package):
    assert _cycles(_graph(package)) == []


def test_flash_msa_never_imports_msa_train():
    mods = _modules()
    for m, p in mods.items():
        if m.startswith("flash_msa"):
            assert not any(d.startswith("msa_train") for d in _module_level_imports(m, p, mods)), m


def test_decode_and_nsa_are_not_a_circle():
    """nsa.py uses decoding (NativeSparseAttention.decode); no module of decoding needs anything of
    nsa.py, not even inside a function (the sizes check lives in utils/validation.py, the reference
    combination of the branches in gates.py)."""
    mods = _modules()
    for name in [m for m in mods if m == "flash_msa.decode" or m.startswith("flash_msa.decode.")]:
        deps = _module_level_imports(name, mods[name], mods, in_functions=True)
        assert "flash_msa.nsa" not in deps and "flash_msa" not in deps, name


def test_the_checker_finds_a_cycle(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
