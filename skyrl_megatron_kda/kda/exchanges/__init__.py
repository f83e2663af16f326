"""The CP exchanges of the KDA layer, by name: the one registry that ``kda.cp_exchange`` is
validated against, ``auto`` chooses from and the layer builds from.

Adding an exchange is one module with a ``CPExchange`` subclass and one ``register`` line here (or
a ``register`` call in a plugin). Registration order is the cost model's order of preference on
a tie, after exact ones.
"""

from __future__ import annotations

from ...registry import AUTO, Registry
from .a2a import A2AExchange
from .allgather import AllGatherExchange
from .base import ComputeRows, CPExchange, ExchangeGroups, KernelArgs, Projection, section_widths
from .ledger import CommLedger
from .shape import ExchangeMesh, ExchangeShape
from .state import StateExchange

REGISTRY = Registry(CPExchange, "kda.cp_exchange", "recipes.load_recipe")
register, unregister, names, get = REGISTRY.register, REGISTRY.unregister, REGISTRY.names, REGISTRY.get


def exact_names() -> tuple[str, ...]:
    """The registered exchanges equal to CP=1 up to fp32 summation order."""
    return tuple(name for name, cls in REGISTRY.items() if cls.exact)


def refusals(mesh: ExchangeMesh) -> dict[str, str]:
    """Why each registered exchange cannot run on ``mesh`` (absent: it can): each exchange's own
    ``refusal`` rule, the one the recipe rules, the cost model of ``auto`` and the layer ask."""
    return {name: why for name, cls in REGISTRY.items() if (why := cls.refusal(mesh)) is not None}


def allowed(mesh: ExchangeMesh) -> tuple[str, ...]:
    """The registered exchanges that ``auto`` may pick on ``mesh``, in registration order;
    refused (``ValueError``) where every one is refused."""
    refused = refusals(mesh)
    names_ = tuple(name for name in REGISTRY.names() if name not in refused)
    if not names_:
        raise ValueError("kda.cp_exchange=auto has no exchange to pick: "
                         + "; ".join(f"{name}: {why}" for name, why in refused.items()))
    return names_


register(A2AExchange)
register(AllGatherExchange)
register(StateExchange)

__all__ = [
    "AUTO", "REGISTRY", "A2AExchange", "AllGatherExchange", "CPExchange", "CommLedger", "ComputeRows",
    "ExchangeGroups", "ExchangeMesh", "ExchangeShape", "KernelArgs", "Projection", "StateExchange",
    "section_widths",
    "allowed", "exact_names", "get", "names", "refusals", "register", "unregister",
]
