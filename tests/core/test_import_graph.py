"""Imports flow one way: no import cycles among the modules of ``sparse_k`` (``kernel_src/``) and
``hf_sparse_attention/``, no import from the core up into the user layer, and inside ``sparse_k`` no
import from a lower layer up into a higher one (``LAYERS``); the Triton and CUDA kernel packages never
import each other, and the subpackages' ``__init__.py`` files import nothing.

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

#: The layers of ``sparse_k``, lowest first: a module imports its own layer and the layers below,
#: never one above. A layer is a list of module prefixes (a subpackage covers its modules).
LAYERS = (
    ("base", ("sparse_k.warn", "sparse_k._ops")),  # one-time warnings; the hub build's op namespace
    ("layouts", ("sparse_k.layouts",)),  # patterns, row geometry, block and token layouts
    ("attention", ("sparse_k.attention",)),  # reference, torch path, plan, dispatch, Triton and CUDA kernels
    ("selection", ("sparse_k.selection",)),  # learned selection: SparseK, scorers, selectors, page selection
    ("entry points", ("sparse_k.api", "sparse_k.flash_api")),  # sparse_attention, the FlashAttention-style API
    ("integrations", ("sparse_k.integrations",)),  # model config schema, Transformers adapter, hub entry
    ("package", ("sparse_k",)),  # sparse_k/__init__.py: re-exports the public names
)
#: Kernel packages that never import each other (the plan and dispatch choose between them).
SEPARATE = ("sparse_k.attention.triton", "sparse_k.attention.cuda")


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


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index in ``layers`` of the layer holding ``module`` (its longest matching prefix), else None.
    The root package (``layers``' shortest prefix) holds only its ``__init__``."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            inside = module == prefix or ("." in prefix and module.startswith(prefix + "."))
            if inside and len(prefix) > length:
                best, length = i, len(prefix)
    return best


def layer_violations(graph: dict[str, set[str]], root: str, layers=LAYERS, separate=SEPARATE) -> list[str]:
    """``"a -> b (why)"`` for every import of ``root``'s modules that goes up a layer or across
    ``separate`` packages, and ``"a: in no layer"`` for a module ``layers`` does not place."""
    out = []
    for module in sorted(m for m in graph if m == root or m.startswith(root + ".")):
        mine = layer_of(module, layers)
        if mine is None:
            out.append(f"{module}: in no layer")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs > mine:
                out.append(f"{module} -> {target} ({layers[mine][0]} imports {layers[theirs][0]})")
            for a in separate:
                for b in separate:
                    if a != b and (module + ".").startswith(a + ".") and (target + ".").startswith(b + "."):
                        out.append(f"{module} -> {target} ({a} imports {b})")
    return out


def test_no_import_cycles():
    cycles = find_cycles(import_graph(PACKAGES))
    assert not cycles, f"import cycles: {_describe(cycles)}"


def test_core_does_not_import_the_user_layer():
    graph = import_graph(PACKAGES)
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("sparse_k")
                    for t in targets if t.startswith("hf_sparse_attention"))
    assert not upward, f"sparse_k imports hf_sparse_attention: {upward}"


def test_sparse_k_imports_flow_down_its_layers():
    violations = layer_violations(import_graph(PACKAGES), "sparse_k")
    assert not violations, "imports against sparse_k's layers (tests/core/test_import_graph.py LAYERS):\n" + "\n".join(violations)


def test_subpackage_inits_import_nothing():
    """A subpackage's ``__init__.py`` says what the package computes and re-exports nothing (a
    re-export would import its modules with the package, and could close a cycle)."""
    inits = sorted(p for p in PACKAGES["sparse_k"].rglob("__init__.py") if p.parent != PACKAGES["sparse_k"])
    assert len(inits) >= 6, inits
    for path in inits:
        tree = ast.parse(path.read_text(), str(path))
        assert ast.get_docstring(tree), f"{path} has no docstring"
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not imports, f"{path} imports (line {imports[0].lineno if imports else 0}); keep package __init__ files empty"


def test_layer_check_finds_upward_and_cross_imports():
    """The layer check on a made-up graph: an upward import, an import across the separate kernel
    packages and a module in no layer are reported; downward and same-layer imports are not."""
    layers = (("low", ("p.low",)), ("high", ("p.high", "p.top")), ("package", ("p",)))
    graph = {
        "p": {"p.high.a", "p.low.x"}, "p.low.x": {"p.low.y"}, "p.low.y": set(), "p.high.a": {"p.low.x", "p.top"},
        "p.top": set(), "p.high.k1.f": {"p.high.k2.g"}, "p.high.k2.g": set(), "p.stray": set(),
    }
    assert layer_violations(graph, "p", layers, ("p.high.k1", "p.high.k2")) == [
        "p.high.k1.f -> p.high.k2.g (p.high.k1 imports p.high.k2)", "p.stray: in no layer",
    ]
    graph["p.low.y"] = {"p.top"}
    assert layer_violations(graph, "p", layers, ()) == ["p.low.y -> p.top (low imports high)", "p.stray: in no layer"]
    assert layer_of("p", layers) == 2 and layer_of("p.lowish", layers) is None and layer_of("p.low.x", layers) == 0


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
