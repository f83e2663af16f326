"""The CP exchanges of the KDA layer, by name: the one registry that ``kda.cp_exchange`` is
validated against, ``auto`` chooses from and the layer builds from.

Adding an exchange is one module with a ``CPExchange`` subclass and one ``register`` line here (or
a ``register`` call in a plugin). Registration order is the cost model's order of preference on
a tie, after exact ones.
"""

from __future__ import annotations

from .a2a import A2AExchange
from .allgather import AllGatherExchange
from .base import ComputeRows, CPExchange, ExchangeGroups, KernelArgs, Projection, section_widths
from .ledger import CommLedger
from .shape import ExchangeMesh, ExchangeShape
from .state import StateExchange

AUTO = "auto"
"""The ``kda.cp_exchange`` value that lets the cost model pick a registered exchange."""

_REGISTRY: dict[str, type[CPExchange]] = {}


def register(cls: type[CPExchange]) -> type[CPExchange]:
    """Add ``cls`` under ``cls.name`` (the same class again is a no-op); returns it, so it also
    works as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, CPExchange)):
        raise TypeError(f"{cls!r} is not a CPExchange subclass")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"{cls.__name__}.name={name!r}: an exchange needs its own non-empty name "
                         f"(not {AUTO!r})")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"cp_exchange {name!r} is already registered to {existing.__name__}")
    _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the exchange registered under ``name`` (a plugin's or a test's)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered exchanges, in registration order."""
    return tuple(_REGISTRY)


def exact_names() -> tuple[str, ...]:
    """The registered exchanges equal to CP=1 up to fp32 summation order."""
    return tuple(name for name, cls in _REGISTRY.items() if cls.exact)


def get(name: str) -> type[CPExchange]:
    """The exchange class registered under ``name``."""
    if name == AUTO:
        raise ValueError("kda.cp_exchange=auto is not resolved: resolve it when the recipe is "
                         "loaded (recipes.load_recipe, or kda.cost.resolve_cp_exchange)")
    if name not in _REGISTRY:
        raise ValueError(f"unknown cp_exchange {name!r}; expected one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


register(A2AExchange)
register(AllGatherExchange)
register(StateExchange)

__all__ = [
    "AUTO", "A2AExchange", "AllGatherExchange", "CPExchange", "CommLedger", "ComputeRows",
    "ExchangeGroups", "ExchangeMesh", "ExchangeShape", "KernelArgs", "Projection", "StateExchange",
    "section_widths",
    "exact_names", "get", "names", "register", "unregister",
]
