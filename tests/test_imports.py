"""The package's imports form no cycle: every ``import`` of a cukern module by a cukern module,
at module level or inside a function, is an arrow, and no arrow path comes back."""
import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cukern"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _targets(mods: dict, current: str, node) -> set:
    package = current if mods[current].name == "__init__.py" else current.rpartition(".")[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return {n for n in names if n in mods and n != current}


def import_graph(mods: dict) -> dict[str, set]:
    return {m: set().union(*(_targets(mods, m, n) for n in ast.walk(ast.parse(p.read_text()))
                             if isinstance(n, (ast.Import, ast.ImportFrom))))
            for m, p in mods.items()}


@functools.lru_cache(maxsize=1)
def package_graph() -> tuple[dict[str, Path], dict[str, set]]:
    """cukern's modules and their import graph, parsed once for the tests that read them."""
    mods = modules()
    return mods, import_graph(mods)


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    found = cycles(package_graph()[1])
    assert not found, f"import cycles in cukern (each a set of modules that import each other): {found}"


def test_a_planted_cycle_is_found(tmp_path):
    pkg = tmp_path / "cukern"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x   # (inside a function: an arrow too)\n")
    (pkg / "c.py").write_text("import cukern.a\n")
    graph = import_graph(modules(pkg))
    assert graph["cukern.a"] == {"cukern.sub.b"} and graph["cukern.sub.b"] == {"cukern.a"}
    assert graph["cukern.c"] == {"cukern.a"}
    assert cycles(graph) == [["cukern.a", "cukern.sub.b"]]


def test_no_family_imports_the_torch_layer_above_it():
    """The layers, bottom up: the shared mechanisms (``cukern._*``), the families, then
    ``cukern.torch``, which builds on the families' declarations (a family gets cukern.torch's
    tools, ops and modules handed to its ``torch_api`` and module variants); the command line,
    the bench driver and the demo sit on top. Nothing below cukern.torch imports it."""
    mods, graph = package_graph()
    top = {"cukern.__main__"}
    below = [m for m in mods if not m.startswith(("cukern.torch", "cukern.demo", "cukern._bench"))
             and m not in top and m != "cukern"]
    upward = {m: sorted(t for t in graph[m] if t.startswith(("cukern.torch", "cukern.demo"))) for m in below}
    assert not {m: t for m, t in upward.items() if t}, upward
    assert "cukern.norm" in below and "cukern._kernels" in below
