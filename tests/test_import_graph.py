"""The package's import graph has no cycle, counting every import: module level, inside functions and under
`if TYPE_CHECKING:` (a type-only loop still ties two modules' designs together). The configuration reads leaf
helpers only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dcoco_hf

PACKAGE = Path(dcoco_hf.__file__).parent
# The network a Hub folder carries (`modeling_dcoco.py` and what it imports): no runtime module among them, so a
# folder holds the model code only and the runtime comes from the installed package.
NETWORK_MODULES = {
    "dcoco_hf.network.modeling_dcoco",
    "dcoco_hf.network.configuration_dcoco",
    "dcoco_hf.network.corrector",
    "dcoco_hf.network.correctors",
    "dcoco_hf.network.lilicorr",
    "dcoco_hf.network.selector",
}
HUB_FOLDER_MAX_PY_FILES = 6


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in its body."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from . import x` and `from .m import name` both count: x may be a module, name an attribute of m.
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("dcoco_hf"):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. A package's __init__ importing its submodules is not a loop
    unless a submodule imports the package back."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "dcoco_hf.network.modeling_dcoco" in graph and "dcoco_hf.training.objective" in graph
    assert "dcoco_hf.network.corrector" in graph["dcoco_hf.network.lilicorr"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_reports_a_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += sorted(graph.get(node, ()))
    return seen


@pytest.mark.parametrize(
    "module",
    ["dcoco_hf.network.modeling_dcoco", "dcoco_hf.network.configuration_dcoco", "dcoco_hf.serving.block_corrector"],
)
def test_model_files_import_no_runtime_module(module):
    """The network and its configuration reach only network modules, through any chain of imports; so does the
    corrector a serving engine runs (it binds the network's methods, not the runtime's)."""
    runtime = reachable(import_graph(), module) - NETWORK_MODULES - {module}
    assert not runtime, f"{module} reaches runtime modules {sorted(runtime)}"


def test_hub_folders_carry_the_network_only():
    """Each shipped drafter folder holds the network's code and nothing else (at most 6 .py files)."""
    network = {name.rpartition(".")[2] + ".py" for name in NETWORK_MODULES}
    assert len(network) <= HUB_FOLDER_MAX_PY_FILES
    for card in sorted((PACKAGE.parent / "model_cards").glob("*/config.json")):
        shipped = {path.name for path in card.parent.glob("*.py")}
        assert shipped == network, f"{card.parent.name}: {sorted(shipped ^ network)} (run scripts/sync_model_card.py)"
