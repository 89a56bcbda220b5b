"""No import circle among ``collect``, ``evaluate``, ``executors`` and ``plan``.

The package graph is read from the source with ``ast`` (nothing is imported): an edge A -> B for
every ``import darts_bench.B...`` / ``from darts_bench.B... import`` in a module of A, at module
level or inside a function, and for every lazy ``"darts_bench.B...:attr"`` / ``"darts_bench.B.x"``
string (registry entries, vLLM's worker-extension path), which are imports too. Packages are the
first component under ``darts_bench`` (a top-level module is its own node). A circle may run
through other packages (``collect -> evaluate -> surgery -> collect`` was one), so the check is on
the strongly connected components of the whole graph: none may hold two of the four.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "darts_bench"
LAYERED = {"collect", "evaluate", "executors", "plan"}
_LAZY = re.compile(r"^darts_bench(\.\w+)+(:\w+)?$")


def package_graph(root: Path = PKG) -> dict[tuple[str, str], set[str]]:
    """``(package, imported package) -> {importing modules}`` over every ``.py`` under ``root``
    (the ``darts_bench`` folder)."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        mod = ".".join(parts).removesuffix(".__init__")
        src = parts[1] if len(parts) > 1 else ""
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: against this module's package
                    pkg = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                targets.append(base)
                targets += [f"{base}.{a.name}" for a in node.names if base == "darts_bench"]
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _LAZY.match(node.value):
                targets.append(node.value.split(":")[0])
            for t in targets:
                tp = t.split(".")
                if tp[0] == "darts_bench" and len(tp) > 1 and tp[1] != src:
                    edges[(src, tp[1])].add(mod)
    return dict(edges)


def strongly_connected(nodes: set[str], edges) -> list[set[str]]:
    """Tarjan's strongly connected components of the directed graph ``edges`` (pairs)."""
    succ = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


def test_the_cycle_finder_finds_a_circle_through_another_package():
    comps = strongly_connected({"a", "b", "c", "d"}, {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")})
    assert {"a", "b", "c"} in comps and {"d"} in comps


def test_the_graph_sees_module_function_relative_and_lazy_imports(tmp_path):
    root = tmp_path / "darts_bench"
    files = {"__init__.py": "", "a/__init__.py": "from darts_bench.b import x\n",
             "a/f.py": "def f():\n    import darts_bench.c.y\n",
             "a/g.py": "REG = {'k': 'darts_bench.d.z:Thing'}\nEXT = 'darts_bench.e.w.Cls'\n",
             "a/h.py": "from ..f import thing\nfrom darts_bench import g\n", "a/i.py": "from . import f\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert package_graph(root) == {("a", "b"): {"darts_bench.a"}, ("a", "c"): {"darts_bench.a.f"},
                                   ("a", "d"): {"darts_bench.a.g"}, ("a", "e"): {"darts_bench.a.g"},
                                   ("a", "f"): {"darts_bench.a.h"}, ("a", "g"): {"darts_bench.a.h"}}
    real = package_graph()
    assert "darts_bench.executors.worker" in real[("executors", "collect")]  # the feature store
    assert "darts_bench.surgery.data" in real[("surgery", "collect")]


def test_no_import_circle_among_collect_evaluate_executors_plan():
    edges = package_graph()
    nodes = {n for e in edges for n in e}
    assert LAYERED <= nodes
    bad = [c for c in strongly_connected(nodes, edges) if len(c & LAYERED) > 1]
    detail = {f"{a} -> {b}": sorted(m) for (a, b), m in edges.items()
              if any(a in c and b in c for c in bad)}
    assert not bad, f"import circles {bad}: {detail}"
