"""The package's modules import each other without cycles (function-level imports included: a lazy import hides a
cycle from Python, not from a reader), found on the source with `ast`, with a negative control."""
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
