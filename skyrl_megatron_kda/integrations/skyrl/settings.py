"""Which of SkyRL's settings decide the recipe a KDA worker builds, and which are refused.

Under SkyRL the recipe decides the model and the mesh; SkyRL's own fields decide what a SkyRL
user sets for any backend: the weights (``trainer.policy.model.path``, an HF folder, unless the
recipe names ``run.init_from_hf``), the optimizer and its schedule
(``trainer.policy.optimizer_config``: SkyRL's Megatron backend only has ``constant_with_warmup``,
so the LR is constant after the warm-up), ``num_training_steps``, the seed, the dtype
(``trainer.bf16``) and LoRA (``trainer.policy.model.lora`` -> ``train.lora``).
``decided_settings`` lists each of those as recipe key <- SkyRL setting; ``apply_decided``
writes them into the recipe. A ``trainer.kda.overrides`` key that SkyRL decides
is an error, so nothing is set in two places.

SkyRL settings the KDA workers do not implement are refused by name (``refused_settings``), never
dropped. ``cp_exchange_source`` says where ``kda.cp_exchange`` came from: the command line
(``trainer.kda.cp_exchange`` / ``trainer.kda.overrides.kda.cp_exchange``) beats
``SKYRL_KDA_CP_EXCHANGE``, which beats the recipe file.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from skyrl.train.config.config import (
    DEFAULT_MEGATRON_OPTIMIZER_KWARGS,
    DEFAULT_TRANSFORMER_CONFIG_KWARGS,
)

from ... import recipe_rules
from ...config import CP_EXCHANGE_ENV, Recipe, env_cp_exchange, flatten, merge, unflatten
from ...kda import exchanges

logger = logging.getLogger(__name__)

SKYRL_SCHEDULER = "constant_with_warmup"
"""The one LR schedule SkyRL's Megatron backend builds (``get_megatron_optimizer_param_scheduler``
refuses others): linear warm-up, then constant."""
ADAM_BETAS = [0.9, 0.999]
"""The betas our recipe's optimizer uses (megatron's defaults; the recipe has no field for them)."""


@dataclass(frozen=True)
class Decided:
    """One recipe key whose value a SkyRL setting gives."""

    key: str
    """Recipe dot path, e.g. ``train.lr``."""
    value: Any
    source: str
    """Where the value came from, e.g. ``trainer.policy.optimizer_config.lr``."""


def decided_settings(t, recipe: Recipe, *, model_path: str | None = None,
                     num_training_steps: int | None = None,
                     path_setting: str = "trainer.policy.model.path") -> list[Decided]:
    """The recipe keys SkyRL's ``cfg.trainer`` (``t``) decides. ``model_path`` is the HF folder
    SkyRL's ``init_model`` passes (None: the weights stay the recipe's, or a seeded random init),
    ``path_setting`` where it came from; ``num_training_steps`` SkyRL's step count (None: the
    recipe's ``train.steps``)."""
    opt = t.policy.optimizer_config
    lr = float(opt.lr)
    out = [
        Decided("train.lr", lr, "trainer.policy.optimizer_config.lr"),
        # SkyRL's Megatron schedule is constant after the warm-up: a cosine from lr to lr.
        Decided("train.min_lr", lr, f"trainer.policy.optimizer_config.scheduler={SKYRL_SCHEDULER}"),
        Decided("train.warmup_steps", int(opt.num_warmup_steps),
                "trainer.policy.optimizer_config.num_warmup_steps"),
        Decided("train.weight_decay", float(opt.weight_decay),
                "trainer.policy.optimizer_config.weight_decay"),
        # megatron (and SkyRL's Megatron backend) clip nothing at clip_grad=0.
        Decided("train.grad_clip", float(opt.max_grad_norm) if opt.max_grad_norm > 0 else None,
                "trainer.policy.optimizer_config.max_grad_norm"),
        Decided("train.grad_reduce_in_fp32", bool(t.policy.megatron_config.ddp_config.grad_reduce_in_fp32),
                "trainer.policy.megatron_config.ddp_config.grad_reduce_in_fp32"),
        Decided("train.seed", int(t.seed), "trainer.seed"),
        Decided("model.params_dtype", "bfloat16" if t.bf16 else "float32", "trainer.bf16"),
    ]
    out += lora_settings(t)
    if num_training_steps is not None:
        out.append(Decided("train.steps", int(num_training_steps), "num_training_steps (SkyRL's "
                           "trainer: total steps x mini-batches per batch)"))
    if recipe.run.init_from_hf is not None:
        out.append(Decided("run.init_from_hf", recipe.run.init_from_hf,
                           "the recipe (run.init_from_hf), not the model path SkyRL passes"))
    elif model_path is not None:
        out.append(Decided("run.init_from_hf", model_path, path_setting))
    return out


LORA = "trainer.policy.model.lora"


def _names(value) -> list[str]:
    """SkyRL's ``target_modules`` / ``exclude_modules``: a name, a list of names, or None."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def lora_settings(t) -> list[Decided]:
    """``train.lora.*`` from SkyRL's ``trainer.policy.model.lora`` (rank 0: LoRA off). What our
    adapters do not implement of SkyRL's LoRA settings is refused in ``REFUSALS``."""
    lora = t.policy.model.lora
    return [
        Decided("train.lora.rank", int(lora.rank), f"{LORA}.rank"),
        Decided("train.lora.alpha", float(lora.alpha), f"{LORA}.alpha"),
        Decided("train.lora.dropout", float(lora.dropout), f"{LORA}.dropout"),
        Decided("train.lora.target_modules", _names(lora.target_modules),
                f"{LORA}.target_modules"),
        Decided("train.lora.exclude_modules", _names(lora.exclude_modules),
                f"{LORA}.exclude_modules"),
        Decided("train.lora.init_method", str(lora.init_method), f"{LORA}.init_method"),
        Decided("train.lora.share_expert_adapters", bool(lora.share_expert_adapters),
                f"{LORA}.share_expert_adapters"),
        Decided("train.lora.normalize_moe_lora",
                bool(t.policy.megatron_config.lora_config.normalize_moe_lora),
                "trainer.policy.megatron_config.lora_config.normalize_moe_lora"),
    ]


def reference_settings(t, recipe: Recipe, model_path: str | None) -> tuple[Recipe, list[Decided]]:
    """(recipe, decided) of the reference worker for SkyRL's ``init_model(model_path)``. The
    policy's path (SkyRL's default ``trainer.ref.model.path``) means the policy's initial weights,
    so the recipe's ``run.init_from_hf`` wins as for the policy; any other path (an explicit
    reference model, or the policy's export for ``update_ref_every_epoch``) is loaded as given.
    A reference never resumes a checkpoint (``run.resume`` off)."""
    own = model_path is not None and model_path != t.policy.model.path
    run = {"resume": False, **({"init_from_hf": None} if own else {})}
    recipe = recipe.model_copy(update={"run": recipe.run.model_copy(update=run)})
    decided = decided_settings(
        t, recipe, model_path=model_path,
        path_setting="trainer.ref.model.path" if own else "trainer.policy.model.path")
    return recipe, decided


def steps_only_extend_a_constant_schedule(saved: Mapping[str, Any], recipe: Recipe) -> bool:
    """Whether a checkpoint whose manifest recorded schedule ``saved`` may load into ``recipe``'s
    trainer with this run's schedule (``override_schedule``) although they differ: only when
    ``train.steps`` alone differs and the schedule is SkyRL's (``min_lr == lr``: constant after
    the warm-up), where the step count, which follows SkyRL's ``num_training_steps`` and so
    ``trainer.max_training_steps``, changes no LR and no weight decay. That is a SkyRL resume that
    trains further (or stops sooner). Any other change is left to the load, which refuses it by
    name."""
    current = recipe.train.schedule()
    changed = {key for key, value in current.items() if saved.get(key) != value}
    return changed == {"train.steps"} and recipe.train.min_lr == recipe.train.lr


def missing_weights_folders(decided: list[Decided]) -> list[str]:
    """One line per model path in ``decided`` that is not a folder on this node, naming the SkyRL
    setting: the KDA workers load a glm5_next HF folder (``model.hf_io``) and download nothing, so
    a hub id is refused too."""
    return [f"{d.source}={d.value!r} is not a folder on {socket.gethostname()}: the KDA workers "
            "load their weights from a glm5_next Hugging Face folder at this path on every node "
            "(they download nothing)"
            for d in decided if d.key == "run.init_from_hf" and not os.path.isdir(d.value)]


def check_weights_folder(decided: list[Decided]) -> None:
    """Refuse a model path that is not a folder on this node (``missing_weights_folders``)."""
    missing = missing_weights_folders(decided)
    if missing:
        raise FileNotFoundError("; ".join(missing))


SKYRL_DECIDES = ("train.lr", "train.min_lr", "train.warmup_steps", "train.weight_decay",
                 "train.grad_clip", "train.grad_reduce_in_fp32", "train.seed", "train.steps",
                 "model.params_dtype", "train.lora.rank", "train.lora.alpha",
                 "train.lora.dropout", "train.lora.target_modules", "train.lora.exclude_modules",
                 "train.lora.init_method", "train.lora.share_expert_adapters",
                 "train.lora.normalize_moe_lora")
"""Recipe keys that come from SkyRL's config under SkyRL (``run.init_from_hf`` may come from
either: the recipe's wins)."""


def overridden_skyrl_keys(overrides: Mapping) -> list[str]:
    """The ``trainer.kda.overrides`` keys SkyRL decides, each a line naming where to set it."""
    return [f"trainer.kda.overrides.{key} is decided by SkyRL's config under SkyRL (see "
            "docs/skyrl.md, 'What comes from where'); set the SkyRL setting instead"
            for key in flatten(overrides) if key in SKYRL_DECIDES]


def apply_decided(recipe: Recipe, decided: list[Decided]) -> Recipe:
    """``recipe`` with the decided values, validated again (so a SkyRL value the recipe cannot
    take, a negative LR say, is an error that names the recipe key)."""
    tree = unflatten({d.key: d.value for d in decided})
    return recipe_rules.check(Recipe.model_validate(merge(recipe.model_dump(), tree)))


@dataclass(frozen=True)
class Refusal:
    """A SkyRL setting the KDA workers do not implement: refused while ``refused(t)``."""

    setting: str
    refused: Callable[[Any], bool]
    why: str


LORA_INIT_METHODS = ("kaiming", "xavier")
"""SkyRL's ``lora.init_method`` values our adapters draw A with (``train.lora.init_method``)."""


def _lora(t) -> bool:
    return t.policy.model.lora.rank > 0


def _non_default(given: Mapping, defaults: Mapping) -> list[str]:
    return sorted(k for k in set(given) | set(defaults) if given.get(k) != defaults.get(k))


REFUSALS: tuple[Refusal, ...] = (
    Refusal("trainer.policy.megatron_config.lora_config.lora_type",
            lambda t: t.policy.megatron_config.lora_config.lora_type != "lora",
            "only lora_type=lora (one adapter per linear); canonical_lora's split q/k/v and "
            "gate/up adapters are not built"),
    Refusal("trainer.policy.megatron_config.lora_config.experts_shared_outer_loras",
            lambda t: t.policy.megatron_config.lora_config.experts_shared_outer_loras,
            "shared-outer grouped-expert adapters are not built"),
    Refusal("trainer.policy.model.lora.sync_mode",
            lambda t: _lora(t) and t.policy.model.lora.sync_mode != "disk",
            "adapter tensors over the weight-sync backend are not sent (sync_mode=disk writes "
            "the adapter folder; merge_lora=true syncs merged weights)"),
    Refusal("trainer.policy.model.lora.max_loras", lambda t: t.policy.model.lora.max_loras != 1,
            "one policy adapter per job (multi-tenant LoRA serving is not implemented)"),
    Refusal("trainer.policy.model.lora.max_cpu_loras",
            lambda t: t.policy.model.lora.max_cpu_loras is not None,
            "one policy adapter per job (multi-tenant LoRA serving is not implemented)"),
    Refusal("trainer.policy.model.lora.init_method",
            lambda t: t.policy.model.lora.init_method not in LORA_INIT_METHODS,
            f"A starts as {' or '.join(LORA_INIT_METHODS)} (train.lora.init_method)"),
    Refusal("trainer.policy.megatron_config.moe_enable_routing_replay",
            lambda t: t.policy.megatron_config.moe_enable_routing_replay,
            "router replay (R3) is not implemented by the KDA MoE layers"),
    Refusal("trainer.mtp.enabled", lambda t: t.mtp.enabled,
            "multi-token prediction heads are not built by the recipe's model"),
    Refusal("trainer.policy.megatron_config.mtp_num_layers",
            lambda t: t.policy.megatron_config.mtp_num_layers not in (None, 0),
            "multi-token prediction heads are not built by the recipe's model"),
    Refusal("trainer.policy.optimizer_config.scheduler",
            lambda t: t.policy.optimizer_config.scheduler != SKYRL_SCHEDULER,
            f"only {SKYRL_SCHEDULER} (as SkyRL's own Megatron backend)"),
    Refusal("trainer.policy.optimizer_config.adam_betas",
            lambda t: [float(b) for b in t.policy.optimizer_config.adam_betas] != ADAM_BETAS,
            f"the recipe's Adam uses betas {ADAM_BETAS}"),
    Refusal("trainer.policy.model.fake_int4_qat.enabled",
            lambda t: t.policy.model.fake_int4_qat.enabled, "fake-INT4 QAT is not implemented"),
    Refusal("trainer.policy.inference_only_init", lambda t: t.policy.inference_only_init,
            "the KDA policy worker always builds its optimizer"),
    Refusal("trainer.policy.sequence_parallel_size", lambda t: t.policy.sequence_parallel_size != 1,
            "Ulysses sequence parallelism: the recipe's parallel.cp is the KDA workers' context "
            "parallelism"),
    Refusal("trainer.ref.sequence_parallel_size", lambda t: t.ref.sequence_parallel_size != 1,
            "Ulysses sequence parallelism: the reference worker uses the recipe's mesh"),
    Refusal("trainer.policy.megatron_config.freeze_moe_router",
            lambda t: t.policy.megatron_config.freeze_moe_router,
            "the recipe's router is trained (its expert bias by its own update rule)"),
    Refusal("trainer.policy.megatron_config.fp8", lambda t: t.policy.megatron_config.fp8 is not None,
            "FP8 training is not implemented by the recipe's model"),
    Refusal("trainer.policy.megatron_config.fp8_param",
            lambda t: bool(t.policy.megatron_config.fp8_param),
            "FP8 parameters are not implemented by the recipe's model"),
    Refusal("trainer.policy.megatron_config.ddp_config.overlap_grad_reduce",
            lambda t: t.policy.megatron_config.ddp_config.overlap_grad_reduce,
            "the KDA policy worker reduces gradients once, in optim_step"),
    Refusal("trainer.policy.megatron_config.ddp_config.overlap_param_gather",
            lambda t: t.policy.megatron_config.ddp_config.overlap_param_gather,
            "the KDA policy worker gathers parameters in the optimizer step"),
    Refusal("trainer.policy.megatron_config.optimizer_config_kwargs",
            lambda t: bool(_non_default(t.policy.megatron_config.optimizer_config_kwargs,
                                        DEFAULT_MEGATRON_OPTIMIZER_KWARGS)),
            "pass-through kwargs of SkyRL's Megatron optimizer; the recipe's train section "
            "configures ours"),
    Refusal("trainer.policy.megatron_config.transformer_config_kwargs",
            lambda t: bool(_non_default(t.policy.megatron_config.transformer_config_kwargs,
                                        DEFAULT_TRANSFORMER_CONFIG_KWARGS)),
            "pass-through kwargs of SkyRL's Megatron-Bridge provider; the recipe configures the "
            "model (recompute: trainer.kda.overrides.train.recompute)"),
)
"""SkyRL settings the KDA workers refuse, each with why; ``refused_settings`` applies them."""


def refused_settings(t) -> list[str]:
    """One line per refused SkyRL setting that ``cfg.trainer`` (``t``) sets."""
    lines = []
    for r in REFUSALS:
        if r.refused(t):
            value = attrgetter(r.setting.removeprefix("trainer."))(t)
            lines.append(f"{r.setting}={value!r}: not supported by the KDA workers ({r.why})")
    return lines


def command_line_exchange(selection) -> str | None:
    """``kda.cp_exchange`` as the SkyRL command line gave it (``trainer.kda.cp_exchange`` or
    ``trainer.kda.overrides.kda.cp_exchange``; they must agree), or None."""
    given = selection.overrides.get("kda", {}) if isinstance(selection.overrides, Mapping) else {}
    field = getattr(selection, "cp_exchange", None)
    if field is not None:
        return field
    return given.get("cp_exchange") if isinstance(given, Mapping) else None


@dataclass(frozen=True)
class ExchangeSource:
    """Where ``kda.cp_exchange`` comes from."""

    text: str
    """For the dry run and the log: ``command line (allgather)``, ``SKYRL_KDA_CP_EXCHANGE=state``
    or ``the recipe file``."""
    command_line: bool
    """The command line gave it: the environment must not override it."""
    env_ignored: str | None
    """The ``SKYRL_KDA_CP_EXCHANGE`` value the command line overrode (None: none or the same)."""


def cp_exchange_source(selection, environ: Mapping[str, str] | None = None) -> ExchangeSource:
    """The command line beats ``SKYRL_KDA_CP_EXCHANGE``, which beats the recipe file."""
    given = command_line_exchange(selection)
    env = env_cp_exchange(exchanges.REGISTRY.choices(), environ)
    if given is not None:
        ignored = env if env is not None and env != given else None
        note = f"; {CP_EXCHANGE_ENV}={ignored} ignored" if ignored else ""
        return ExchangeSource(f"command line ({given}{note})", True, ignored)
    if env is not None:
        return ExchangeSource(f"{CP_EXCHANGE_ENV}={env}", False, None)
    return ExchangeSource("the recipe file", False, None)
