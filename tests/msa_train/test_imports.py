"""msa_train's modules import one another without a cycle, function-level imports counted: an
import deferred into a function still ties the two modules together (issue 46 found
models -> models.attention -> parallel.sequence -> models)."""
import ast
from pathlib import Path

from tests.msa_train._util import REPO


def _module_graph(package: Path) -> dict:
    """module -> the project modules it imports anywhere in its body (``from a import b`` counts as
    ``a.b`` when that is a module, else as ``a``; a package is its ``__init__``)."""
    files = {}
    for f in package.rglob("*.py"):
        parts = f.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        edges = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
                    pkg = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                    base = f"{pkg}.{base}" if base else pkg
                for a in node.names:
                    edges.add(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def _cycles(graph: dict) -> list:
    state, stack, found = {}, [], []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_msa_train_has_no_import_cycle():
    graph = _module_graph(REPO / "msa_train")
    assert "msa_train.parallel.sequence" in graph and "msa_train.models.attention" in graph["msa_train.models"]
    assert _cycles(graph) == []
