"""Time SkyRL's RL worker calls on the KDA policy worker, as SkyRL runs it: a Ray actor per rank.

A local Ray (``address="local"``: never another job's cluster) with SkyRL's own actor group
(``PPORayActorGroup``, one GPU per ``KDAPolicyWorker`` actor, torch.distributed over NCCL; gloo
for a ``run.device=cpu`` recipe) and SkyRL's ``WorkerDispatch``, the path ``RayPPOTrainer`` takes.
The worker builds ``--recipe`` (with ``--set`` recipe keys) from SkyRL's config (``trainer.kda``),
then each step times, one line per call:

- ``forward``: the log-probs of a rollout batch of ``--tokens`` tokens (``--rows`` rows of prompt +
  response in SkyRL's ``TrainingInputBatch`` layout; random token ids, each GRPO group of
  ``--group`` rows sharing its prompt), no grad;
- ``forward_backward``: SkyRL's policy loss (``trainer.algorithm.policy_loss_type``, default
  ``regular``: PPO-clip) on GRPO advantages of random 0/1 rewards, the old log-probs being this
  step's ``forward``; with ``--kl`` SkyRL's default KL loss (``use_kl_loss=true``, k3, coef
  0.001) against the first step's log-probs, what a reference worker holding the initial weights
  returns;
- ``optim_step``: gradient reduction, the optimizer step; its value is the grad norm.

Each line: seconds (as the driver waits for the call), real tokens/s, the rank's
``torch.cuda.max_memory_allocated`` during the call (GPU), and the call's value (mean response
log-prob, ``final_loss``, grad norm). The log-probs run the recipe's path: the chunked loss when
the recipe (or ``--set``) gives ``train.loss_chunk_tokens``, else each rank's full logits; the
header says which. The first GPU calls compile (and autotune) fla's Triton kernels: progress lines
with the elapsed seconds show the wait.

CPU check (seconds; the tiny recipe on one gloo rank):
  python bench/rl_worker.py --recipe glm53_flash_tiny --tokens 96 --rows 4 --steps 1 \
    --set parallel.tp=1 --set parallel.cp=1 --set parallel.ep=1 \
    --set parallel.sequence_parallel=false --set run.num_workers=1

On one H200 (device tool, carry [".whl", ".whl-rl", ".tcache"]). ``.whl-rl`` holds the wheels
that importing ``integrations.skyrl.workers`` needs beyond the GPU image and ``.whl``: skyrl,
skyrl-gym, omegaconf, loguru, cloudpathlib, orjson, pybase64, datasets, dill, multiprocess
(2.8 MB, from ``pip download --no-deps``; docs/skyrl.md, "On one GPU"). DSA runs its torch kernel
(the fused one needs tilelang, carried separately):
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site-rl .whl-rl/*.whl && \
  WHEELS=.whl bash bench/device_run.sh env PYTHONPATH=$PWD/.site-rl:$PWD/.site:$PWD \
    python3 bench/rl_worker.py --tokens 8192 --rows 4 --steps 3 --kl \
    --set model.dsa.kernel=torch --set train.loss_chunk_tokens=8192 --json $OUT/rl_worker.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

_T0 = time.time()
ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 30.0
"""How often a call still running prints that it is (the first GPU calls compile kernels)."""


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="glm53_flash_slice",
                   help="recipe name or YAML path (glm53_flash_tiny for a CPU check)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe key (dot path), repeatable; the keys SkyRL decides are refused "
                        "by name, set them with --skyrl")
    p.add_argument("--skyrl", action="append", default=[], metavar="KEY=VALUE",
                   help="a SkyRL setting (e.g. trainer.algorithm.policy_loss_type=gspo); wins")
    p.add_argument("--tokens", type=int, default=8192, help="real tokens in the batch")
    p.add_argument("--rows", type=int, default=4, help="rows (samples) in the batch")
    p.add_argument("--group", type=int, default=4, help="GRPO group size (rows per prompt)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt tokens per row (default: a quarter of the row)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per micro-batch, forward and train (default: a DP rank's rows, "
                        "packed into one call)")
    p.add_argument("--steps", type=int, default=3, help="forward + forward_backward + optim_step rounds")
    p.add_argument("--kl", action="store_true",
                   help="SkyRL's default KL loss on (use_kl_loss=true, k3, kl_loss_coef=0.001)")
    p.add_argument("--json", default=None, help="write the call rows here (after every call)")
    p.add_argument("--worker-logs", action="store_true",
                   help="forward the workers' output (megatron's logs) to this console")
    args = p.parse_args(argv)
    if args.rows < 1 or args.tokens < 2 * args.rows:
        p.error(f"--tokens {args.tokens} must give each of --rows {args.rows} rows at least 2 tokens")
    if args.rows % args.group:
        p.error(f"--rows {args.rows} must be a multiple of --group {args.group}")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def row_shape(args) -> tuple[int, int]:
    """(prompt, response) tokens per row."""
    row = args.tokens // args.rows
    prompt = args.prompt_tokens if args.prompt_tokens is not None else row // 4
    if not 1 <= prompt < row:
        raise SystemExit(f"--prompt-tokens {prompt} must be in [1, {row}) (rows of {row} tokens)")
    return prompt, row - prompt


def load_checked_recipe(args):
    """The recipe as the worker will build it, refused here with one line when its device is
    missing (before Ray starts)."""
    import torch

    from skyrl_megatron_kda.recipes import load_recipe

    recipe = load_recipe(args.recipe, args.overrides).recipe
    workers = recipe.run.num_workers
    if recipe.run.device == "gpu":
        if not torch.cuda.is_available():
            raise SystemExit(f"bench/rl_worker.py: recipe {args.recipe} has run.device=gpu but CUDA "
                             "is not available here; on a CPU use --recipe glm53_flash_tiny")
        if torch.cuda.device_count() < workers:
            raise SystemExit(f"bench/rl_worker.py: run.num_workers={workers} needs {workers} GPUs, "
                             f"this machine has {torch.cuda.device_count()}")
    return recipe


def skyrl_config(args, recipe):
    """SkyRL's config of the job: the recipe under ``trainer.kda``; its LR, dtype and seed set
    through SkyRL's own fields (they decide them under SkyRL); no colocation, no critic."""
    from skyrl_megatron_kda.integrations.skyrl.config import KDASkyRLConfig, apply_recipe

    workers = recipe.run.num_workers
    dp = workers // (recipe.parallel.tp * recipe.parallel.cp * recipe.parallel.pp)
    micro = args.micro_batch or args.rows // dp
    cfg = KDASkyRLConfig.from_cli_overrides([
        "trainer.strategy=megatron", "trainer.logger=console",
        "trainer.placement.colocate_all=false",
        f"trainer.placement.policy_num_gpus_per_node={workers}",
        f"trainer.placement.ref_num_gpus_per_node={workers}",
        f"trainer.algorithm.use_kl_loss={str(args.kl).lower()}",
        "trainer.algorithm.temperature=1.0",
        f"trainer.bf16={str(recipe.model.params_dtype == 'bfloat16').lower()}",
        f"trainer.policy.optimizer_config.lr={recipe.train.lr}", f"trainer.seed={recipe.train.seed}",
        f"trainer.micro_train_batch_size_per_gpu={micro}",
        f"trainer.micro_forward_batch_size_per_gpu={micro}",
        f"trainer.kda.recipe={args.recipe}",
        *[f"trainer.kda.overrides.{o}" for o in args.overrides],
        *args.skyrl])
    problems = apply_recipe(cfg, recipe)
    if recipe.run.device == "cpu":  # Ray below declares a logical GPU per CPU rank
        problems = [p for p in problems if not p.startswith("run.device=cpu")]
    if problems:
        raise SystemExit("bench/rl_worker.py: the job cannot run: " + "; ".join(problems))
    if args.rows % dp:
        raise SystemExit(f"--rows {args.rows} must be a multiple of the recipe's DP size {dp}")
    return cfg


def rollout_batch(args, vocab: int, seed: int = 0):
    """A GRPO rollout batch in SkyRL's layout (``TrainingInputBatch``): rows of prompt + response
    (no padding: every token real), each group of ``--group`` rows sharing its prompt, GRPO
    advantages (SkyRL's ``compute_grpo_outcome_advantage``) of random 0/1 rewards."""
    import numpy as np
    import torch
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.ppo_utils import compute_grpo_outcome_advantage

    prompt, response = row_shape(args)
    gen = torch.Generator().manual_seed(seed)
    groups = args.rows // args.group
    prompts = torch.randint(1, vocab, (groups, prompt), generator=gen).repeat_interleave(args.group, 0)
    sequences = torch.cat([prompts, torch.randint(1, vocab, (args.rows, response), generator=gen)], 1)
    response_mask = torch.ones(args.rows, response, dtype=torch.long)
    rewards = torch.zeros(args.rows, response)
    rewards[:, -1] = torch.randint(0, 2, (args.rows,), generator=gen).float()
    advantages, _ = compute_grpo_outcome_advantage(
        rewards, response_mask, np.arange(args.rows) // args.group)
    batch = TrainingInputBatch({
        "sequences": sequences, "attention_mask": torch.ones_like(sequences),
        "response_mask": response_mask, "loss_mask": response_mask.float(), "advantages": advantages,
    })
    batch.metadata = {"response_length": response}
    return batch


def _peak_gib(worker, reset: bool):
    """Runs inside the actor (``__ray_call__``): this rank's allocator peak since the last reset,
    GiB (None on CPU); ``reset`` starts a new window."""
    import torch

    if not torch.cuda.is_available():
        return None
    if reset:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def wait(refs: list, what: str):
    """``ray.get`` with a line every ``HEARTBEAT_S`` while ``what`` still runs."""
    import ray

    start, pending = time.time(), list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=HEARTBEAT_S)
        if pending:
            log(f"  {what}: still running after {time.time() - start:.0f}s")
    return ray.get(refs)


class CallTimer:
    """Times worker calls through SkyRL's ``WorkerDispatch`` and keeps one row per call."""

    def __init__(self, dispatch, group, tokens: int, json_path: str | None, header: dict):
        self.dispatch, self.group, self.tokens = dispatch, group, tokens
        self.json_path, self.header, self.rows = json_path, header, []

    def _actors(self):
        return [info.handle for info in self.group.actor_infos]

    def call(self, step: int, name: str, fn, value_of, value_name: str, extras=None):
        """Run ``fn`` (one worker call) and log/keep its row: ``value_of(out)`` under
        ``value_name``, plus ``extras(out)`` (a dict) in the JSON."""
        wait([a.__ray_call__.remote(_peak_gib, True) for a in self._actors()], "peak reset")
        log(f"step {step} {name}: started")
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        peaks = [p for p in wait([a.__ray_call__.remote(_peak_gib, False) for a in self._actors()],
                                 "peak read") if p is not None]
        row = {"step": step, "call": name, "seconds": seconds, "tokens_per_s": self.tokens / seconds,
               "peak_gib": max(peaks) if peaks else None, value_name: value_of(out),
               **(extras(out) if extras else {})}
        self.rows.append(row)
        peak = "" if row["peak_gib"] is None else f"  peak {row['peak_gib']:.2f} GiB"
        log(f"step {step} {name}: {seconds:.3f} s  {row['tokens_per_s']:,.0f} tok/s{peak}  "
            f"{value_name} {row[value_name]:.6g}")
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump({**self.header, "calls": self.rows}, f, indent=2)
        return out


def run_steps(args, cfg, recipe, timer: CallTimer) -> None:
    """``--steps`` rounds of forward, forward_backward, optim_step on the same rollout batch."""
    import torch

    batch = rollout_batch(args, recipe.model.vocab_size, seed=recipe.train.seed)
    mask = batch["loss_mask"]
    reference = None
    for step in range(1, args.steps + 1):
        out = timer.call(step, "forward", lambda: timer.dispatch.forward("policy", batch),
                         lambda o: _mean_logprob(o, mask), "mean_logprob")
        logprobs = torch.tensor([s["logprobs"] for s in out.loss_fn_outputs])
        batch["action_log_probs"] = logprobs  # on-policy: the old log-probs are this step's
        if args.kl:
            # The reference worker holds the initial weights: the first step's log-probs.
            reference = logprobs if reference is None else reference
            batch["base_action_log_probs"] = reference
        out = timer.call(step, "forward_backward",
                         lambda: timer.dispatch.forward_backward("policy", batch),
                         lambda o: o.metrics["final_loss"], "final_loss",
                         lambda o: {"metrics": o.metrics})
        log(f"step {step} forward_backward metrics: " + json.dumps(
            {k: round(v, 6) for k, v in out.metrics.items() if k in
             ("policy_loss", "policy_kl", "policy_entropy", "policy_lr")}))
        timer.call(step, "optim_step", lambda: timer.dispatch.optim_step("policy"),
                   float, "grad_norm")


def _mean_logprob(out, mask) -> float:
    import torch

    logp = torch.tensor([s["logprobs"] for s in out.loss_fn_outputs])
    return float((logp * mask).sum() / mask.sum())


def summary(rows: list[dict]) -> None:
    """Median seconds and tokens/s per call over the steps after the first (which compiles), or
    the first when there is only one."""
    print("\ncall               steps  median s      tok/s  peak GiB")
    for name in ("forward", "forward_backward", "optim_step"):
        mine = [r for r in rows if r["call"] == name]
        timed = [r for r in mine if r["step"] > 1] or mine
        peaks = [r["peak_gib"] for r in mine if r["peak_gib"] is not None]
        peak = f"{max(peaks):9.2f}" if peaks else "        -"
        print(f"{name:<18}{len(timed):>6}{statistics.median(r['seconds'] for r in timed):>10.3f}"
              f"{statistics.median(r['tokens_per_s'] for r in timed):>11,.0f}{peak}")


def main(argv=None) -> int:
    args = parse_args(argv)
    prompt, response = row_shape(args)
    log(f"loading recipe {args.recipe} {' '.join(args.overrides)}")
    recipe = load_checked_recipe(args)
    cfg = skyrl_config(args, recipe)
    chunk = recipe.train.loss_chunk_tokens
    header = {
        "recipe": args.recipe, "overrides": args.overrides, "skyrl": args.skyrl,
        "device": recipe.run.device, "workers": recipe.run.num_workers,
        "tokens": args.rows * (prompt + response), "rows": args.rows, "group": args.group,
        "prompt_tokens": prompt, "response_tokens": response, "kl": args.kl,
        "policy_loss_type": cfg.trainer.algorithm.policy_loss_type,
        "loss_chunk_tokens": chunk, "params_dtype": recipe.model.params_dtype,
    }
    log(f"{recipe.run.num_workers} worker(s) on {recipe.run.device} "
        f"({'NCCL' if recipe.run.device == 'gpu' else 'gloo'}); batch {args.rows} rows x "
        f"({prompt} prompt + {response} response) tokens; log-probs "
        + (f"chunked (train.loss_chunk_tokens={chunk})" if chunk else "from each rank's full logits")
        + f"; KL loss {'on' if args.kl else 'off'}")

    import ray
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries
    from skyrl.backends.skyrl_train.workers.worker import PPORayActorGroup
    from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorker

    # Ray's worker processes inherit this environment: they import this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    workers = recipe.run.num_workers
    cpu = recipe.run.device == "cpu"
    log("starting a local Ray")
    # The workers' output (megatron lists every parameter) stays in Ray's session logs unless
    # asked for; a worker's exception still reaches this process with its traceback.
    ray.init(address="local", include_dashboard=False, log_to_driver=args.worker_logs,
             **({"num_cpus": workers + 1, "num_gpus": workers} if cpu else {}))
    if not args.worker_logs:
        log("the workers' output goes to Ray's session logs (/tmp/ray/session_latest/logs); "
            "--worker-logs prints it here")
    try:
        sync_registries()
        log(f"creating {workers} KDAPolicyWorker actor(s), one GPU each; process group")
        group = PPORayActorGroup(cfg.trainer, num_nodes=1, num_gpus_per_node=workers,
                                 ray_actor_type=KDAPolicyWorker)
        log("init_model: building the model (megatron-core, DDP, distributed optimizer)")
        wait(group.async_init_model(None, num_training_steps=args.steps), "init_model")
        timer = CallTimer(WorkerDispatch(cfg, policy_actor_group=group), group, header["tokens"],
                          args.json, header)
        if not cpu:
            log("the first GPU calls compile and autotune fla's Triton kernels (minutes on a "
                "fresh machine)")
        run_steps(args, cfg, recipe, timer)
    finally:
        ray.shutdown()
    bad = [r for r in timer.rows if not all(math.isfinite(v) for v in r.values()
                                            if isinstance(v, float))]
    summary(timer.rows)
    if bad:
        log(f"non-finite values: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
