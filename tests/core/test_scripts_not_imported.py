"""Tests use the files of ``scripts/`` only as commands.

What a test needs of a script lives in a package module (the script is its command line); a test of
the command line itself runs the script in a subprocess. So no test file loads a script by path: no
``load_script`` helper, no ``runpy.run_path``, no ``importlib`` spec or loader (``spec_from_file_location``,
``SourceFileLoader``) or ``exec``/``compile`` of a path under ``scripts/``, no ``scripts/`` on ``sys.path``
and no ``import`` of a script's name. The files are read with ``ast`` (nothing is imported); a path
counts as under ``scripts/`` when its expression holds the string ``"scripts"`` (``REPO / "scripts" / name``,
``os.path.join(ROOT, "scripts", ...)``, ``"scripts/x.py"``) or a name assigned from such an expression.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "scripts").is_dir() and (p / "tests").is_dir())
SCRIPT_NAMES = frozenset(p.stem for p in (ROOT / "scripts").glob("*.py"))
#: Calls that load or run a file given its path.
PATH_LOADERS = frozenset({"spec_from_file_location", "SourceFileLoader", "exec", "compile", "run_path"})


def _call_name(node: ast.Call) -> str | None:
    return getattr(node.func, "attr", getattr(node.func, "id", None))


def _mentions_scripts(node: ast.AST, tainted: set[str]) -> bool:
    """Whether expression ``node`` holds a string naming the scripts folder or a name in ``tainted``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "scripts" in sub.value.split("/"):
            return True
        if isinstance(sub, ast.Name) and sub.id in tainted:
            return True
    return False


def _tainted_names(tree: ast.AST) -> set[str]:
    """Names assigned (anywhere in the file) from an expression that mentions the scripts folder, to a
    fixed point (``D = REPO / "scripts"; P = D / "x.py"`` taints both)."""
    assigns = [(n.targets if isinstance(n, ast.Assign) else [n.target], n.value)
               for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None]
    tainted: set[str] = set()
    while True:
        new = {t.id for targets, value in assigns if _mentions_scripts(value, tainted)
               for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)} - tainted
        if not new:
            return tainted
        tainted |= new


def script_loads(source: str, script_names=SCRIPT_NAMES) -> list[str]:
    """Every place of ``source`` (Python) that loads a script by path, as ``"line N: what"``."""
    tree = ast.parse(source)
    tainted = _tainted_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            names = []
        found += [f"line {node.lineno}: imports script {n!r}" for n in names if n.split(".")[0] in script_names]
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        args = [*node.args, *(kw.value for kw in node.keywords)]
        if name == "load_script":
            found.append(f"line {node.lineno}: load_script(...)")
        elif name == "run_path":
            found.append(f"line {node.lineno}: runpy.run_path(...)")
        elif name in PATH_LOADERS and any(_mentions_scripts(a, tainted) for a in args):
            found.append(f"line {node.lineno}: {name}(...) of a path under scripts/")
        elif (name in ("insert", "append") and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "path"
              and getattr(node.func.value.value, "id", None) == "sys" and any(_mentions_scripts(a, tainted) for a in args)):
            found.append(f"line {node.lineno}: sys.path.{name}(...) of the scripts folder")
    return sorted(found, key=lambda s: int(s.split()[1].rstrip(":")))


def test_no_test_loads_a_script_by_path():
    problems = [f"{path.relative_to(ROOT)} {p}" for path in sorted((ROOT / "tests").rglob("*.py"))
                for p in script_loads(path.read_text())]
    assert not problems, "tests load scripts by path (import the package module instead, or run the script in " \
                         "a subprocess):\n" + "\n".join(problems)


def test_the_reader_finds_every_way_of_loading_a_script():
    flagged = {
        "from helpers import load_script\nmod = load_script('train_selector')\n": 1,
        "import runpy, os\nrunpy.run_path(os.path.join(REPO, 'scripts', 'evaluate_perplexity.py'), run_name='__main__')\n": 1,
        "import importlib.util\nspec = importlib.util.spec_from_file_location('b', REPO / 'scripts' / 'build_kernel.py')\n": 1,
        "import importlib.util, os\nD = os.path.join(ROOT, 'scripts')\nP = os.path.join(D, 'x.py')\n"
        "spec = importlib.util.spec_from_file_location('x', P)\n": 1,
        "from importlib.machinery import SourceFileLoader\nm = SourceFileLoader('x', 'scripts/x.py').load_module()\n": 1,
        "exec(compile(open('scripts/tune_decode.py').read(), 'x', 'exec'))\n": 2,
        "import sys\nsys.path.insert(0, str(REPO / 'scripts'))\nimport train_selector as t\nfrom selection_ceiling import main\n": 3,
    }
    for source, count in flagged.items():
        assert len(script_loads(source, {"train_selector", "selection_ceiling"})) == count, source
    allowed = (
        "import subprocess, sys\nSCRIPT = REPO / 'scripts' / 'build_kernel.py'\n"
        "subprocess.run([sys.executable, str(SCRIPT), '--out', 'x'], check=False)\n"
        "import importlib.util\nspec = importlib.util.spec_from_file_location(meta['id'], variant / '__init__.py')\n"
        "from hf_sparse_attention.training import train_selector\nimport hf_sparse_attention.evaluation.selection_ceiling\n"
        "text = 'see scripts/train_selector.py'\n"
    )
    assert script_loads(allowed, {"train_selector", "selection_ceiling"}) == []
