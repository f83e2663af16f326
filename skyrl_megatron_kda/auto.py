"""The settings a recipe may leave to ``auto``, and the one resolver that picks them.

An ``AutoSetting`` is a dotted key and a chooser: given the checked recipe it returns the value
to run and a one-line reason. ``resolve`` applies every registered setting that the recipe left
to ``auto``, in registration order (a later chooser sees the earlier choices), checks the recipe
again with the registries' rules (``recipe_rules``) and returns the reasons beside it.
``recipes.load_recipe`` calls it once, where a recipe is loaded to run; the run folder records
the reasons. Adding an ``auto`` setting (the MoE dispatcher, say) is one chooser and one
``register`` call; ``tests/test_auto.py`` proves it with a toy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import ValidationError

from .config import MeshRecipe, Recipe, merge, unflatten
from .dsa import kernels as dsa_kernels
from .kda.cost import choose
from .recipe_rules import checked
from .registry import AUTO

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=MeshRecipe)


@dataclass(frozen=True)
class AutoSetting:
    """One setting that ``auto`` may choose."""

    key: str
    """The dotted setting (``kda.cp_exchange``)."""
    choose: Callable[[MeshRecipe], tuple[str, str]]
    """(value, one-line reason) for a recipe whose ``key`` is ``auto``; refuses (``ValueError``)
    where no value suits the recipe."""
    needs: type[MeshRecipe] = MeshRecipe
    """The recipe class that holds what ``choose`` reads: a setting that reads ``run.device``
    needs a whole ``Recipe`` and stays ``auto`` on a ``MeshRecipe`` (whose registry then refuses
    it where it is used)."""


_SETTINGS: dict[str, AutoSetting] = {}


def register(setting: AutoSetting) -> AutoSetting:
    """Add ``setting`` (the same one again is a no-op; another under its key raises)."""
    existing = _SETTINGS.get(setting.key)
    if existing is not None and existing != setting:
        raise ValueError(f"an auto setting for {setting.key} is already registered")
    _SETTINGS[setting.key] = setting
    return setting


def unregister(key: str) -> None:
    """Remove the setting registered under ``key`` (a plugin's or a test's)."""
    _SETTINGS.pop(key, None)


def settings() -> tuple[AutoSetting, ...]:
    """The registered settings, in the order ``resolve`` applies them."""
    return tuple(_SETTINGS.values())


def value_at(recipe: MeshRecipe, key: str):
    """The value of the dotted setting ``key`` in ``recipe``."""
    node = recipe
    for part in key.split("."):
        node = getattr(node, part)
    return node


def resolve(recipe: R) -> tuple[R, dict[str, str]]:
    """``recipe`` with every registered setting it leaves to ``auto`` chosen, and setting ->
    reason for those (logged too). Each choice is checked as if the recipe had named it:
    refused with ``{key}=auto picks {value}; {why}`` where a rule objects."""
    choices: dict[str, str] = {}
    for setting in _SETTINGS.values():
        if not isinstance(recipe, setting.needs) or value_at(recipe, setting.key) != AUTO:
            continue
        value, reason = setting.choose(recipe)
        recipe = _with_value(recipe, setting.key, value)
        logger.info("%s=auto -> %s", setting.key, reason)
        choices[setting.key] = reason
    return recipe, choices


def _with_value(recipe: R, key: str, value: str) -> R:
    # Only what the recipe set is dumped, so the settings whose default follows another one
    # (``recipe_rules.kernel_split``) follow the choice.
    raw = merge(recipe.model_dump(exclude_unset=True), unflatten({key: value}))
    try:
        return checked(type(recipe).model_validate(raw))
    except ValidationError as err:
        raise ValueError(f"{key}=auto picks {value}; {err.errors()[0]['msg']}") from None
    except ValueError as err:
        raise ValueError(f"{key}=auto picks {value}; {err}") from None


def _dsa_kernel(recipe: Recipe) -> tuple[str, str]:
    device = recipe.run.device
    name = dsa_kernels.resolve(AUTO, device)
    return name, f"{name}: the first registered kernel that run.device={device} does not refuse"


def _cp_exchange(recipe: MeshRecipe) -> tuple[str, str]:
    name, reason, _ = choose(recipe)
    return name, reason


register(AutoSetting("model.dsa.kernel", _dsa_kernel, needs=Recipe))
register(AutoSetting("kda.cp_exchange", _cp_exchange))
