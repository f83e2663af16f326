"""The recipe rules that ask a registry: which names ``kda.cp_exchange`` and ``model.dsa.kernel``
may take, whether the exchange can run on the mesh (``CPExchange.refusal``), whether the DSA
kernel runs on the device, attends by rows (``DSAKernel.refusal``, ``splits_rows``) and reads
the options the recipe sets (``DSAKernel.options``), and what a packed row's length must divide
by under ``parallel.cp_layout`` (the layout kind's row rule), and what megatron's MoE token
dispatchers need of the mesh, the device and the installed packages (``model.moe.dispatcher``).

They live here, not in ``config``: the rules are the strategies' own, whose modules import torch
and megatron-core, and ``config`` imports nothing above it. Every recipe made to run or plan
passes through here: ``load_mesh_recipe`` and ``load_recipe_dict`` (``recipes.get_recipe`` and
``recipes.load_recipe`` build on them) validate a raw mapping and then apply the rules, and the
model build asks ``check`` again for a recipe made another way. A broken rule is one
``ValueError`` line naming the setting.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TypeVar

from .config import (
    KERNEL_OPTIONS,
    DSAConfig,
    MeshRecipe,
    ParallelConfig,
    Recipe,
    apply_env_overrides,
)
from .config.base import ConfigSection
from .distributed.cp_layout import layout_kind
from .dsa import kernels as dsa_kernels
from .kda import exchanges
from .kda.exchanges import ExchangeMesh
from .registry import AUTO

R = TypeVar("R", bound=MeshRecipe)


def load_mesh_recipe(raw: dict, environ: Mapping[str, str] | None = None) -> MeshRecipe:
    """The model on its mesh from ``raw``: ``SKYRL_KDA_CP_EXCHANGE`` applied (``environ``
    defaults to ``os.environ``), validated by the config, then the registries' rules."""
    return _validated(MeshRecipe, raw, environ)


def load_recipe_dict(raw: dict, environ: Mapping[str, str] | None = None) -> Recipe:
    """A whole recipe from ``raw``, as ``load_mesh_recipe`` (``recipes.load_recipe`` reads the
    files and applies ``--set`` overrides first, and resolves ``auto`` after)."""
    return _validated(Recipe, raw, environ)


def _validated(cls: type[R], raw: dict, environ: Mapping[str, str] | None) -> R:
    raw = apply_env_overrides(raw, exchanges.REGISTRY.choices(), environ)
    return checked(cls.model_validate(raw))


def checked(recipe: R) -> R:
    """``recipe`` (validated by the config) with the defaults that follow the DSA kernel
    completed (``with_kernel_split``), if it keeps every rule here (``check``)."""
    return check(with_kernel_split(recipe))


def with_kernel_split(recipe: R) -> R:
    """``recipe`` with its DSA section's split completed (``kernel_split``)."""
    dsa = kernel_split(recipe.model.dsa)
    if dsa is recipe.model.dsa:
        return recipe
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"dsa": dsa})})


def kernel_split(dsa: DSAConfig) -> DSAConfig:
    """``dsa`` with ``tp_split`` set to heads where the recipe leaves it unset and the kernel
    cannot attend by rows: each kernel's default split is one it can run (sequence, the field's
    default, for the others)."""
    if ("tp_split" in dsa.model_fields_set or dsa.kernel not in dsa_kernels.names()
            or dsa_kernels.get(dsa.kernel).splits_rows):
        return dsa
    return dsa.model_copy(update={"tp_split": "heads"})


def check(recipe: R) -> R:
    """``recipe`` if it keeps every rule here, else the first broken rule's ``ValueError``. A
    whole ``Recipe`` is also checked against its device; ``auto`` passes while any registered
    choice could run."""
    _check_exchange(recipe)
    check_dsa(recipe.model.dsa)
    _check_rows(recipe)
    _check_dispatcher(recipe)
    if isinstance(recipe, Recipe):
        _check_dsa_device(recipe)
    return recipe


def _check_dispatcher(recipe: MeshRecipe) -> None:
    # megatron's flex dispatcher with its DeepEP backend (0.19.2's default) asserts more than one
    # rank in its EP x ETP group, imports deep_ep when the layer is built and runs CUDA kernels:
    # refused here rather than after Ray has started.
    if recipe.model.moe.dispatcher != "flex":
        return
    p = recipe.parallel
    if p.ep * p.etp == 1:
        raise ValueError(f"model.moe.dispatcher=flex needs parallel.ep * parallel.etp > 1 "
                         f"(DeepEP exchanges rows between the ranks of the EP x ETP group; here "
                         f"{p.ep} * {p.etp} = 1): set model.moe.dispatcher=alltoall")
    if isinstance(recipe, Recipe) and recipe.run.device != "gpu":
        raise ValueError(f"model.moe.dispatcher=flex needs run.device=gpu (DeepEP's kernels are "
                         f"CUDA; run.device={recipe.run.device}): set model.moe.dispatcher=alltoall")
    if not deep_ep_importable():
        raise ValueError("model.moe.dispatcher=flex needs the deep_ep package (DeepEP), which "
                         "this Python cannot import: install DeepEP or set "
                         "model.moe.dispatcher=alltoall")


def deep_ep_importable() -> bool:
    """Whether ``deep_ep`` (DeepEP, what megatron's flex dispatcher imports) is installed."""
    return importlib.util.find_spec("deep_ep") is not None


def dispatch_rows_can_differ(parallel: ParallelConfig) -> bool:
    """Whether the ranks of one MoE dispatch group (EP x ETP) can hold different numbers of rows
    when each data-parallel replica packs its own micro-batch to its own length (SkyRL's RL
    path). megatron orders ranks TP, CP, then DP for the dense layers and ETP, EP, then expert
    DP for the experts, both outermost in PP, so an EP x ETP group lies inside one TP x CP
    replica (whose ranks hold equal rows) exactly when its size divides the replica's."""
    group, replica = parallel.ep * parallel.etp, parallel.tp * parallel.cp
    return group > 1 and replica % group != 0


def _check_exchange(recipe: MeshRecipe) -> None:
    # Each exchange's own rule (``CPExchange.refusal``), the one the cost model and the layer
    # ask too; auto needs one exchange that no rule refuses.
    name = exchanges.REGISTRY.check(recipe.kda.cp_exchange)
    mesh = ExchangeMesh.of(recipe)
    if name == AUTO:
        exchanges.allowed(mesh)
    elif (why := exchanges.refusals(mesh).get(name)) is not None:
        raise ValueError(f"kda.cp_exchange={name} is refused on this mesh: {why}")


def check_dsa(dsa: DSAConfig) -> DSAConfig:
    """``dsa`` if its kernel is registered (or ``auto``), can run its ``tp_split`` and no other
    kernel's options section differs from its defaults, else the ``ValueError`` naming the
    setting."""
    name = dsa_kernels.REGISTRY.check(dsa.kernel)
    if name == AUTO:  # checked again once auto has picked (auto.resolve)
        return dsa
    kernel = dsa_kernels.get(name)
    if dsa.tp_split == "sequence" and not kernel.splits_rows:
        splitting = [n for n, cls in dsa_kernels.REGISTRY.items() if cls.splits_rows]
        names = ", ".join(splitting[:-1]) + " or " + splitting[-1] if len(splitting) > 1 else splitting[0]
        raise ValueError(f"model.dsa.tp_split=sequence needs model.dsa.kernel "
                         f"{names}: the {name} kernel attends with "
                         "whole-sequence keys per head")
    # Each kernel reads its own section only: another's, set, would be accepted and ignored.
    for section in KERNEL_OPTIONS:
        changed = _changed_options(getattr(dsa, section))
        if section != kernel.options and changed:
            raise ValueError(f"model.dsa.{section}.{changed[0]} applies to the {section} kernel "
                             f"only, and model.dsa.kernel={name}: set model.dsa.kernel={section} "
                             f"or leave model.dsa.{section} at its defaults")
    return dsa


def _changed_options(options: ConfigSection) -> list[str]:
    """``option=value`` for each option of a kernel section that differs from its default."""
    defaults = type(options)()
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in options if value != getattr(defaults, key)]


def _check_rows(recipe: MeshRecipe) -> None:
    seq_len, cp = recipe.data.seq_len, recipe.parallel.cp
    kind = layout_kind(recipe.parallel.cp_layout)
    # At cp=1 nothing is split, so any length works (tiny CPU tests use odd ones).
    if cp > 1 and seq_len % kind.row_multiple(cp):
        raise ValueError(f"data.seq_len={seq_len} must be divisible by {kind.row_rule(cp)}")


def _check_dsa_device(recipe: Recipe) -> None:
    name = recipe.model.dsa.kernel
    if name != AUTO:
        why = dsa_kernels.get(name).refusal(recipe.run.device)
        if why is not None:
            raise ValueError(why)
