"""Recipe registry: names -> YAML files in ``recipes/`` (shipped in the wheel) or lazy
``"module:attr"`` targets, loaded into one validated ``config.Recipe``.

Precedence, lowest first: the recipe's source, dot-path overrides (``--set kda.cp_exchange=a2a``),
then ``SKYRL_KDA_CP_EXCHANGE`` (applied by ``config.apply_env_overrides``, the only env reader);
the config validates the result and ``recipe_rules`` applies the registries' rules;
``load_recipe`` then resolves every ``auto`` (``auto.resolve``) and returns the reasons beside
the recipe (``LoadedRecipe``): they are not settings.
Unknown keys are errors at every depth (``extra="forbid"``), named by their dotted path.

``register()`` adds the built-in recipes; it runs at import and is re-entrant, so the driver and
every Ray actor may call it again: re-registering the same target is a no-op, a different target
under a registered name raises.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from . import auto
from .config import DuplicateKey, Recipe, load_yaml, merge, parse_overrides
from .console import yaml_message
from .recipe_rules import load_recipe_dict

RECIPES_DIR = Path(str(files("skyrl_megatron_kda.builtin_recipes")))
"""Folder of the built-in YAML recipes: ``recipes/`` of the repository, shipped in the wheel as
the data package ``skyrl_megatron_kda.builtin_recipes``."""

BUILTIN_RECIPES: dict[str, str] = {
    "glm53_flash_1m": "glm53_flash_1m.yaml",
    "glm53_flash_tiny": "glm53_flash_tiny.yaml",
    "glm53_flash_slice": "glm53_flash_slice.yaml",
}
"""The recipes ``register()`` adds: name -> YAML file under ``RECIPES_DIR``."""

DEFAULT_RECIPE = "glm53_flash_tiny"
"""What ``skyrl-kda run`` trains when no recipe is named: the tiny recipe, which runs on a laptop
CPU (``skyrl-kda demo`` checks its KDA layer too)."""

_YAML_SUFFIXES = (".yaml", ".yml")
_REGISTRY: dict[str, str] = {}


def _is_yaml(source: str) -> bool:
    return source.endswith(_YAML_SUFFIXES)


def register_recipe(name: str, source: str) -> None:
    """Register ``source`` under ``name``: a YAML path (relative paths resolve against
    ``RECIPES_DIR``) or a lazy ``"module:attr"`` whose attribute is a dict or returns one.

    Nothing is read until the recipe is loaded. The same ``(name, source)`` again is a no-op; a
    different source under a registered name raises.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"recipe name must be a non-empty string, got {name!r}")
    if not isinstance(source, str) or not (_is_yaml(source) or _is_module_attr(source)):
        raise ValueError(
            f"recipe {name!r}: source {source!r} is neither a .yaml/.yml path nor 'module:attr'"
        )
    existing = _REGISTRY.get(name)
    if existing == source:
        return
    if existing is not None:
        raise ValueError(
            f"recipe {name!r} is already registered to {existing!r}; refusing {source!r} "
            "(pick another name)"
        )
    _REGISTRY[name] = source


def _is_module_attr(source: str) -> bool:
    module, sep, attr = source.partition(":")
    return bool(sep and module and attr) and ":" not in attr


def register() -> None:
    """Add the built-in recipes; safe to call any number of times, from any process."""
    for name, source in BUILTIN_RECIPES.items():
        register_recipe(name, source)


def _resolve_path(source: str) -> Path:
    path = Path(source).expanduser()
    return path if path.is_absolute() else RECIPES_DIR / path


def _read_yaml(path: Path) -> dict[str, Any]:
    """The mapping a recipe file holds. An empty file is refused, not read as ``{}``: every
    default is the full 320B model, which is never what an empty file was meant to say. A key
    given twice is refused naming it (``config.load_yaml``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"recipe file {path} does not exist") from None
    try:
        raw = load_yaml(text)
    except DuplicateKey as err:
        raise ValueError(f"recipe file {path}: {err}") from None
    except yaml.YAMLError as err:  # PyYAML names the stream "<unicode string>", not the file
        raise ValueError(f"recipe file {path}: {yaml_message(err)}") from None
    if raw is None:
        raise ValueError(f"recipe file {path} is empty (no settings); an empty recipe would mean "
                         "the full GLM-5.3-Flash model with every default")
    if not isinstance(raw, dict):
        raise ValueError(f"recipe file {path} must hold a mapping at top level, got {type(raw).__name__}")
    return raw


def _read_source(name: str, source: str) -> dict[str, Any]:
    if _is_yaml(source):
        return _read_yaml(_resolve_path(source))
    module_name, _, attr = source.partition(":")
    target = getattr(importlib.import_module(module_name), attr)
    raw = target() if callable(target) else target
    if not isinstance(raw, Mapping):
        raise ValueError(f"recipe {name!r}: {source} gave {type(raw).__name__}, expected a dict")
    return merge({}, dict(raw))  # a deep copy: the target's dict is never mutated


def raw_recipe(name: str) -> dict[str, Any]:
    """The registered recipe's unvalidated mapping, as its source gives it."""
    if name not in _REGISTRY:
        raise KeyError(
            f"no recipe named {name!r}; registered: {', '.join(sorted(_REGISTRY)) or 'none'}"
        )
    return _read_source(name, _REGISTRY[name])


def _build(label: str, raw: dict[str, Any], overrides: Sequence[str],
           environ: Mapping[str, str] | None) -> Recipe:
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    try:
        return load_recipe_dict(merge(raw, parse_overrides(list(overrides))), environ)
    except ValidationError as err:  # same errors, titled with the recipe they came from
        raise ValidationError.from_exception_data(f"recipe {label}", err.errors()) from None


def get_recipe(name: str, overrides: Sequence[str] = (),
               environ: Mapping[str, str] | None = None) -> Recipe:
    """The registered recipe ``name`` with ``overrides`` (``["kda.cp_exchange=a2a", ...]``) and
    the environment (``SKYRL_KDA_CP_EXCHANGE``; ``environ`` defaults to ``os.environ``) applied."""
    return _build(f"{name} ({_REGISTRY[name]})" if name in _REGISTRY else name,
                  raw_recipe(name), overrides, environ)


@dataclass(frozen=True)
class LoadedRecipe:
    """What ``load_recipe`` gives: the recipe ready to run and why ``auto`` picked its values."""

    recipe: Recipe
    """The recipe with every ``auto`` resolved."""
    choices: Mapping[str, str]
    """Setting (``model.dsa.kernel``, ``kda.cp_exchange``) -> the reason ``auto`` gave for its
    value (``auto.resolve``); only the settings the recipe left to ``auto``. The run folder records it beside
    ``recipe.yaml`` (``train.outputs.AUTO_CHOICES``)."""

    def choice_lines(self) -> list[str]:
        """``setting=auto -> reason``, one line per pick (what ``plan`` and ``run`` print)."""
        return [f"{setting}=auto -> {reason}" for setting, reason in self.choices.items()]


def load_recipe(name_or_path: str | Path, overrides: Sequence[str] = (),
                environ: Mapping[str, str] | None = None) -> LoadedRecipe:
    """A registered name, or a path to a YAML recipe file, loaded like ``get_recipe`` and ready
    to run: every setting left to ``auto`` (``auto.settings()``: ``model.dsa.kernel``,
    ``kda.cp_exchange``) is chosen here, once, after the overrides and the environment, and each
    pick's reason comes back beside the recipe. ``get_recipe`` leaves ``auto`` as written."""
    recipe, choices = auto.resolve(_load_as_written(str(name_or_path), overrides, environ))
    return LoadedRecipe(recipe, choices)


def _load_as_written(key: str, overrides: Sequence[str], environ: Mapping[str, str] | None) -> Recipe:
    if key in _REGISTRY:
        return get_recipe(key, overrides, environ)
    if _is_yaml(key):
        path = Path(key).expanduser()
        return _build(str(path), _read_yaml(path), overrides, environ)
    raise KeyError(
        f"{key!r} is neither a registered recipe ({', '.join(sorted(_REGISTRY)) or 'none'}) "
        "nor a .yaml/.yml file"
    )


def list_recipes() -> dict[str, str]:
    """Registered names -> their one-line ``description``, sorted by name."""
    return {name: str(raw_recipe(name).get("description", "")) for name in sorted(_REGISTRY)}


register()
