"""SkyRL's config tree with a ``trainer.kda`` section that selects and adjusts one of our recipes.

On the SkyRL command line::

    trainer.kda.recipe=glm53_flash_1m            # a registered name or a .yaml path
    trainer.kda.cp_exchange=allgather            # any KDAConfig field, as in the recipe's kda:
    trainer.kda.overrides.parallel.cp=4          # any recipe key, as a dot path

The section lives under ``trainer`` because SkyRL hands each worker ``cfg.trainer`` only. It is a
SkyRL dataclass (SkyRL's strict parser refuses unknown ``trainer.kda.*`` keys) whose values are
validated by our pydantic ``Recipe`` (unknown keys under ``overrides`` and bad values are errors
there), when the config is built. Precedence, lowest first: the recipe file,
``SKYRL_KDA_CP_EXCHANGE`` (``kda.cp_exchange`` only), ``trainer.kda.overrides``, the
``trainer.kda.<field>`` values (a value given on the command line beats the environment, with
a log line). The keys SkyRL's own config decides (``settings.SKYRL_DECIDES``) cannot be
overridden here.

No ``from __future__ import annotations`` here: SkyRL reads the field types at run time.
"""

import dataclasses
import json
import logging
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from skyrl.train.config.config import BaseConfig, MegatronConfig, TrainerConfig, make_config

from ...config import KDAConfig, Recipe, flatten
from ...recipe_rules import dispatch_rows_can_differ
from ...recipes import list_recipes, load_recipe
from .settings import cp_exchange_source, overridden_skyrl_keys, refused_settings

logger = logging.getLogger(__name__)


def dot_overrides(tree: Mapping) -> List[str]:
    """``{"parallel": {"tp": 2}}`` -> ``["parallel.tp=2"]``, values as JSON (a YAML subset), so
    ``recipes.load_recipe`` reads back the same types that SkyRL's parser produced (an empty
    mapping changes nothing, so it yields nothing)."""
    return [f"{path}={json.dumps(value)}" for path, value in flatten(tree).items()]


SAMPLERS = ("vllm", "glm5_next")
"""``trainer.kda.sampler``'s values."""


@dataclass
class _RecipeSelection(BaseConfig):
    """The recipe choice; ``KDASection`` adds one optional field per ``KDAConfig`` field."""

    recipe: Optional[str] = None
    """Registered recipe name (``skyrl-kda recipes`` lists them) or a path to a recipe YAML."""
    overrides: Dict[str, Any] = field(default_factory=dict)
    """Recipe keys to change, written as dot paths: ``trainer.kda.overrides.parallel.tp=8``."""
    dry_run: bool = False
    """Resolve and print the recipe and the checks of the SkyRL job, then exit without Ray."""
    sampler: str = "vllm"
    """What serves the rollouts: ``vllm`` (SkyRL's vLLM servers, as SkyRL configures them) or
    ``glm5_next`` (this project's sampler, ``glm5_next_client.Glm5NextInferenceClient``:
    transformers' glm5_next on the weights the policy publishes to disk, on the recipe's device;
    for small models, tests and CPU jobs)."""
    env_modules: List[str] = field(default_factory=list)
    """Python modules the experiment imports before SkyRL makes environments; each registers its
    ``skyrl_gym`` environments when imported (SkyRL's own register when skyrl_gym is imported)."""
    prompt_filter_processes: Optional[int] = None
    """Processes SkyRL's dataset loader uses to drop prompts longer than
    ``trainer.max_prompt_length`` (SkyRL's own ``main_base`` always starts 8, each importing
    transformers: minutes on a 2-core machine). None: ``min(8, CPUs of the node that runs the
    experiment)``; 1 filters in the experiment's own process."""

    def kda_values(self) -> Dict[str, Any]:
        """The ``trainer.kda.<KDAConfig field>`` values that were set."""
        return {name: getattr(self, name) for name in KDAConfig.model_fields
                if getattr(self, name) is not None}

    def recipe_overrides(self) -> List[str]:
        """Dot-path overrides for ``recipes.load_recipe``: ``overrides`` first, then the kda
        fields; the same key given both ways with different values is an error."""
        if not isinstance(self.overrides, Mapping):
            raise ValueError(f"trainer.kda.overrides must be a mapping of recipe keys, got "
                             f"{self.overrides!r}")
        given = self.overrides.get("kda", {})
        for name, value in self.kda_values().items():
            if isinstance(given, Mapping) and name in given and given[name] != value:
                raise ValueError(
                    f"trainer.kda.{name}={value!r} and trainer.kda.overrides.kda.{name}="
                    f"{given[name]!r} disagree; set it once")
        return dot_overrides(self.overrides) + dot_overrides({"kda": self.kda_values()})

    def resolve(self) -> Recipe:
        """The validated recipe this section selects. ``kda.cp_exchange``: the command line beats
        ``SKYRL_KDA_CP_EXCHANGE`` (read by config.py), which beats the recipe file."""
        if not self.recipe:
            raise ValueError(
                "trainer.kda.recipe is required: a recipe YAML path or one of "
                f"{', '.join(list_recipes())}")
        clashes = overridden_skyrl_keys(self.overrides) if isinstance(self.overrides, Mapping) else []
        if clashes:
            raise ValueError("; ".join(clashes))
        source = cp_exchange_source(self)
        if source.env_ignored:
            logger.warning("kda.cp_exchange from the %s", source.text)
        # An empty environment for the loader: the command line's value stands.
        environ = {} if source.command_line else None
        return load_recipe(self.recipe, self.recipe_overrides(), environ).recipe

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"trainer.kda.sampler={self.sampler!r}: choose one of "
                             f"{', '.join(SAMPLERS)}")
        if isinstance(self.env_modules, str):  # SkyRL's parser keeps a lone name a string
            self.env_modules = [self.env_modules]
        n = self.prompt_filter_processes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"trainer.kda.prompt_filter_processes={n!r}: a whole number >= 1, "
                             "or leave it unset for min(8, CPUs)")
        # Fail while parsing the command line, not on the cluster; a section with no recipe
        # (SkyRL building defaults) is checked when the entrypoint resolves it.
        if self.recipe:
            self.resolve()


def prompt_filter_processes(selection) -> int:
    """The process count of SkyRL's prompt filter (``trainer.kda.prompt_filter_processes``)."""
    if selection.prompt_filter_processes is not None:
        return selection.prompt_filter_processes
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cpus or 1))


def _kda_field(name: str) -> tuple:
    info = KDAConfig.model_fields[name]
    return (name, Optional[Any], field(default=None, metadata={"help": info.description}))


KDASection = dataclasses.make_dataclass(
    "KDASection", [_kda_field(name) for name in KDAConfig.model_fields],
    bases=(_RecipeSelection,), module=__name__)
KDASection.__doc__ = (
    "``trainer.kda``: the recipe, dot-path overrides, and one field per ``KDAConfig`` field "
    "(None: the recipe's value). Generated from ``KDAConfig`` so the two cannot drift apart.")
_clash = set(KDAConfig.model_fields) & {f.name for f in dataclasses.fields(_RecipeSelection)}
if _clash:
    raise TypeError(f"KDAConfig fields {sorted(_clash)} clash with trainer.kda's own fields")


@dataclass
class KDATrainerConfig(TrainerConfig):
    """SkyRL's ``TrainerConfig`` with the ``kda`` section."""

    kda: KDASection = field(default_factory=KDASection)
    """Which recipe the KDA workers build and train (see ``KDASection``)."""


KDASkyRLConfig = make_config(trainer_cls=KDATrainerConfig)
# make_config names its class after itself; ours is importable here, so plain pickle works too.
KDASkyRLConfig.__module__, KDASkyRLConfig.__qualname__ = __name__, "KDASkyRLConfig"
KDASkyRLConfig.__name__ = "KDASkyRLConfig"

MESH_FIELDS = (
    ("tensor_model_parallel_size", "tp"),
    ("pipeline_model_parallel_size", "pp"),
    ("context_parallel_size", "cp"),
    ("expert_model_parallel_size", "ep"),
    ("expert_tensor_parallel_size", "etp"),
)
"""SkyRL ``megatron_config`` size -> our ``parallel`` field. The recipe is the one source; the
sizes are mirrored so that SkyRL's own checks (CP needs remove_microbatch_padding) see them."""


_KINDS = {bool: "true or false", int: "a whole number", float: "a number"}
"""The scalar field types SkyRL's parser does not check (it keeps ``lr=abc`` as the string
'abc', which fails minutes later in a worker), and what each needs."""


def _scalar_kind(hint) -> Tuple[Optional[type], bool]:
    """(bool, int or float, whether None is allowed) for a field annotated so (or Optional of
    it); (None, True) for any other annotation."""
    if typing.get_origin(hint) is Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (_scalar_kind(args[0])[0], True) if len(args) == 1 else (None, True)
    return (hint, False) if hint in _KINDS else (None, True)


def _fits(kind: type, value) -> bool:
    if kind is bool or isinstance(value, bool):  # true is not a number, 1 is not true
        return kind is bool and isinstance(value, bool)
    return isinstance(value, int) or (kind is float and isinstance(value, float))


def wrong_types(node, path: str = "") -> List[str]:
    """One line per bool, int or float setting of SkyRL's config ``node`` (and ``trainer.kda``'s
    own) whose value is not of that type, naming the key, what it needs and its default."""
    problems = []
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += wrong_types(value, key + ".")
            continue
        kind, optional = _scalar_kind(hints.get(f.name))
        if kind is None or (value is None and optional) or (value is not None and _fits(kind, value)):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        example = f", e.g. {key}={json.dumps(default)}" if default is not None else ""
        problems.append(f"{key}={value!r}: needs {_KINDS[kind]}{example}")
    return problems


def unsupported_settings(cfg) -> List[str]:
    """Settings of the SkyRL job that the KDA workers cannot serve, one line each (empty: none)."""
    return unsupported_trainer_settings(cfg.trainer)


def unsupported_trainer_settings(t) -> List[str]:
    """``unsupported_settings`` of SkyRL's ``cfg.trainer`` (all a worker is given, so the worker
    refuses the same settings when called)."""
    problems = []
    if t.strategy != "megatron":
        problems.append(f"trainer.strategy={t.strategy}: set trainer.strategy=megatron (the KDA "
                        "workers are Megatron workers)")
    if t.critic.model.path:
        problems.append("trainer.critic.model.path is set: the KDA workers train a policy only "
                        "(GRPO-style, as SkyRL's Megatron backend)")
    if t.algorithm.enable_sample_support_replay:
        problems.append("trainer.algorithm.enable_sample_support_replay=true is not implemented by "
                        "the KDA policy worker")
    if t.fused_lm_head_logprob:
        problems.append("trainer.fused_lm_head_logprob=true is not implemented by the KDA policy "
                        "worker (it materialises each rank's logits); set it to false")
    if t.max_tokens_per_microbatch > 0:
        problems.append("trainer.max_tokens_per_microbatch > 0 (token-based micro-batches) is not "
                        "implemented by the KDA policy worker; set micro_train_batch_size_per_gpu "
                        "and micro_forward_batch_size_per_gpu")
    return problems + refused_settings(t)


def uses_reference(t) -> bool:
    """Whether SkyRL builds a reference model (``RayPPOTrainer.build_models``' rule)."""
    return bool(t.algorithm.use_kl_loss or t.algorithm.use_kl_in_reward)


def _mirror_mesh(megatron, where: str, recipe: Recipe) -> None:
    defaults = MegatronConfig()
    for skyrl_name, ours in MESH_FIELDS:
        current, wanted = getattr(megatron, skyrl_name), getattr(recipe.parallel, ours)
        if current not in (wanted, getattr(defaults, skyrl_name)):
            raise ValueError(
                f"{where}.megatron_config.{skyrl_name}={current} disagrees with the recipe's "
                f"parallel.{ours}={wanted}; the recipe decides: drop the former or set "
                f"trainer.kda.overrides.parallel.{ours}={current}")
        setattr(megatron, skyrl_name, wanted)


def apply_recipe(cfg, recipe: Recipe) -> List[str]:
    """Mirror ``recipe``'s mesh into ``cfg.trainer.policy.megatron_config`` (and the reference's,
    when SkyRL builds one) and check it against SkyRL's placement; returns the job's unsupported
    settings. Conflicts raise ValueError."""
    roles = ["policy"] + (["ref"] if uses_reference(cfg.trainer) else [])
    for role in roles:
        _mirror_mesh(getattr(cfg.trainer, role).megatron_config, f"trainer.{role}", recipe)
        placement = cfg.trainer.placement
        nodes, per_node = (getattr(placement, f"{role}_num_nodes"),
                           getattr(placement, f"{role}_num_gpus_per_node"))
        if nodes * per_node != recipe.run.num_workers:
            raise ValueError(
                f"SkyRL places {nodes * per_node} {role} workers (trainer.placement.{role}_num_nodes="
                f"{nodes} x {role}_num_gpus_per_node={per_node}) but the recipe has "
                f"run.num_workers={recipe.run.num_workers}; make them equal (the reference "
                "worker runs the recipe's mesh too)")
    problems = unsupported_settings(cfg)
    if recipe.model.moe.dispatcher == "allgather" and dispatch_rows_can_differ(recipe.parallel):
        p = recipe.parallel
        problems.append(
            f"model.moe.dispatcher=allgather: each data-parallel replica packs its micro-batches "
            f"to their own lengths, and an EP x ETP group of {p.ep * p.etp} ranks spans replicas "
            f"of tp * cp = {p.tp * p.cp}, whose row counts megatron's allgather dispatcher cannot "
            "gather; set trainer.kda.overrides.model.moe.dispatcher=alltoall")
    if recipe.run.device == "cpu" and cfg.trainer.kda.sampler == "vllm":
        problems.append("run.device=cpu: vLLM (trainer.kda.sampler=vllm) serves rollouts from "
                        "GPUs; set trainer.kda.sampler=glm5_next (this project's sampler) for a "
                        "CPU job, or trainer.kda.overrides.run.device=gpu")
    return problems
