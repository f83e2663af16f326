"""What blocks a KDA SkyRL job's launch, checked on the head node before Ray starts.

``launch_blockers`` is the one list: each check contributes one line per problem, so a new
check is one more line there. The entrypoint prints the list under ``launch blocked by:`` (the dry
run, after its provenance table) or refuses the launch with it; either way the command exits
non-zero, so a CI job can use the dry run as a gate.
"""

import importlib.util
import os
from typing import List

from skyrl.train.utils import validate_cfg

from ...config import Recipe
from ...console import message
from ...model.hf_io import check_hf_config
from .config import uses_reference
from .fully_async import fully_async_problems
from .settings import decided_settings, missing_weights_folders, reference_settings


def launch_blockers(cfg, recipe: Recipe, refused: List[str]) -> List[str]:
    """Everything that blocks the launch of ``cfg`` (after ``config.apply_recipe``, whose
    ``refused`` settings come first), one line each; empty: ready."""
    return [
        *refused,
        *skyrl_config_errors(cfg),
        *fully_async_problems(cfg),
        *model_folder_problems(cfg, recipe),
        *env_module_problems(cfg.trainer.kda.env_modules),
    ]


def env_module_problems(names: List[str]) -> List[str]:
    """``trainer.kda.env_modules`` that cannot be imported here, one line each. Checked without
    importing them (the experiment imports them on the node it runs on)."""
    problems = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or an empty name
            found = False
        if not found:
            problems.append(f"trainer.kda.env_modules: no module {name!r} to import (the "
                            "experiment imports it to register its environments; put its folder "
                            "on PYTHONPATH)")
    return problems


def skyrl_config_errors(cfg) -> List[str]:
    """SkyRL's own ``validate_cfg`` as one line (empty: it passed). SkyRL checks the job with
    ``assert`` and ``ValueError`` and stops at the first failure."""
    try:
        validate_cfg(cfg)
    except (AssertionError, ValueError) as err:
        return [f"SkyRL's validate_cfg: {message(err)}"]
    return []


def model_folder_problems(cfg, recipe: Recipe) -> List[str]:
    """The model folders the workers will load (``trainer.policy.model.path``, the reference's
    when SkyRL builds one, or the recipe's ``run.init_from_hf``), checked here as the workers
    check them: a folder with a ``config.json`` that describes the recipe's model (each
    differing field named). Reads config.json only, never the weights."""
    t = cfg.trainer
    decided = decided_settings(t, recipe, model_path=t.policy.model.path)
    if uses_reference(t):
        decided += reference_settings(t, recipe, t.ref.model.path)[1]
    # Policy and reference usually name the same folder: one line each.
    paths = list(dict.fromkeys(d for d in decided if d.key == "run.init_from_hf"))
    problems = []
    for d in paths:
        missing = missing_weights_folders([d])
        if missing:
            problems += missing
        elif not os.path.isfile(os.path.join(d.value, "config.json")):
            problems.append(f"{d.source}={d.value!r} has no config.json: not a Hugging Face "
                            "model folder")
        else:
            try:
                check_hf_config(recipe, d.value)
            except ValueError as err:  # also a config.json that is not JSON
                problems.append(f"{d.source}: {message(err)}")
    return problems
