"""The package's layering, read from its source with ``ast``: no import circles among ditrun's modules, nor among the
recipes' (imports inside functions count: a lazy import that closes a circle only moves the failure to run time), every folder
imports only from its own layer or the layers below it (``LAYERS``), the kernels depend on nothing of the model
they serve, and the package never imports the recipes that build its artefacts."""

import ast
from pathlib import Path

import ditrun

PACKAGE = Path(ditrun.__file__).resolve().parent
RECIPES = PACKAGE.parent / "recipes"


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """The modules of ``package`` (ditrun, or the recipes) by dotted name (a package by its own name, for its
    ``__init__.py``)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its source: ``from a.b import c`` names a.b.c when that is a
    module, else a.b; importing a submodule is not counted as importing its package's ``__init__``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
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


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of the same package it imports (others' modules left out)."""
    modules = module_names(package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, once each, as the path that closes it (depth-first search, three colours)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


# ditrun's folders (and top-level modules) by layer, lowest first: a module imports only from its own layer or a
# lower one. Why each sits where it does:
LAYERS = (
    # What everything shares and nothing of ditrun's: errors, registries, the clocks the transports, the step cache
    # and the worker read, dtype and device names, the user's cache folder, whom a cache trusts, the stop signals, how
    # a process ends, the editor's edits.
    (
        "ditrun",
        "ditrun.errors",
        "ditrun.registry",
        "ditrun.timers",
        "ditrun.devices",
        "ditrun.user_cache",
        "ditrun.trust",
        "ditrun.stop_signals",
        "ditrun.process_exit",
        "ditrun.editor",
        "ditrun.conf",
    ),
    # The config schema (and the precision presets it reads), Hydra's errors in one sentence, and the help's groups.
    ("ditrun.config", "ditrun.hydra_errors", "ditrun.cli_help"),
    # Kernels know nothing of the model they serve.
    ("ditrun.kernels",),
    # The DiT, how it is built and sampled: no ranks, no transports, no edits, no measures.
    ("ditrun.model",),
    # How data moves between ranks, and the step cache (a ``model.sampler.Forward``): both time their waits with
    # ``timers``, from below.
    ("ditrun.transport", "ditrun.cache"),
    # Parallel layouts: the model's forward over a transport.
    ("ditrun.parallel",),
    # The results directory: files, the writers' protocol, the runs a report finds. Nothing measured here.
    ("ditrun.results",),
    # The edits, their pictures, prompts and model inputs.
    ("ditrun.workload",),
    # What is measured and reported about a run, the full-quality pass among it.
    ("ditrun.metrics",),
    # Where ranks run and how they meet, stop and fail together, for whatever work they are handed; ``rank_entry``
    # is a spawned rank's first module, outside ``launch/`` so that importing it runs no ``launch/__init__.py``.
    ("ditrun.launch", "ditrun.rank_entry"),
    # The run itself: its checks, the worker, its records and console, the compile cache, ``ditrun warm``.
    ("ditrun.run",),
    # The commands.
    ("ditrun.__main__", "ditrun.tune"),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix naming ``module`` (a folder names all its modules)."""
    found = [
        (len(prefix), index)
        for index, names in enumerate(LAYERS)
        for prefix in names
        if module == prefix or (prefix != "ditrun" and module.startswith(prefix + "."))
    ]
    assert found, f"{module} is in no layer of LAYERS"
    return max(found)[1]


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert "ditrun.model.build" in graph["ditrun.run.worker"]  # a module-level import
    assert "ditrun.launch.spawn" in graph["ditrun.launch"]  # an import inside a function counts too
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_of_ditrun_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_no_module_of_the_recipes_imports_itself_through_others():
    graph = import_graph(RECIPES)
    assert "recipes.editor.dit" in graph["recipes.editor.evaluate"]  # an import inside a function counts here too
    assert not any(name.startswith("ditrun") for targets in graph.values() for name in targets)
    assert cycles(graph) == []


def test_every_module_is_in_one_layer():
    for name in import_graph():
        layer_of(name)
    assert layer_of("ditrun.timers") < layer_of("ditrun.transport.collective") == layer_of("ditrun.cache.forward")
    assert layer_of("ditrun.results.rundir") < layer_of("ditrun.metrics.quality")


def test_each_layer_imports_only_from_itself_or_below():
    graph = import_graph()
    upward = {name: sorted(t for t in targets if layer_of(t) > layer_of(name)) for name, targets in graph.items()}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_the_kernels_import_nothing_from_the_model():
    graph = import_graph()
    reaching_up = {
        name: sorted(t for t in targets if t.startswith("ditrun.model"))
        for name, targets in graph.items()
        if name.startswith("ditrun.kernels")
    }
    assert {name: targets for name, targets in reaching_up.items() if targets} == {}


def test_the_model_does_not_reach_up_into_the_launch_metrics_or_workload():
    """``model/`` builds and runs the DiT; what a run decides (ranks, references, edits) is handed to it."""
    graph = import_graph()
    upward = ("ditrun.launch", "ditrun.metrics", "ditrun.workload", "ditrun.parallel", "ditrun.transport")
    reaching_up = {
        name: sorted(t for t in targets if t.startswith(upward))
        for name, targets in graph.items()
        if name.startswith("ditrun.model")
    }
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
    reaching = {
        name: sorted(n for n in _imports_anywhere(path) if n == "recipes" or n.startswith("recipes."))
        for name, path in module_names().items()
    }
    assert {name: found for name, found in reaching.items() if found} == {}
    recipe = PACKAGE.parent / "recipes" / "editor" / "train.py"
    assert "recipes.editor.config" in _imports_anywhere(recipe)  # the check reads what it should
