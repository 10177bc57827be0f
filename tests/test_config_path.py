"""Where the run's config goes: follow it from the engine builder (training/step.py build_engine, its `cfg` and the
resolved `run` that holds it) through every call that passes it on (the whole config, a section of it such as
`cfg.model`, or a name bound to either), read from the source with `ast`, and count the calls that cross from a
package back up to a higher one in test_structure.PACKAGE_ORDER. Such a call means lower code reaches back into
code that owns the run (issue 40 counted 20 of them, 18 the turn before); the package order now allows almost none.

What it follows: calls whose callee it can resolve statically (a function of the same module, one imported by
name, or `module.function` through an imported module); a parameter that receives the config becomes tracked in
the callee. Method calls on objects and callbacks are not followed (a reader following the config would not see
them either without running the code)."""
from __future__ import annotations

import ast
import os

from test_structure import PACKAGE, layer_of, package_sources

START = ("ulysses_train.training.step", "build_engine", {"cfg": "config", "run": "holder"})
MOST_CROSSINGS = 6
"""The issue's target: at most this many calls on the config's path cross back up to a higher package."""


def _dotted(name: str) -> str:
    """A module's dotted name from its path in the repository (test_structure.package_sources' keys); a dotted
    name stays as it is."""
    return name[:-3].replace(os.sep, ".").removesuffix(".__init__") if name.endswith(".py") else name


class Program:
    """The package's functions and each module's imported names, from `sources` (module name -> source)."""

    def __init__(self, sources: dict):
        self.functions, self.imports = {}, {}
        sources = {_dotted(name): source for name, source in sources.items()}
        for module, source in sources.items():
            tree = ast.parse(source)
            self.functions[module] = {node.name: node for node in tree.body
                                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
            self.imports[module] = {}
        for module, source in sources.items():
            for node in ast.walk(ast.parse(source)):
                self._record_import(module, node)

    def _record_import(self, module: str, node) -> None:
        names = self.imports[module]
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names[alias.asname or alias.name] = (full, None) if full in self.functions else (node.module,
                                                                                                 alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in self.functions and alias.asname:
                    names[alias.asname] = (alias.name, None)

    def resolve(self, module: str, func) -> tuple | None:
        """(module, function name) a call's callee expression names, or None where it is not a package function."""
        if isinstance(func, ast.Name):
            if func.id in self.functions[module]:
                return module, func.id
            target = self.imports[module].get(func.id)
            if target and target[1] and target[1] in self.functions.get(target[0], {}):
                return target
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = self.imports[module].get(func.value.id)
            if target and target[1] is None and func.attr in self.functions.get(target[0], {}):
                return target[0], func.attr
        return None


def _chain(expr) -> tuple:
    """(root name, attribute names) of `a.b.c`; (None, ()) for anything else."""
    attrs = []
    while isinstance(expr, ast.Attribute):
        attrs.insert(0, expr.attr)
        expr = expr.value
    return (expr.id, tuple(attrs)) if isinstance(expr, ast.Name) else (None, ())


def _kind(expr, names: dict):
    """"config" for the config or a section of it, "holder" for the resolved run that holds it (its `.cfg` is the
    config; its other fields, such as the transformers config, are not), else None."""
    root, attrs = _chain(expr)
    kind = names.get(root)
    if kind == "holder":
        return "holder" if not attrs else "config" if attrs[0] == "cfg" else None
    return kind


def _bound_names(function, names: dict) -> dict:
    """`names` plus every name the function binds to one of them (`cfg = run.cfg`, `m = cfg.model`, and the same
    inside tuple assignments), until nothing more is bound."""
    names = dict(names)
    while True:
        before = len(names)
        for node in ast.walk(function):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                names |= {t.id: _kind(v, names) for t, v in pairs if isinstance(t, ast.Name) and _kind(v, names)}
        if len(names) == before:
            return names


def _receiving_parameters(callee, call, names: dict) -> dict:
    """The callee's parameters that this call hands the config (or its holder), with the kind each receives."""
    params = [a.arg for a in callee.args.posonlyargs + callee.args.args]
    given = {params[i]: _kind(arg, names) for i, arg in enumerate(call.args) if i < len(params)}
    given |= {k.arg: _kind(k.value, names) for k in call.keywords if k.arg}
    return {name: kind for name, kind in given.items() if kind}


def config_path(sources: dict, start=START) -> list:
    """Every call on the config's path: (caller module, caller, callee module, callee), each once."""
    program, calls = Program(sources), []
    seen, todo = set(), [(start[0], start[1], tuple(sorted(start[2].items())))]
    while todo:
        module, name, params = todo.pop()
        if (module, name, params) in seen:
            continue
        seen.add((module, name, params))
        function = program.functions[module][name]
        names = _bound_names(function, dict(params))
        for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
            target = program.resolve(module, call.func)
            if target is None:
                continue
            receiving = _receiving_parameters(program.functions[target[0]][target[1]], call, names)
            if receiving:
                calls.append((module, name, *target))
                todo.append((*target, tuple(sorted(receiving.items()))))
    return sorted(set(calls))


def crossings_back_up(calls: list) -> list:
    """The calls whose callee's package sits higher in PACKAGE_ORDER than the caller's."""
    return [c for c in calls if layer_of(c[2]) > layer_of(c[0])]


def test_the_config_path_crosses_back_up_at_most_six_times():
    calls = config_path(package_sources())
    modules = {c[2] for c in calls} | {START[0]}
    up = crossings_back_up(calls)
    print(f"config path: {len(calls)} calls into {len(modules)} modules; {len(up)} cross back up: {up}")
    assert len(modules) > 5  # it was followed (the model builder, the loader, the planner ...)
    assert ("ulysses_train.training.step", "build_engine", "ulysses_train.model.transform",
            "build_long_context_model") in calls
    assert len(up) <= MOST_CROSSINGS, up


def test_a_planted_call_back_up_is_counted():
    """Negative control: model code that hands the config to a trainer function (the kind of call the count is
    for) is found, through a name bound to a section of it; a call that passes no config is not followed."""
    sources = {
        "ulysses_train.training.step": "from ulysses_train.model.transform import build\n"
                                       "def build_engine(cfg, run=None):\n    unrelated_too(run.hf_config)\n    return build(run.cfg, 3)\n"
                                       "def unrelated_too(hf_config):\n    return hf_config\n",
        "ulysses_train.model.transform": "from ulysses_train.training import loop\n"
                                         "from ulysses_train.training.loop import unrelated\n"
                                         "def build(config, n):\n    section = config.model\n"
                                         "    unrelated(n)\n    return loop.levers(section)\n",
        "ulysses_train.training.loop": "def levers(model_cfg):\n    return model_cfg\n"
                                       "def unrelated(n):\n    return n\n",
    }
    calls = config_path(sources)
    assert crossings_back_up(calls) == [("ulysses_train.model.transform", "build", "ulysses_train.training.loop",
                                         "levers")]
    assert not any(c[3] in ("unrelated", "unrelated_too") for c in calls)
