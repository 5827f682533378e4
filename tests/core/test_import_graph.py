"""Imports flow one way: no import cycles among the modules of ``sparse_k`` (``kernel_src/``) and
``hf_sparse_attention/``, and no import from the core up into the user layer.

The graph is read from the source with ``ast`` (nothing is imported): module-level and
function-level ``import`` / ``from ... import`` statements, relative or absolute (``sparse_k.x``),
and ``importlib.import_module("<literal>", __package__)`` calls. ``from . import x`` counts as an
import of the submodule ``x`` where one exists, else of the package's ``__init__``.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "kernel_src").is_dir())  # the repository
#: Package name -> source folder.
PACKAGES = {"sparse_k": ROOT / "kernel_src", "hf_sparse_attention": ROOT / "hf_sparse_attention"}


def module_files(packages: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``.py`` file under each package folder."""
    found = {}
    for pkg, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join((pkg, *rel))] = path
    return found


def _package_of(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(base: str, level: int, module: str | None) -> str:
    parts = base.split(".")
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _targets(node: ast.AST, package: str, modules: set[str]) -> list[str]:
    """The modules of ``modules`` an import node (or ``import_module`` call) names."""
    out: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:  # `import sparse_k.x.y`: the deepest known module
                name = name.rpartition(".")[0]
            if name:
                out.append(name)
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(package, node.level, node.module) if node.level else (node.module or "")
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                out.append(sub)
            elif base in modules:
                out.append(base)
    elif isinstance(node, ast.Call):
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            target = str(node.args[0].value)
            if target.startswith("."):
                level = len(target) - len(target.lstrip("."))
                target = _resolve(package, level, target.lstrip(".") or None)
            if target in modules:
                out.append(target)
    return out


def import_graph(packages: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules (of ``packages``) it imports anywhere in its source."""
    files = module_files(packages)
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = _package_of(name, path)
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            edges.update(t for t in _targets(node, package, modules) if t != name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs here are a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in components]


def _cycle_in(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (breadth-first)."""
    inside = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {comp}")


def _describe(cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles():
    cycles = find_cycles(import_graph(PACKAGES))
    assert not cycles, f"import cycles: {_describe(cycles)}"


def test_core_does_not_import_the_user_layer():
    graph = import_graph(PACKAGES)
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("sparse_k")
                    for t in targets if t.startswith("hf_sparse_attention"))
    assert not upward, f"sparse_k imports hf_sparse_attention: {upward}"


def test_graph_reader_sees_every_kind_of_import(tmp_path):
    """The reader on a small package: module- and function-level, relative (one and two levels),
    absolute, ``from . import sub`` and ``importlib.import_module``; a cycle is found and named."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text(
        "import importlib\n\ndef f():\n    from .b import g\n    return importlib.import_module('.c', __package__)\n")
    (pkg / "b.py").write_text("from pkg.sub import d\n")
    (pkg / "c.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from ..a import f\nfrom . import e\n")
    (pkg / "sub" / "e.py").write_text("import pkg.c\n")
    graph = import_graph({"pkg": pkg})
    assert graph == {
        "pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.c"}, "pkg.b": {"pkg.sub.d"}, "pkg.c": set(), "pkg.sub": set(),
        "pkg.sub.d": {"pkg.a", "pkg.sub.e"}, "pkg.sub.e": {"pkg.c"},
    }
    cycles = find_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b", "pkg.sub.d", "pkg.a"]], cycles
    assert "pkg.a -> pkg.b -> pkg.sub.d -> pkg.a" in _describe(cycles)
    (pkg / "sub" / "d.py").write_text("from . import e\n")
    assert find_cycles(import_graph({"pkg": pkg})) == []
