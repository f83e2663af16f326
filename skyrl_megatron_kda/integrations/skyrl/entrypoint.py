"""``trainer.override_entrypoint`` target: a SkyRL RL job whose policy is one of our recipes.

SkyRL's ``main_base.main`` sees ``trainer.override_entrypoint=<this module>`` before it parses
anything and calls ``main()`` here, which parses the same command line with ``KDASkyRLConfig``,
resolves the recipe, mirrors its mesh into SkyRL's Megatron sizes, checks the job
(``gate.launch_blockers``: unsupported settings, SkyRL's own validation and its fully async
trainer's requirements, the model folders), and launches SkyRL's experiment with the trainer
SkyRL's settings ask for (``trainers``: the synchronous one, or the fully async one under
``trainer.fully_async.enabled=true``) and ``KDAPolicyWorker`` and ``KDARefWorker`` injected
through its ``build_models`` (they also stand in for SkyRL's import of its own Megatron
workers). The experiment imports ``trainer.kda.env_modules`` (the jobs' environments), serves
rollouts from SkyRL's vLLM servers or, with ``trainer.kda.sampler=glm5_next``, from this
project's sampler (``glm5_next_client``, on the recipe's device: ``cuda`` for ``run.device=gpu``,
``cpu`` for ``run.device=cpu``), and records each step with ``tracking.kda_tracker``. A CPU
recipe (``run.device=cpu``, with the project's sampler) gets a local Ray whose logical GPUs
stand for its ranks (``local_ray``); a GPU one SkyRL's own ``initialize_ray``.
``trainer.kda.dry_run=true`` stops before Ray and prints what it resolved, which
trainer will run, where each setting came from, what it read of the data and what blocks the
launch (exit 1 if anything does); a blocked job is refused before Ray starts, with the list. A
command line that cannot be taken at all (a value of the wrong type, a recipe, a key) or that
names what the launch cannot read or import (``gate.check_inputs``: data files, environments,
sampling settings, the batch against the data, the logger, the checkpoint to resume from) is one
``error:`` line per problem, exit 2, dry run or not.
"""

import asyncio
import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator
from operator import attrgetter
from typing import List, Optional

from ...console import USAGE_ERROR, error_lines, message, quiet_warnings

quiet_warnings()  # before the imports below load megatron-core and fla, which warn on import

import ray  # noqa: E402
from skyrl.train.dataset import PromptDataset  # noqa: E402
from skyrl.train.entrypoints.main_base import BasePPOExp  # noqa: E402
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402
from skyrl.train.utils.utils import initialize_ray  # noqa: E402

from . import ENTRYPOINT  # noqa: E402
from .config import KDASkyRLConfig, apply_recipe, prompt_filter_processes, uses_reference, wrong_types
from .fully_async import drift_note
from .gate import check_inputs, evaluates, launch_blockers
from .local_ray import start_local_ray
from .reference import KDARefWorker
from .settings import cp_exchange_source, decided_settings
from .tracking import config_dump_path, kda_tracker, metrics_path, steps_path
from .trainers import trainer_class, trainer_line
from .workers import KDAPolicyWorker

_FLAG = "trainer.override_entrypoint="

BLOCKED = 1
"""Exit status of a job that ``gate.launch_blockers`` blocks (the command line itself was fine:
that one is ``console.USAGE_ERROR``, 2)."""


SKYRL_MEGATRON_WORKERS = "skyrl.backends.skyrl_train.workers.megatron.megatron_worker"
"""The module ``BasePPOExp._setup_trainer`` imports its workers from under
``trainer.strategy=megatron``. It imports Megatron-Bridge (``megatron.bridge``) at the top, which
our workers do not use and this package does not install."""


@contextlib.contextmanager
def kda_workers_for_skyrl_import() -> Iterator[None]:
    """While active, ``from <SKYRL_MEGATRON_WORKERS> import PolicyWorker, CriticWorker,
    RefWorker`` gives the KDA workers (no critic) instead of importing SkyRL's Megatron workers;
    the module table is restored after (a real import of SkyRL's module, if one happened before,
    comes back)."""
    stand_in = types.ModuleType(SKYRL_MEGATRON_WORKERS, "The KDA workers, for SkyRL's import.")
    stand_in.PolicyWorker, stand_in.CriticWorker, stand_in.RefWorker = (
        KDAPolicyWorker, None, KDARefWorker)
    before = sys.modules.get(SKYRL_MEGATRON_WORKERS)
    sys.modules[SKYRL_MEGATRON_WORKERS] = stand_in
    try:
        yield
    finally:
        if before is None:
            sys.modules.pop(SKYRL_MEGATRON_WORKERS, None)
        else:
            sys.modules[SKYRL_MEGATRON_WORKERS] = before


def sampler_weights_dir(t) -> str:
    """Where the policy publishes weights for the project's sampler: ``trainer.export_path``/
    sampler_weights (one folder the workers and the sampler share: one node)."""
    return os.path.join(t.export_path, "sampler_weights")


class KDAPPOExp(BasePPOExp):
    """SkyRL's experiment (tokenizer, datasets, inference engines, generator) with our trainer
    (``trainers.trainer_class``), environments, sampler choice and tracker."""

    def __init__(self, cfg):
        for name in cfg.trainer.kda.env_modules:
            importlib.import_module(name)  # registers its environments with skyrl_gym
        self.recipe = cfg.trainer.kda.resolve()
        super().__init__(cfg)

    def get_inference_client(self):
        t = self.cfg.trainer
        if t.kda.sampler == "vllm":
            return super().get_inference_client()
        from .glm5_next_client import Glm5NextInferenceClient

        client = Glm5NextInferenceClient(sampler_weights_dir(t), self.tokenizer,
                                         model_name=t.policy.model.path, seed=t.seed,
                                         device=self.recipe.run.torch_device)
        if t.placement.colocate_all:
            # as SkyRL's own engines under colocation: they start asleep, and the trainer wakes
            # them around each weight sync
            asyncio.run(client.sleep())
        return client

    def get_tracker(self):
        return kda_tracker(self.cfg, self.recipe)

    def _prompts(self, files) -> PromptDataset:
        # A setting, not SkyRL's fixed 8 processes, each importing transformers.
        t = self.cfg.trainer
        return PromptDataset(datasets=files, tokenizer=self.tokenizer,
                             max_prompt_length=t.max_prompt_length,
                             num_workers=prompt_filter_processes(t.kda))

    def get_train_dataset(self) -> PromptDataset:
        dataset, t = self._prompts(self.cfg.data.train_data), self.cfg.trainer
        if len(dataset) < t.train_batch_size:
            raise ValueError(f"trainer.train_batch_size={t.train_batch_size} is larger than the "
                             f"{len(dataset)} prompts of data.train_data that fit "
                             f"trainer.max_prompt_length={t.max_prompt_length} tokens; lower it, "
                             "raise max_prompt_length or add prompts")
        return dataset

    def get_eval_dataset(self):
        if evaluates(self.cfg):
            return self._prompts(self.cfg.data.val_data)
        return None

    def get_cfg_as_str(self, cfg) -> str:
        """SkyRL logs the whole config (about 500 lines) at setup: it goes to a file beside the
        metrics, and the log line names it."""
        path = config_dump_path(cfg.trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(BasePPOExp.get_cfg_as_str(cfg))
        return f"SkyRL's config of this job: {path}"

    def _setup_trainer(self):
        # SkyRL picks its worker classes by trainer.strategy with a hard-coded import of its own
        # Megatron workers (which need megatron.bridge); ours stand in for that import.
        with kda_workers_for_skyrl_import():
            return super()._setup_trainer()

    def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset,
                    inference_engine_client, generator, colocate_pg) -> RayPPOTrainer:
        return trainer_class(cfg)(cfg=cfg, tracker=tracker, tokenizer=tokenizer,
                                  train_dataset=train_dataset, eval_dataset=eval_dataset,
                                  inference_engine_client=inference_engine_client,
                                  generator=generator, colocate_pg=colocate_pg)


@ray.remote(num_cpus=1)
def run_experiment(cfg) -> None:
    """Runs on a cluster node, not the head, as SkyRL's own ``skyrl_entrypoint``."""
    quiet_warnings()
    KDAPPOExp(cfg).run()


def check_arguments(argv: List[str]) -> None:
    """Each argument is one SkyRL setting ``KEY=VALUE`` with a dotted ``KEY``: SkyRL's parser
    reads ``trainer.epochs`` as ``trainer.epochs=None`` (the job then fails inside SkyRL's
    trainer) and ``=3`` as a key named ''."""
    for arg in argv:
        key, eq, _ = arg.partition("=")
        if not eq:
            why = "has no =VALUE"
        elif not key:
            why = "has no KEY before ="
        elif "" in key.split(".") or "." not in key:
            why = "has no dotted KEY"
        else:
            continue
        raise ValueError(f"argument {arg!r} {why}: SkyRL settings are KEY=VALUE with a dotted "
                         "KEY, e.g. trainer.epochs=1")


def parse(argv: List[str]):
    """``KDASkyRLConfig`` from SkyRL's command line, without the dispatch flag (not a field)."""
    settings = [a for a in argv if not a.startswith(_FLAG)]
    check_arguments(settings)
    return KDASkyRLConfig.from_cli_overrides(settings)


def provenance(cfg, recipe) -> List[str]:
    """The dry run's "what came from where": the recipe keys SkyRL's settings decide (the
    recipe file's value in brackets where it differs), the exchange's source, the roles."""
    t = cfg.trainer
    lines = [f"from {cfg.trainer.kda.recipe!r}: the model, parallel.*, kda.*, data.*, run.*",
             f"  kda.cp_exchange={recipe.kda.cp_exchange} <- {cp_exchange_source(t.kda).text}"]
    for d in decided_settings(t, recipe, model_path=t.policy.model.path):
        before = attrgetter(d.key)(recipe)
        was = "" if before == d.value else f" (recipe: {before})"
        lines.append(f"  {d.key}={d.value} <- {d.source}{was}")
    lines.append("  train.steps <- num_training_steps, which SkyRL's trainer passes at init_model")
    roles = "policy + reference (KL)" if uses_reference(t) else "policy"
    where = f" on {recipe.run.torch_device}" if t.kda.sampler == "glm5_next" else ""
    lines.append(f"workers: {roles}; colocate_all={t.placement.colocate_all}; rollouts from "
                 f"trainer.kda.sampler={t.kda.sampler}{where}")
    return ["what comes from where:"] + lines


def configure(argv: List[str]):
    """(cfg, recipe, refused settings) of SkyRL's command line ``argv``; a command line the
    entrypoint cannot take (a recipe name or path, a value, ``SKYRL_KDA_CP_EXCHANGE``, a key)
    exits 2 with one ``error:`` line per problem, as ``skyrl-kda`` does."""
    try:
        cfg = parse(argv)
        refuse(wrong_types(cfg))  # before anything reads a value as its type
        recipe = cfg.trainer.kda.resolve()
        return cfg, recipe, apply_recipe(cfg, recipe)
    except Exception as err:
        lines, status = error_lines(err)
        if isinstance(err, AssertionError):  # SkyRL's config classes check values with assert
            lines, status = [f"error: {message(err)}"], USAGE_ERROR
        if status != USAGE_ERROR:
            raise  # not the command line's fault: the traceback is what helps
        print("\n".join(lines), file=sys.stderr)
        raise SystemExit(status) from None


def refuse(problems: List[str]) -> None:
    """Exit 2 with one ``error:`` line per problem on stderr, if there are any."""
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        raise SystemExit(USAGE_ERROR)


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point SkyRL's ``main_base`` dispatches to; ``argv`` defaults to ``sys.argv[1:]``.
    Exits 2 on a command line it cannot take, 1 when the launch is blocked (dry run or not)."""
    quiet_warnings()
    cfg, recipe, refused = configure(sys.argv[1:] if argv is None else argv)
    problems, read = check_inputs(cfg)
    refuse(problems)
    blockers = launch_blockers(cfg, recipe, refused)
    if cfg.trainer.kda.dry_run:
        p = recipe.parallel
        print(f"entrypoint: {ENTRYPOINT}")
        print(f"recipe: {cfg.trainer.kda.recipe} -> kda.cp_exchange={recipe.kda.cp_exchange} "
              f"tp={p.tp} cp={p.cp} ep={p.ep} etp={p.etp} num_workers={recipe.run.num_workers}")
        print("recipe json: " + recipe.model_dump_json())
        print(trainer_line(cfg))
        for line in drift_note(cfg):
            print(line)
        for line in provenance(cfg, recipe) + read:
            print(line)
        print("launch blocked by:" if blockers else "launch: ready")
        for line in blockers:
            print(f"  - {line}")
        if blockers:
            raise SystemExit(BLOCKED)
        return
    if blockers:
        raise SystemExit("the KDA SkyRL job cannot run yet:\n  - " + "\n  - ".join(blockers))
    print(trainer_line(cfg), flush=True)
    for line in drift_note(cfg):
        print(line, flush=True)
    print(f"per-step metrics: {metrics_path(cfg.trainer)}", flush=True)
    print(f"step lines: {steps_path(cfg.trainer)}", flush=True)
    if recipe.run.device == "cpu":
        print(f"worker logs: {start_local_ray(cfg)}", flush=True)
    else:
        initialize_ray(cfg)
    try:
        ray.get(run_experiment.remote(cfg))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
