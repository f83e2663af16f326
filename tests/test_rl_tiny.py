"""The RL example (``examples/rl_tiny/run_rl_tiny.sh``) end to end on CPU, as a user runs it:
SkyRL's ``main_base`` with the KDA entrypoint, SkyRL's real ``RayPPOTrainer.train()`` for 2 GRPO
steps with SkyRL's default KL loss, the KDA policy and reference workers as Ray actors, at TP1
(full fine-tuning) and at TP2 x CP2 +SP x EP2 with LoRA (``LORA_RANK=8``, the adapter-only weight
sync; the allgather KDA exchange, not the recipe's a2a, so that the job's own setting is seen to
reach the workers), the project's sampler from the disk-synced weights and the toy environment.
The KDA workers' RL calls at that mesh with every exchange equal CP1's in
tests/test_skyrl_rl.py (log-probs, the loss and the optimizer step), which is where the
exchanges' numerics are proven; this file proves SkyRL's launcher, trainer and sampler around
them. The rollouts (68-80 tokens: prompts of 44-56 words, up to 24 generated) are longer than
the recipe's ``index_topk`` (64), so DSA's selection decides what each query attends to.

Both meshes start from the same checkpoint (LoRA's B is zero), the sampler draws with the same
seed and SkyRL shuffles with the same seed, so step 1 samples the same rollouts: its reward is
equal and the policy's entropy over them agrees to 1e-5 (fp32 summation order; measured equal).
The sharper check of each mesh's forward is the sampler's: every token's log-prob within 1e-5 of
the trainer's (below).

The sampler and the trainer hold the same weights at each step (one optimizer step per training
step, the sync before the next rollouts), so SkyRL's ``policy/rollout_train_logprobs_abs_diff_max``
is fp32 rounding (about 1e-6) at step 1 (initial weights) and step 2 (after a step), merged
weights or adapters; a sync that was skipped or mapped a tensor wrongly shows as 0.1 or more
(the step moves the log-probs by more than 1e-3, checked in tests/test_skyrl_weight_sync.py), and
so does a sampler that breaks the indexer's exact-zero ties differently from the trainer (the
recipe has 2 indexer heads).

The TP1 job runs colocated (``trainer.placement.colocate_all=true``, SkyRL's default; the
example's own is false, as the TP2 x CP2 job runs): SkyRL's dispatch offloads and backloads the
workers around generation, the reference forward, training and the weight sync, and the sampler
sleeps and wakes; the workers' log lines show the calls, alternating as SkyRL's dispatch tracks
residency. It checkpoints every step through SkyRL's trainer (``trainer.ckpt_interval=1``), and a
second TP1 job, not colocated, is resumed through SkyRL's trainer from its step-1 checkpoint
(``trainer.resume_mode=from_path``; SkyRL restores its step and data loader and calls the policy
worker's ``load_checkpoint``). The resumed job's step 2 equals the uninterrupted job's step 2 bit
for bit (every metric but wall-clock timings: rollouts, rewards, log-probs, loss, KL, grad norm),
and so do the weights it publishes after step 2 and its step-2 checkpoint's data file (model,
Adam moments, LR schedule, step, RNG). One process or two, colocated or not, the same fp32
operations run in the same order on the same inputs (on CPU the offloads free and refill the same
memory), so nothing short of bitwise is expected; a restart that lost the Adam moments, the
schedule's step or the sampler's stream, or an offload that lost or moved a tensor, would differ
at order 1e-3 or more (the step-1 and step-2 checkpoints differ: the negative control).
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.support.rl_tiny_jobs import launch, worker_log

STEPS = 2


CHECKPOINTS = ["trainer.ckpt_interval=1"]  # SkyRL saves after every step
RESUME_FROM = 1
LORA_RANK = 8
ADAPTER_SYNC = "trainer.policy.megatron_config.lora_config.merge_lora=false"
# job -> (mesh, extra SkyRL settings, LoRA rank): TP1 colocated and checkpointed, full
# fine-tuning; TP2 x CP2 with LoRA and the adapter-only weight sync
JOBS = {
    "tp1_colocated": ("tp1", [*CHECKPOINTS, "trainer.placement.colocate_all=true"], None),
    "tp2cp2_lora": ("tp2cp2", ["trainer.kda.cp_exchange=allgather", ADAPTER_SYNC], LORA_RANK),
}
ENTROPY_TOL = 1e-5  # fp32 summation order


def _run(name: str, tmp_path_factory) -> dict:
    mesh, extra, lora_rank = JOBS[name]
    return launch(name, tmp_path_factory, mesh=mesh, steps=STEPS, settings=extra,
                  lora_rank=lora_rank)


def _resumed(tmp_path_factory) -> dict:
    """A TP1 job not colocated (the example's setting), resumed through SkyRL's trainer from the
    colocated TP1 job's step-1 checkpoint."""
    whole = _run("tp1_colocated", tmp_path_factory)
    resume = ["trainer.resume_mode=from_path",
              f"trainer.resume_path={whole['work'] / 'ckpt' / f'global_step_{RESUME_FROM}'}"]
    return launch("tp1_resumed", tmp_path_factory, mesh="tp1", steps=STEPS,
                  settings=[*CHECKPOINTS, *resume])


@pytest.fixture(scope="module", params=JOBS)
def job(request, tmp_path_factory) -> dict:
    return _run(request.param, tmp_path_factory)


def _steps(job) -> dict:
    return job["steps"]


def test_two_grpo_steps_ran_through_skyrls_trainer(job):
    steps = _steps(job)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, m in steps.items():
        assert "reward/avg_raw_reward" in m, f"step {step}: no reward logged"
        assert 0 <= m["reward/avg_raw_reward"] <= 1
        assert m["policy/grad_norm"] > 0, f"step {step}: no gradient"
    # SkyRL's default KL loss: the reference starts as the policy, so KL is 0 until a step.
    assert steps[1]["policy/policy_kl"] == 0.0
    assert steps[2]["policy/policy_kl"] > 0.0
    # the plugin's step lines: one per step, small numbers in scientific notation, in steps.log;
    # the console shows them as Ray forwards the trainer task's output (it may drop the last)
    lines = (job["work"] / "logs" / "steps.log").read_text().splitlines()
    assert len(lines) == STEPS and all(re.match(r"step \d+ \| reward", line) for line in lines)
    assert re.search(r"logprob drift \d\.\d\de-\d\d", lines[0]) and "KDA exchange" in lines[0]
    console = [line for line in job["stdout"].splitlines() if re.search(r"\bstep \d+ \| reward", line)]
    assert console and all(shown.endswith(line) for shown, line in zip(console, lines)), console
    assert "policy/policy_entropy" not in job["stdout"]  # SkyRL's full dump: metrics.jsonl only
    config = job["work"] / "logs" / "skyrl_config.yaml"  # SkyRL's 500-line config: a file
    assert f"SkyRL's config of this job: {config}" in job["output"]  # SkyRL's log: stderr
    assert "trainer:" in config.read_text() and "generator:" not in job["output"]


def test_each_worker_group_says_once_what_it_built(tmp_path_factory):
    """The console says once per group what it built (mesh, KDA exchange, DSA kernel: the exchange
    the job asked for, not the recipe's default), and so does each group's first rank in the
    workers' log."""
    job = _run("tp2cp2_lora", tmp_path_factory)
    for role in ("policy", "reference"):
        for where in (job["stdout"], worker_log(job)):
            lines = [line for line in where.splitlines() if f"{role}: 4 ranks built:" in line]
            assert len(lines) == 1, (role, lines)
            assert all(part in lines[0] for part in ("TP2 x CP2 +SP", "KDA exchange allgather",
                                                     "DSA kernel torch")), lines[0]


def test_sampler_logprobs_equal_the_trainers_before_and_after_a_step(job):
    for step, m in _steps(job).items():
        diff = m["policy/rollout_train_logprobs_abs_diff_max"]
        assert diff < 1e-5, f"step {step}: sampler vs trainer log-probs differ by {diff:.1e}"


def test_each_step_published_a_new_version(job):
    weights = job["work"] / "export" / "sampler_weights"
    # v1 = the initial weights, then one per step; the newest two are kept.
    assert sorted(os.listdir(weights)) == ["LATEST", f"v{STEPS:06d}", f"v{STEPS + 1:06d}"]
    assert (weights / "LATEST").read_text().strip() == f"v{STEPS + 1:06d}"


def test_step_one_is_the_same_on_every_mesh(tmp_path_factory):
    """Step 1 samples and scores the initial weights on both meshes (LoRA's B is zero): the same
    rollouts, so the same reward, and the policy's entropy over them agrees to fp32 summation
    order. The gradients at TP2 x CP2 against CP1 are tests/test_skyrl_rl.py's."""
    one, four = (_steps(_run(job, tmp_path_factory))[1] for job in JOBS)
    assert one["reward/avg_raw_reward"] == four["reward/avg_raw_reward"]  # the same rollouts
    h1, h4 = one["policy/policy_entropy"], four["policy/policy_entropy"]
    assert abs(h4 - h1) / h1 < ENTROPY_TOL, f"entropy {h4} vs {h1}"


WALL_CLOCK = re.compile(r"timing/|trainer/tokens_per_second")


def _deterministic(metrics: dict) -> dict:
    """A step's metrics without the wall-clock ones."""
    return {k: v for k, v in metrics.items() if not WALL_CLOCK.match(k)}


def _checkpoint_state(work: Path, step: int, tmp_path_factory) -> dict:
    """Everything the policy worker's checkpoint at SkyRL's ``step`` holds (model, optimizer
    state, schedule, step, data position, RNG), read back with torch's DCP converter. Contents,
    not bytes: pickling a restored scheduler memoises its strings differently."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = work / "ckpt" / f"global_step_{step}" / "policy" / "checkpoints" / f"step_{step:08d}"
    out = tmp_path_factory.mktemp("checkpoint") / "state.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def _differences(a, b, path: str = "") -> list:
    """Paths where two checkpoint states differ (tensors bitwise, dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        same = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
        return [] if same else [path]
    if isinstance(a, io.BytesIO):
        return [] if isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue() else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [path]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _published_weights(work: Path) -> bytes:
    weights = work / "export" / "sampler_weights"
    latest = weights / (weights / "LATEST").read_text().strip()
    return b"".join(f.read_bytes() for f in sorted(latest.glob("*.safetensors")))


def test_a_resumed_job_continues_exactly_like_the_uninterrupted_one(tmp_path_factory):
    whole, resumed = _run("tp1_colocated", tmp_path_factory), _resumed(tmp_path_factory)
    steps = _steps(resumed)
    assert sorted(steps) == [RESUME_FROM + 1], "SkyRL did not continue from the checkpoint's step"
    later = _steps(whole)[RESUME_FROM + 1]
    assert _deterministic(steps[RESUME_FROM + 1]) == _deterministic(later)
    assert later["policy/policy_kl"] > 0  # the reference, rebuilt from its path, is the same too
    assert _published_weights(resumed["work"]) == _published_weights(whole["work"])


def test_resume_restores_optimizer_state_schedule_and_step_not_only_weights(tmp_path_factory):
    whole, resumed = _run("tp1_colocated", tmp_path_factory), _resumed(tmp_path_factory)
    # After one more step from the restored state, the whole training state is bit-identical:
    # the weights, Adam's moments and step count, the LR schedule, the trainer's step, the data
    # position, the RNG streams.
    step = RESUME_FROM + 1
    later = _checkpoint_state(whole["work"], step, tmp_path_factory)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in later)
    common = later["common_state/shard_0_1"][0]  # optimizer param groups, schedule, step, ...
    assert common["step"] == step and common["scheduler"]["num_steps"] == step
    assert _differences(_checkpoint_state(resumed["work"], step, tmp_path_factory), later) == []
    # Negative control: a step changes that state (weights, moments, schedule and step).
    earlier = _checkpoint_state(whole["work"], RESUME_FROM, tmp_path_factory)
    changed = _differences(earlier, later)
    for part in ("embedding.weight", "optimizer.state.exp_avg.embedding.weight",
                 "optimizer.state.exp_avg_sq.embedding.weight", "common_state/shard_0_1"):
        assert any(d.startswith(f"/{part}") for d in changed), part
    assert "KDAPolicyWorkerBase rank 0: restored checkpoint step 1" in worker_log(resumed)


OFFLOAD_CALL = re.compile(r"(KDA\w+WorkerBase) rank 0: (offload_to_cpu|backload_to_gpu)"
                          r"\(model=(True|False), optimizer=(True|False)\)")


def _offload_calls(job) -> dict:
    """worker class -> its (call, model, optimizer) in order, from the workers' log lines."""
    calls: dict = {}
    for worker, call, model, optimizer in OFFLOAD_CALL.findall(worker_log(job)):
        calls.setdefault(worker, []).append((call, model == "True", optimizer == "True"))
    return calls


def test_colocate_all_offloads_and_backloads_around_each_phase(tmp_path_factory):
    """What the colocated job's workers were asked to move, against the plain (resumed) job's.
    That the moves change nothing (the colocated job's step 2 and its weights equal the plain
    job's bit for bit) is test_a_resumed_job_continues_exactly_like_the_uninterrupted_one."""
    colocated, plain = _run("tp1_colocated", tmp_path_factory), _resumed(tmp_path_factory)

    calls = _offload_calls(colocated)
    assert set(calls) == {"KDAPolicyWorkerBase", "KDARefWorkerBase"}
    for worker, sequence in calls.items():
        # SkyRL offloads everything after init_model, then backloads what each phase needs
        assert sequence[0] == ("offload_to_cpu", True, True), (worker, sequence)
        assert ("backload_to_gpu", True, False) in sequence, (worker, sequence)
    # colocate_all also offloads the policy around each weight sync (colocate_policy_ref alone,
    # the plain job, offloads it only when the reference needs the GPU): more offloads per step
    # (the plain job ran one step, the colocated one STEPS)
    offloads = [c for c in calls["KDAPolicyWorkerBase"] if c[0] == "offload_to_cpu"]
    plain_offloads = [c for c in _offload_calls(plain).get("KDAPolicyWorkerBase", [])
                      if c[0] == "offload_to_cpu"]
    assert len(offloads) / STEPS > len(plain_offloads) / len(_steps(plain)), \
        (offloads, plain_offloads)


# -- LoRA (run_rl_tiny.sh LORA_RANK=8): the TP2 x CP2 job --------------------------------------
# SkyRL's all-linear targets (the routed experts' shared adapters included) and merge_lora=false:
# each sync publishes the adapters alone, gathered over TP and EP, and the sampler adds them to
# the base (merge_lora=true's merged sync is tests/test_lora_skyrl.py's, on the worker's calls).
# The sampler's log-probs are test_sampler_logprobs_equal_the_trainers_before_and_after_a_step's.

@pytest.fixture(scope="module")
def lora_job(tmp_path_factory) -> dict:
    return _run("tp2cp2_lora", tmp_path_factory)


def test_lora_trains_with_finite_reward_and_small_kl(lora_job):
    steps = _steps(lora_job)
    for step, m in steps.items():
        assert 0 < m["policy/grad_norm"] < float("inf"), f"step {step}: no gradient"
    assert 0.0 < steps[2]["policy/policy_kl"] < 0.1, steps[2]["policy/policy_kl"]


def test_lora_publishes_adapters_that_move_only_the_adapted_linears(lora_job):
    """After 2 steps the published version holds the adapter folder alone, naming the job's base
    checkpoint; added to it, the tensors no adapter sits on (embedding, norms, routers, DSA's
    kv_b, KDA's f_b/g_b and conv) are the base's bitwise and the adapted ones moved."""
    from skyrl_megatron_kda.model.hf_io import SafetensorsCheckpoint
    from skyrl_megatron_kda.train.peft_adapters import merge_adapter_folder

    weights = lora_job["work"] / "export" / "sampler_weights"
    version = weights / (weights / "LATEST").read_text().strip()
    assert sorted(p.name for p in version.iterdir()) == [
        "TRAIN_STEP", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((version / "adapter_config.json").read_text())
    base_dir = lora_job["work"] / "glm53_flash_tiny-hf"
    assert Path(config["base_model_name_or_path"]) == base_dir
    base = SafetensorsCheckpoint(base_dir)
    published = merge_adapter_folder(version, base)
    moved = {n for n in published if not torch.equal(published[n], base.get(n))}
    text = "model.language_model."
    for name in ("embed_tokens.weight", "norm.weight", "layers.0.self_attn.f_b_proj.weight",
                 "layers.0.self_attn.q_conv1d.weight", "layers.3.self_attn.kv_b_proj.weight",
                 "layers.1.mlp.gate.weight", "layers.1.mlp.gate.e_score_correction_bias"):
        assert text + name in published and text + name not in moved, name
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.f_a_proj.weight",
                 "layers.3.self_attn.q_b_proj.weight", "layers.3.self_attn.o_proj.weight",
                 "layers.1.mlp.experts.0.gate_proj.weight"):
        assert text + name in moved, name
    assert all(n.endswith(("proj.weight", "mqa.weight")) for n in moved), sorted(moved)[:5]
