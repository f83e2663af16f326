"""Nested-dict helpers: dotted ``key=value`` overrides, a deep merge, and the dotted view of a
nested dict (``flatten`` / ``unflatten``)."""

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
            value = yaml.safe_load(text)
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
