"""Reading what a user typed: YAML files and `--set` overrides (strict: duplicate keys are errors), local paths
told apart from hub names, and library messages quoted on one line. No knowledge of the config's schema:
config.py owns that."""
from __future__ import annotations

import copy
import os
import reprlib
from typing import Optional

import yaml

from ulysses_train.errors import ConfigError


def one_line(err: BaseException) -> str:
    """A library's exception text on one line without its final period, to quote inside our own message."""
    return " ".join(str(err).split()).rstrip(".")


def looks_like_local_path(name_or_path: str) -> bool:
    """Is `name_or_path` meant as a local file or folder rather than a hub id (`org/name`)?

    Yes when it starts with /, . or ~, or has more than one path separator (a hub id has at most one), or
    ends with one. `models/run1` is ambiguous: it counts as local only when it exists (see `missing_local_path`
    and `partial_local_path_note`).
    """
    text = os.fspath(name_or_path)
    separators = text.count("/") + (text.count(os.sep) if os.sep != "/" else 0)
    return text.startswith(("/", ".", "~")) or separators > 1 or text.endswith(("/", os.sep))


def _deepest_existing(path: str) -> str:
    parent = path
    while parent and not os.path.exists(parent):
        up = os.path.dirname(parent.rstrip(os.sep))
        if up == parent:
            return ""
        parent = up
    return parent


def missing_local_path(name_or_path: str) -> Optional[str]:
    """Why a path-looking `name_or_path` names nothing here: e.g. "the folder '/data/m/qwen' does not exist
    ('/data/m' exists, without 'qwen')"; None when it exists or looks like a hub id. Shared by the trainer
    (model.name_or_path, data.tokenizer) and scripts/plan.py (--model), each wrapping it in its own error."""
    text = os.fspath(name_or_path)
    path = os.path.expanduser(text)
    if os.path.exists(path) or not looks_like_local_path(text):
        return None
    found = _deepest_existing(os.path.abspath(path))
    where = ""
    if found:
        missing = os.path.relpath(os.path.abspath(path), found).split(os.sep)[0]
        where = (f" ({found!r} is a file, not a folder)" if os.path.isfile(found) else
                 f" ({found!r} exists, without {missing!r})")
    return f"the local path {text!r} does not exist{where}"


def partial_local_path_note(name_or_path: str) -> str:
    """For a hub-style `org/name` whose `org` is a local folder: a note (for an error message) that it was read
    as a hub id because the local path is incomplete; '' otherwise."""
    text = os.fspath(name_or_path)
    head = text.split("/")[0]
    if text.count("/") == 1 and not looks_like_local_path(text) and not os.path.exists(text) and os.path.isdir(head):
        return (f" Note: the local folder {head!r} exists but holds no {text.split('/', 1)[1]!r}, so {text!r} was "
                f"read as a hub name; write ./{text} to mean the local path.")
    return ""


def brief(value, limit: int = 80) -> str:
    """`value`'s repr for an error message, at most about `limit` characters, computed without building the whole
    text (reprlib stops after a few items per level): a huge or deeply nested value stays a short quote."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    short.maxlevel, short.maxlist, short.maxdict, short.maxtuple, short.maxset = 3, 6, 6, 6, 6
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


MAX_YAML_VALUES = 10_000
"""The most values a config (or one --set value) may hold once its aliases are expanded. Real configs hold a few
hundred; an alias bomb ("billion laughs": a few hundred bytes of nested aliases) holds billions, and anything that
walks the expanded value (a copy, a comparison, an error message quoting it) runs out of memory."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that rejects duplicate keys (the second silently wins in plain YAML) and documents whose
    aliases expand past MAX_YAML_VALUES."""

    def compose_document(self):
        node = super().compose_document()
        if _expanded_size(node, {}, set()) > MAX_YAML_VALUES:
            raise ConfigError(f"its aliases (*name) expand to more than {MAX_YAML_VALUES:,} values, far more than a "
                              f"run config holds (an alias bomb?); write the values out, or use fewer aliases.")
        return node


def _expanded_size(node, sizes: dict, open_nodes: set) -> int:
    """Values in `node` with every alias expanded, counted once per node object (aliases share the node they
    name), so a bomb is measured without being expanded. A node inside itself counts as too many."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        return MAX_YAML_VALUES + 1
    open_nodes.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_size(child, sizes, open_nodes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_size(k, sizes, open_nodes) + _expanded_size(v, sizes, open_nodes)
                     for k, v in node.value)
    open_nodes.discard(key)
    sizes[key] = total = min(total, MAX_YAML_VALUES + 1)
    return total


def _construct_unique_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"duplicate key '{key}' at line {key_node.start_mark.line + 1}.")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def read_yaml(path: str) -> dict:
    if os.path.isdir(path):
        yamls = sorted(n for n in os.listdir(path) if n.endswith((".yaml", ".yml")))
        example = f", e.g. {os.path.join(path, yamls[0])}" if yamls else ""
        raise ConfigError(f"config file {path!r} is a folder. Fix: give one YAML file{example}.")
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist.")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} is not a regular file (a device or a pipe). Fix: give a YAML file.")
    try:
        with open(path) as fh:
            data = yaml.load(fh, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path!r} is not valid YAML: {one_line(err)}.") from None
    except ConfigError as err:
        raise ConfigError(f"config file {path!r}: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path!r} is not text (UTF-8): {one_line(err)}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must be a YAML mapping of sections (model:, data:, train:, ...), "
                          f"but its content is {type(data).__name__} {brief(data, 60)}.")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` strings; the value is parsed as YAML (so 10 is an int, true a bool)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=10.")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override {item!r} must name a section and a key, e.g. train.steps=10.")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{part}' is not a section.")
        try:
            node[parts[-1]] = yaml.load(raw, Loader=_UniqueKeyLoader)
        except yaml.YAMLError:
            node[parts[-1]] = raw
        except ConfigError as err:
            raise ConfigError(f"override {dotted.strip()}=...: {err}") from None
    return data


def deep_update(target: dict, source: dict) -> None:
    """Merge `source` into `target`, copying: later overrides must never write into the defaults given."""
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            deep_update(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def nearest_multiples(value: int, multiple: int) -> str:
    """'1,008 or 992': the multiples of `multiple` around `value` (only the upper one when the lower is 0)."""
    down = value // multiple * multiple
    up = down + multiple
    return f"{up:,}" + (f" or {down:,}" if down else "")
