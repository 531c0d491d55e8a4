"""The package's layering, read from its source with ``ast``: no import circles among ditrun's modules (imports
inside functions count: a lazy import that closes a circle only moves the failure to run time), the kernels
depend on nothing of the model they serve, and the package never imports the recipes that build its artefacts."""

import ast
from pathlib import Path

import ditrun

PACKAGE = Path(ditrun.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    """ditrun's modules by dotted name (a package by its own name, for its ``__init__.py``)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ditrun modules ``name`` imports anywhere in its source: ``from a.b import c`` names a.b.c when that is a
    module, else a.b; importing a submodule is not counted as importing its package's ``__init__``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, once each, as the path that closes it (depth-first search, three colours)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert "ditrun.model.build" in graph["ditrun.launch.worker"]  # a module-level import
    assert "ditrun.launch.spawn" in graph["ditrun.launch"]  # an import inside a function counts too
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_of_ditrun_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_kernels_import_nothing_from_the_model():
    graph = import_graph()
    reaching_up = {name: sorted(t for t in targets if t.startswith("ditrun.model"))
                   for name, targets in graph.items() if name.startswith("ditrun.kernels")}
    assert {name: targets for name, targets in reaching_up.items() if targets} == {}


def test_the_model_does_not_reach_up_into_the_launch_metrics_or_workload():
    """``model/`` builds and runs the DiT; what a run decides (ranks, references, edits) is handed to it."""
    graph = import_graph()
    upward = ("ditrun.launch", "ditrun.metrics", "ditrun.workload", "ditrun.parallel", "ditrun.transport")
    reaching_up = {name: sorted(t for t in targets if t.startswith(upward))
                   for name, targets in graph.items() if name.startswith("ditrun.model")}
    assert {name: targets for name, targets in reaching_up.items() if targets} == {}


def _imports_anywhere(path: Path) -> set[str]:
    """Every module name an ``import`` or absolute ``from ... import`` in ``path`` names, at any depth."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_the_package_never_imports_the_recipes():
    """``recipes/`` (the editor's training) depends on ditrun; the installed package runs without it."""
    reaching = {name: sorted(n for n in _imports_anywhere(path) if n == "recipes" or n.startswith("recipes."))
                for name, path in module_names().items()}
    assert {name: found for name, found in reaching.items() if found} == {}
    recipe = PACKAGE.parent / "recipes" / "editor" / "train.py"
    assert "recipes.editor.config" in _imports_anywhere(recipe)  # the check reads what it should
