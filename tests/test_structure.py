"""The package's shape, read from its source with `ast`: modules import each other without cycles (function-level
imports included: a lazy import hides a cycle from Python, not from a reader), packages import only downward in
PACKAGE_ORDER, no module reaches 400 lines and no function 60 (in the package, its scripts, benchmarks and tests);
each check with a negative control."""
import ast
import os

from helpers import REPO

PACKAGE = "ulysses_train"


def module_imports() -> dict:
    """module name -> the package modules it imports, anywhere in its source."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(REPO, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                modules[dotted] = path
    graph = {}
    for dotted, path in modules.items():
        with open(path) as fh:
            tree = ast.parse(fh.read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                targets |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[dotted] = sorted(t for t in targets if t in modules and t != dotted)
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_in_the_package():
    assert cycles(module_imports()) == []


def test_the_cycle_check_finds_a_lazy_import_cycle():
    """Negative control: the graph the package had (config -> data.form -> config, config -> model.lora (lazily)
    -> config) is a cycle, and a chain is not."""
    graph = {"config": ["form", "lora"], "form": ["config"], "lora": ["config"], "a": ["b"], "b": []}
    assert cycles(graph) == [["config", "form", "lora"]]
    assert cycles({"a": ["b"], "b": ["c"], "c": []}) == []


PACKAGE_ORDER = (("errors", "constants", "device", "user_input", "sequence_parallel", "kernel_pins", "families"),
                 ("data",), ("config", "config_checks", "probe_config", "lever_keys", "lora_keys"), ("model",),
                 ("parallel",), ("planner",), ("diagnostics",), ("training",), ("cli",))
"""Layers, lowest first (a top-level module or a subpackage of ulysses_train each): a module may import from its
own layer or a lower one. docs/design.md says the same order."""

def layer_of(module: str) -> int:
    name = module.split(".")[1]
    return next(i for i, layer in enumerate(PACKAGE_ORDER) if name in layer)


def climbing_imports(graph: dict) -> set:
    """(importer, imported) pairs whose imported module sits in a higher layer than the importer."""
    return {(a, b) for a, targets in graph.items() for b in targets if layer_of(a) < layer_of(b)}


def test_packages_import_only_downward():
    graph = module_imports()
    unplaced = sorted({m.split(".")[1] for m in graph if "." in m} - {n for layer in PACKAGE_ORDER for n in layer})
    assert not unplaced, f"place these in PACKAGE_ORDER: {unplaced}"
    assert climbing_imports(graph) == set()  # no exception list: every import goes down the order


def test_the_order_check_finds_an_import_that_climbs():
    """Negative control: the model importing the trainer's loss (as model.loading once did) is found; the reverse
    is not."""
    graph = {"ulysses_train.model.loading": ["ulysses_train.training.loss"], "ulysses_train.training.step":
             ["ulysses_train.model.loading"]}
    assert climbing_imports(graph) == {("ulysses_train.model.loading", "ulysses_train.training.loss")}


MODULE_LINES, FUNCTION_LINES = 400, 60


def size_problems(sources: dict) -> list:
    """Modules of MODULE_LINES lines or more and functions of more than FUNCTION_LINES, in {path: source}."""
    problems = []
    for path, source in sorted(sources.items()):
        lines = source.count("\n") + (not source.endswith("\n"))
        if lines >= MODULE_LINES:
            problems.append(f"{path}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    problems.append(f"{path}: {node.name} has {length} lines")
    return problems


def python_sources(*folders: str) -> dict:
    """{path relative to the repository: source} of every .py file under these folders of the repository."""
    sources = {}
    for top in folders:
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name)) as fh:
                        sources[os.path.relpath(os.path.join(folder, name), REPO)] = fh.read()
    return sources


def package_sources() -> dict:
    return python_sources(PACKAGE)


def test_modules_and_functions_stay_small():
    assert size_problems(package_sources()) == []
    # the command-line scripts, the benchmark tools and the tests keep to the same sizes
    assert size_problems(python_sources("scripts", "benchmarks", "tests")) == []


def test_the_size_check_finds_a_long_module_and_a_long_function():
    long_function = "def f():\n" + "    x = 1\n" * 61
    assert size_problems({"a.py": "x = 1\n" * 400, "b.py": long_function, "c.py": "x = 1\n" * 399}) == [
        "a.py: 400 lines", "b.py: f has 62 lines"]
