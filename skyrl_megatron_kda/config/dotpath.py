"""Nested-dict helpers: dotted ``key=value`` overrides, a deep merge, the dotted view of a nested
dict (``flatten`` / ``unflatten``), and the one YAML reader of user text (``load_yaml``: a key
given twice in a mapping is refused, where PyYAML keeps the last silently)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml


def parse_overrides(pairs: list[str]) -> dict:
    """Turn ``["kda.cp_exchange=allgather", "parallel.tp=2"]`` into a nested dict.

    Values go through ``yaml.safe_load`` so ints, bools and lists keep their types; later pairs
    win over earlier ones for the same key. Unknown keys are left for the models to refuse.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"override {pair!r} is not of the form section.key=value")
        try:
            value = load_yaml(text)
        except DuplicateKey as err:
            raise ValueError(f"override {pair!r}: {key.strip()}.{err.path} is given twice; YAML "
                             "would keep the last silently: remove one") from None
        except yaml.YAMLError as err:
            raise ValueError(f"override {pair!r}: value is not valid YAML ({err})") from err
        node = out
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                prefix = ".".join(parts[: i + 1])
                raise ValueError(f"override {pair!r}: {prefix} was already set to a value")
        node[parts[-1]] = value
    return out


def merge(base: dict, overrides: dict) -> dict:
    """Deep-merge ``overrides`` into a copy of ``base``: mappings merge, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": 2}`` -> ``{"a.b": 1, "c": 2}``: every leaf by its dotted path (an
    empty mapping has none)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict:
    """The inverse of ``flatten``: ``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    out: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


class DuplicateKey(ValueError):
    """A YAML mapping gives one key twice: ``train.lr is given twice (lines 9 and 12)``."""

    def __init__(self, path: str, first: int, second: int):
        super().__init__(f"{path} is given twice (lines {first} and {second}); YAML would keep "
                         "the last silently: remove one")
        self.path = path


def load_yaml(text: str):
    """``yaml.safe_load(text)``, refusing a key given twice in one mapping at any depth
    (``DuplicateKey`` naming its dotted path and both lines). PyYAML keeps the last value
    silently: a second ``lr:`` would win, and a second ``train:`` section would replace the
    first whole, so a recipe would run with settings its file does not show."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, "")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, path: str) -> None:
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        dotted = f"{path}.{name}" if path else str(name)
        if name is not None and key.tag != "tag:yaml.org,2002:merge":
            if name in seen:
                raise DuplicateKey(dotted, seen[name], key.start_mark.line + 1)
            seen[name] = key.start_mark.line + 1
        _refuse_duplicate_keys(value, dotted)
