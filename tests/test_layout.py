"""The package's module graph: no import cycles (function-level imports included), leaf modules stay leaves, and
importing the library does not pull in the command line or the benchmarks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dcoco_hf"
LEAVES = (
    "runtime.tap", "runtime.context_cache", "runtime.device", "network.configuration_dcoco", "network.corrector",
    "network.lilicorr", "network.selector", "runtime.cpu_attention", "runtime.cpu_linear", "runtime.logs",
    "network.correctors", "runtime.hf_compat",
)


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Package modules `path` imports anywhere in it, except under `if TYPE_CHECKING:` (type hints only)."""
    tree = ast.parse(path.read_text())
    hidden = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in hidden or not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - node.level + 1]
        if node.module:
            found.add(".".join([*base, node.module]))
        else:
            found.update(".".join([*base, alias.name]) for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(path): path for path in PACKAGE.rglob("*.py")}
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def test_no_import_cycles():
    graph, state = _graph(), {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*trail, name, dep])}"
            if dep not in state:
                visit(dep, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_leaf_modules_import_no_package_module_but_leaves():
    graph = _graph()
    for leaf in LEAVES:
        others = {dep for dep in graph[f"dcoco_hf.{leaf}"] if dep.removeprefix("dcoco_hf.") not in LEAVES}
        assert not others, (leaf, others)


def test_importing_the_library_loads_no_cli_or_benchmark():
    code = "import sys, dcoco_hf; print(sorted(m for m in sys.modules if m.startswith('dcoco_hf.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in ("dcoco_hf.cli.main", "dcoco_hf.cli.common", "dcoco_hf.cli.bench", "dcoco_hf.cli.batch_bench",
                 "dcoco_hf.assets"):
        assert f"'{name}'" not in loaded, name
