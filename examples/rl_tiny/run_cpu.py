"""GRPO on the tiny recipe through SkyRL's real trainer, on a laptop's CPU.

What runs is SkyRL 0.4.0's own RL loop (``BasePPOExp`` -> ``RayPPOTrainer.train()``: generation,
rewards, GRPO advantages, ``forward``, ``forward_backward``, ``optim_step``, weight sync), with
this project's KDA policy worker as a Ray actor per rank (gloo on CPU) and, where vLLM would
serve rollouts, ``integrations.skyrl.cpu_inference.CPUInferenceClient``: transformers' glm5_next
sampling from the weights the worker publishes on disk after every step
(``integrations.skyrl.weight_sync.DiskPublisher``). It is passed through SkyRL's
``get_inference_client`` hook.

1. a random glm5_next checkpoint shaped like ``glm53_flash_tiny`` with a 256-word tokenizer (its
   chat template puts the user's words on one line), and a JSONL dataset of word prompts;
2. a toy environment (``rl_tiny_words``, ``words_env.py``): the reward is the fraction of the
   response's words that are real words of the tokenizer, not its ``w<i>`` fillers;
3. SkyRL's command line (``KEY=VALUE`` dot paths, as ``skyrl.train.entrypoints.main_base``),
   built by ``skyrl_args``; extra ``KEY=VALUE`` arguments are appended and win;
4. Ray with one logical GPU per policy and reference rank (SkyRL places each worker on one GPU; the
   tiny recipe runs them on CPU), then SkyRL's trainer for ``--steps`` steps. Each step's
   metrics go to ``WORKDIR/metrics.jsonl`` and the console: ``reward/avg_raw_reward``,
   ``policy/policy_kl``, ``policy/rollout_train_logprobs_abs_diff_max`` (sampler vs trainer
   log-probs of the same tokens, with the same weights), ...

Usage: ``python examples/rl_tiny/run_cpu.py WORKDIR [--steps 2] [--mesh tp1|tp2cp2]
[--fully-async STALENESS] [KEY=VALUE ...]``. ``--fully-async N`` runs SkyRL's fully async trainer
instead (``fully_async_args``: generation overlaps training, rollouts at most N steps stale).
Nothing is downloaded. SkyRL's own settings checkpoint and resume the job
(``trainer.ckpt_interval``, ``trainer.resume_mode=from_path``, ``trainer.resume_path``) and
colocate it (``trainer.placement.colocate_all=true``: the client then starts asleep, as SkyRL's
own colocated engines do); README.md has the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import List

import yaml

from skyrl_megatron_kda.console import USAGE_ERROR, error_lines, quiet_warnings

HERE = Path(__file__).resolve().parent
RECIPE = "glm53_flash_tiny"
ENV = "rl_tiny_words"
WORDS = ("cat dog bird fish tree river stone red green blue small large the a one two three "
         "sees likes finds follows near under over and then").split()
SPECIALS = ("[PAD]", "[UNK]", "</s>")  # ids 0, 1, 2
VOCAB = 256  # the tiny recipe's vocab_size: every id the model can sample decodes to a word
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
MESHES = {
    # one rank
    "tp1": ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
            "run.num_workers=1"],
    # four ranks: KDA under CP (the recipe's exchange), sequence parallel, experts over EP2
    "tp2cp2": ["parallel.tp=2", "parallel.cp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
               "run.num_workers=4"],
}


def make_tokenizer(out: Path) -> None:
    """A word-level tokenizer with the model's 256 ids: the words above, then ``w<i>`` fillers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*SPECIALS, *WORDS]
    names += [f"w{i}" for i in range(len(names), VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(names)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_hf_checkpoint(out: Path) -> None:
    """The fine-tune example's random glm5_next checkpoint of the tiny recipe (one recipe, one
    way to make its weights)."""
    spec = importlib.util.spec_from_file_location(
        "finetune_1m_run_cpu", HERE.parent / "finetune_1m" / "run_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_hf_checkpoint(out)


def make_dataset(path: Path, prompts: int, seed: int = 0) -> None:
    """SkyRL's prompt dataset: chat messages of a few real words, and the env class."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(prompts):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"prompt": [{"role": "user", "content": words}],
                                "env_class": ENV}) + "\n")


def register_environment() -> None:
    """``rl_tiny_words`` in skyrl_gym's registry (every process that makes environments)."""
    import skyrl_gym

    if ENV not in skyrl_gym.envs.registration.registry:
        skyrl_gym.register(id=ENV, entry_point="examples.rl_tiny.words_env:WordsEnv")


def skyrl_args(work: Path, mesh: str, steps: int, batch: int = 4, samples: int = 2) -> List[str]:
    """SkyRL's command line for the job: the tiny recipe on ``mesh``, GRPO, fp32 sampling with
    log-probs, one optimizer step per training step (so sampler and trainer hold the same
    weights for the log-prob comparison), SkyRL's KL loss against a reference worker, no
    colocation."""
    workers = int(next(o for o in MESHES[mesh] if o.startswith("run.num_workers")).split("=")[1])
    hf = work / "GLM-tiny-hf"
    return [
        "trainer.strategy=megatron", "trainer.logger=console",
        f"trainer.policy.model.path={hf}", f"data.train_data=['{work / 'train.jsonl'}']",
        "data.val_data=[]", "data.dataloader.num_workers=0",  # no loader processes on a laptop
        "trainer.eval_interval=-1", "trainer.eval_before_train=false",
        f"trainer.ckpt_path={work / 'ckpt'}", f"trainer.export_path={work / 'export'}",
        f"trainer.log_path={work / 'logs'}", "trainer.ckpt_interval=-1", "trainer.hf_save_interval=-1",
        "trainer.placement.colocate_all=false", f"trainer.placement.policy_num_gpus_per_node={workers}",
        # SkyRL's default KL loss (use_kl_loss=true): a reference worker on the same mesh
        f"trainer.placement.ref_num_gpus_per_node={workers}",
        "trainer.algorithm.advantage_estimator=grpo",
        "trainer.algorithm.temperature=1.0", "trainer.epochs=1", f"trainer.max_training_steps={steps}",
        f"trainer.train_batch_size={batch}", f"trainer.policy_mini_batch_size={batch}",
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.micro_forward_batch_size_per_gpu=2",
        "trainer.max_prompt_length=32", "generator.n_samples_per_prompt=" + str(samples),
        "generator.sampling_params.max_generate_length=8", "generator.sampling_params.temperature=1.0",
        "generator.sampling_params.logprobs=0", "generator.inference_engine.model_dtype=float32",
        "generator.inference_engine.num_engines=1", "generator.batched=true",
        "generator.inference_engine.enable_ray_prometheus_stats=false",  # no vLLM to scrape
        # fp32 training (the recipe's dtype, SkyRL's trainer.bf16 decides it) and the recipe's
        # learning rate (SkyRL's optimizer_config decides it; its default 1e-6 barely moves)
        "trainer.bf16=false", "trainer.policy.optimizer_config.lr=3e-3",
        f"trainer.kda.recipe={RECIPE}",
        *[f"trainer.kda.overrides.{o}" for o in MESHES[mesh]],
        f"trainer.kda.overrides.run.init_from_hf={hf}",
    ]


def fully_async_args(staleness: int, batch: int = 4) -> List[str]:
    """What SkyRL's fully async trainer needs on top of ``skyrl_args``: its switch and staleness
    bound, as many generation workers as the bound lets run (one mini-batch per staleness step),
    unbatched generation (a batched call cannot be paused for a sync), the loss against the
    rollout's log-probs (the policy that sampled a stale rollout is not kept), and SkyRL's
    off-policy correction metrics (is_ratio_*: trainer vs sampler probability of each token; the
    thresholds are loose, they mask only a broken sync)."""
    return [
        "trainer.fully_async.enabled=true", f"trainer.fully_async.max_staleness_steps={staleness}",
        f"trainer.fully_async.num_parallel_generation_workers={batch * (staleness + 1)}",
        "generator.batched=false", "trainer.algorithm.policy_loss_type=rollout_is",
        "trainer.algorithm.off_policy_correction.outlier_token_is_threshold_low=1e-4",
        "trainer.algorithm.off_policy_correction.outlier_token_is_threshold_high=1e4",
    ]


def make_experiment_class():
    """The SkyRL experiment: the KDA one, with the CPU sampler as inference client, the toy
    environment registered, and a tracker that also writes metrics.jsonl."""
    from skyrl.train.utils.tracking import Tracking

    from skyrl_megatron_kda.integrations.skyrl.cpu_inference import CPUInferenceClient
    from skyrl_megatron_kda.integrations.skyrl.entrypoint import KDAPPOExp

    class JsonlTracking(Tracking):
        def __init__(self, path: Path, **kwargs):
            super().__init__(**kwargs)
            self.path = path

        def log(self, data, step, *args, **kwargs):
            super().log(data, step, *args, **kwargs)
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **{k: v for k, v in data.items()
                                                     if isinstance(v, (int, float))}}) + "\n")

    class RLTinyExp(KDAPPOExp):
        def __init__(self, cfg, work: str):
            register_environment()
            self.work = Path(work)
            super().__init__(cfg)

        def get_inference_client(self):
            client = CPUInferenceClient(self.work / "weights", self.tokenizer,
                                        model_name=self.cfg.trainer.policy.model.path)
            if self.cfg.trainer.placement.colocate_all:
                # as SkyRL's own get_inference_client: colocated engines start asleep, and the
                # trainer wakes them around each weight sync
                asyncio.run(client.sleep())
            return client

        def get_tracker(self):
            t = self.cfg.trainer
            return JsonlTracking(self.work / "metrics.jsonl", project_name=t.project_name,
                                 experiment_name=t.run_name, backend=t.logger, config=self.cfg)

    return RLTinyExp


def check_overrides(overrides: List[str]) -> None:
    """Each extra argument is one SkyRL setting ``KEY=VALUE`` with a dotted ``KEY``: SkyRL's
    parser reads ``trainer.epochs`` as ``trainer.epochs=None`` (the job then fails inside SkyRL's
    trainer) and ``=3`` as a key named ''."""
    for arg in overrides:
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


def job_config(args: List[str]):
    """SkyRL's config of the job from its command line ``args``, its recipe, and the settings the
    KDA workers cannot serve (one line each): every check that needs no Ray, as SkyRL's
    entrypoint makes them."""
    from skyrl.train.utils import validate_cfg

    from skyrl_megatron_kda.integrations.skyrl.config import apply_recipe
    from skyrl_megatron_kda.integrations.skyrl.entrypoint import parse
    from skyrl_megatron_kda.integrations.skyrl.fully_async import fully_async_problems

    cfg = parse(args)  # SkyRL's strict keys; the recipe is resolved and validated here too
    recipe = cfg.trainer.kda.resolve()
    # The recipe runs on CPU ranks; Ray declares a logical GPU per rank for SkyRL's placement,
    # so the one refusal that does not apply here is the device's.
    problems = [p for p in apply_recipe(cfg, recipe) if not p.startswith("run.device=cpu")]
    problems += fully_async_problems(cfg)
    try:
        validate_cfg(cfg)
    except AssertionError as err:  # SkyRL states some of its checks as asserts
        raise ValueError(str(err)) from err
    return cfg, recipe, problems


def run_job(work: Path, cfg, recipe) -> None:
    """SkyRL's job ``cfg`` (``job_config``'s), on a local Ray with one logical GPU per policy and
    reference rank, the experiment in a Ray task as SkyRL's own entrypoint runs it."""
    import os

    import ray
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

    from skyrl_megatron_kda.integrations.skyrl.config import uses_reference

    root = str(HERE.parents[1])  # Ray's processes import this repository's examples package
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    # address="local": a Ray of its own, never another job's cluster on the same machine. SkyRL's
    # runtime environment (prepare_runtime_environment) is left out: it holds NCCL, CUDA and vLLM
    # settings, and on a driver without GPUs it probes peer access on a node with 2 GPUs.
    gpus = recipe.run.num_workers * (2 if uses_reference(cfg.trainer) else 1)
    ray.init(address="local", num_cpus=gpus + 2, num_gpus=gpus, include_dashboard=False,
             log_to_driver=True)
    try:
        sync_registries()
        exp_cls = make_experiment_class()
        ray.get(ray.remote(num_cpus=1)(lambda: exp_cls(cfg, str(work)).run()).remote())
    finally:
        ray.shutdown()


def main(argv: List[str] | None = None) -> int:
    """Run the job; a refused command line prints one ``error: ...`` line per problem to stderr
    and returns 2, before anything is written to WORKDIR or Ray starts."""
    from loguru import logger

    # Notices that say nothing about this job, so that an error is what a refused command shows:
    # the libraries' (as the CLI hides them), and SkyRL's on importing it without vLLM.
    quiet_warnings()
    logger.disable("skyrl.backends.skyrl_train.patches.vllm")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mesh", choices=sorted(MESHES), default="tp1")
    parser.add_argument("--fully-async", type=int, metavar="STALENESS", default=None,
                        help="SkyRL's fully async trainer, rollouts at most STALENESS steps stale")
    parser.add_argument("overrides", nargs="*", help="more SkyRL KEY=VALUE settings (they win)")
    args = parser.parse_intermixed_args(argv)  # KEY=VALUE settings may follow the options
    work = args.workdir.resolve()
    if (work / "metrics.jsonl").exists():
        print(f"error: {work} holds a finished job: use a fresh WORKDIR", file=sys.stderr)
        return USAGE_ERROR
    skyrl = skyrl_args(work, args.mesh, args.steps)
    if args.fully_async is not None:
        skyrl += fully_async_args(args.fully_async)
    skyrl += args.overrides
    # All checks come before the files below, so that a refused command leaves WORKDIR as it was:
    # none of them reads the checkpoint or the dataset that the settings name.
    try:
        check_overrides(args.overrides)
        cfg, recipe, problems = job_config(skyrl)
    except (ValueError, KeyError, OSError, yaml.YAMLError) as err:  # error_lines' usage errors
        lines, status = error_lines(err)
    else:
        lines, status = [f"error: the job cannot run: {p}" for p in problems], USAGE_ERROR
    if lines:
        print("\n".join(lines), file=sys.stderr)
        return status
    from skyrl_megatron_kda.integrations.skyrl.trainers import trainer_line

    print("SkyRL settings: " + " ".join(skyrl), flush=True)
    print(trainer_line(cfg), flush=True)
    work.mkdir(parents=True, exist_ok=True)
    make_hf_checkpoint(work / "GLM-tiny-hf")
    make_tokenizer(work / "GLM-tiny-hf")
    make_dataset(work / "train.jsonl", prompts=16)
    run_job(work, cfg, recipe)
    steps = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"workdir": str(work), "steps": len(steps)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
