"""The layout rules docs/ARCHITECTURE.md promises a newcomer, checked on the
source itself: the layers (protos at the bottom, then environment, then the
processes, the launcher on top), no import circle (not even one made by an
import for types only), the router apart from the workers, folders in rooms,
small modules and functions.

Static: the modules are parsed, not imported (but for one check, in a child
interpreter: what importing the router and the supervisor brings in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "environment", "cache_service", "router", "workers", "deploy", "benchmarks")
# What each folder may import of the project: a folder never imports one
# above it. protos is the wire contract and a leaf; environment (settings,
# backend, model folder, logging, memory and power readings) sits under every
# process; deploy is the launcher on top.
MAY_IMPORT = {
    "protos": set(),
    "environment": {"protos"},
    "cache_service": {"environment", "protos"},
    "router": {"environment", "protos", "cache_service"},
    "workers": {"environment", "protos", "cache_service"},
    # the launcher on top; `tandem bench` is one of its commands
    "deploy": {"environment", "protos", "cache_service", "router", "workers", "benchmarks"},
    "benchmarks": set(PACKAGES) - {"benchmarks"},
}
MAX_MODULES_FLAT = 15
# mlx-lm's private names that Tandem relies on (its caches' write index, its
# batch's token counters and pending tokens): read and written under
# workers/kernels/ alone, the one place to look when mlx-lm changes.
MLX_LM_PRIVATE = {"_idx", "_num_tokens", "_next_tokens", "_next_logprobs", "_token_context", "_current_tokens"}
# A folder of probes, each a script run by hand (`python benchmarks/probes/NAME.py`), not a package of parts.
FLAT_SCRIPTS = ("benchmarks/probes",)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (a module, or a package's name
    imported from it), or None for another library."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, tree: ast.AST):
    """(project module imported, whether at module level) for each import,
    those under `if TYPE_CHECKING:` included: a circle for types is a circle
    in the design all the same."""
    def walk(node, top):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, top
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for alias in child.names:
                    yield f"{child.module}.{alias.name}", top
            yield from walk(child, inner)

    for name, top in walk(tree, True):
        target = _resolve(name)
        if target is not None and target != module:
            yield target, top


TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
GRAPH = {name: sorted(set(_imports(name, tree))) for name, tree in TREES.items()}


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_80_lines():
    long = [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1}"
            for name, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def _cycle_from(start: str, edges: dict[str, list[str]]) -> list[str] | None:
    path, on_path, done = [], set(), set()

    def visit(node):
        path.append(node)
        on_path.add(node)
        for nxt in edges.get(node, []):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        on_path.discard(path.pop())
        done.add(node)
        return None

    return visit(start)


@pytest.mark.parametrize("where", ["module level", "anywhere"])
def test_no_import_circle(where):
    """Module-level imports, and then also those inside functions (an import
    moved into a function to dodge a circle is still one)."""
    edges = {m: [t for t, top in targets if top or where == "anywhere"] for m, targets in GRAPH.items()}
    cycles = {" -> ".join(c) for m in edges if (c := _cycle_from(m, edges))}
    assert cycles == set()


def test_the_router_never_imports_a_worker_module():
    assert {m: t for m, targets in GRAPH.items() if m.startswith("router")
            for t, _ in targets if t.startswith("workers")} == {}


def test_no_folder_imports_one_above_it():
    upward = {f"{m} -> {t}" for m, targets in GRAPH.items() for t, _ in targets
              if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]}
    assert upward == set()


def test_mlx_lm_private_state_is_touched_only_under_kernels():
    touched = set()
    for name, tree in TREES.items():
        if name.startswith("workers.kernels") or name.startswith("benchmarks"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in MLX_LM_PRIVATE:
                touched.add(f"{name}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
                touched |= {f"{name}: {a.name}" for a in node.names if a.name.startswith("_")}
    assert touched == set()


def test_no_folder_holds_more_than_15_modules_flat():
    """A folder that grows past that is a sign of rooms to make (the router's
    api/, media/, guards/ and routing/)."""
    crowded = {}
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *(p for p in (ROOT / pkg).rglob("*") if p.is_dir())]:
            n = len([f for f in folder.glob("*.py") if f.name != "__init__.py"])
            where = str(folder.relative_to(ROOT))
            if n > MAX_MODULES_FLAT and "__pycache__" not in folder.parts and where not in FLAT_SCRIPTS:
                crowded[where] = n
    assert crowded == {}


def test_the_router_and_the_supervisor_import_no_mlx():
    """The router tokenizes without MLX or transformers (router/text/), and a
    VLM's prompter is imported only for one: importing the router and the
    supervisor maps neither. Imported, unlike the checks above: in a fresh
    interpreter, where nothing else has brought them in."""
    code = ("import sys, deploy.supervisor, router.main, router.app; "
            "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('mlx', 'transformers'))}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_test_files_import_no_other_test_file():
    """What two test files share lives in tests/support/ (or a conftest)."""
    shared = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                if not node.module.startswith("tests.support") and node.module.split(".")[-1].startswith("test_"):
                    shared[str(path.relative_to(ROOT))] = node.module
    assert shared == {}


def test_the_checks_see_the_tree():
    """Guards the guards: the walk finds the packages, the imports and a circle."""
    assert {"router.app", "workers.worker", "environment.settings", "protos.messages"} <= set(MODULES)
    assert ("environment.settings", True) in GRAPH["router.main"]
    assert ("protos.messages", True) in GRAPH["protos.codec"]
    assert _cycle_from("a", {"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle_from("a", {"a": ["b"], "b": []}) is None
