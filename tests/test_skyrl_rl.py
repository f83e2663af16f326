"""SkyRL's RL worker calls on the KDA policy worker: ``forward`` (log-probs of a padded rollout
batch), ``forward_backward`` (SkyRL's own policy loss) and ``optim_step``, then the checkpoint
calls (``save_checkpoint`` / ``load_checkpoint`` / ``finalize_pending_saves`` / ``save_hf_model``),
on spawned gloo ranks with the tiny recipe (fp32).

One rank at TP1 x CP1 (EP1) builds the worker, writes its initial weights as a glm5_next folder and
runs forward, forward_backward and optim_step; the oracle for its log-probs is log_softmax of the
same model's logits on each unpadded sequence alone (no packing, no CP). Four ranks at TP2 x CP2
(+SP, EP2) load those weights (``run.init_from_hf``) and run the same calls for each KDA CP
exchange. A wrong CP gather, a mis-shifted label or a padding column read as a token gives
log-prob errors above 1e-2 relative (the random model's log-probs spread over about -5.2 ..
-6.1); the tolerance is 1e-5 relative (measured about 1e-7), 1e-4 for the ``state`` exchange's
fp32 state chain.

The worker is built without Ray (``object.__new__``): SkyRL's actor ``__init__`` redirects the
process's output to files and reads Ray's GPU ids; everything the RL calls use is set by
``init_worker_process_group`` / ``init_model``, exactly as on a cluster.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch

from skyrl_megatron_kda.config import CP_EXCHANGE_ENV
from tests.support.ranks import run_ranks

TEMPERATURE = 0.7
PROMPTS, RESPONSES = (6, 3, 4), (8, 5, 7)  # rows of 14, 8 and 11 tokens, left-padded to 14
EXCHANGES = ("a2a", "allgather", "state")
TOL = {"a2a": 1e-5, "allgather": 1e-5, "state": 1e-4}
# TP2 x CP2 runs: one per exchange, and one with the chunked loss (train.loss_chunk_tokens: the
# log-probs and entropy without the logits; 5 divides no micro-batch's tokens per rank)
CP2_RUNS = {**{name: [f"kda.cp_exchange={name}"] for name in EXCHANGES},
            "a2a_chunked_loss": ["kda.cp_exchange=a2a", "train.loss_chunk_tokens=5"]}
ADAM_EPS = 1e-3
STEP_TOL = 1e-3  # per tensor, relative; measured about 1.5e-5 (a dropped CP shard: order 1)
CP1 = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
       "run.num_workers=1"]
CP2 = ["parallel.tp=2", "parallel.cp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
       "run.num_workers=4"]


def _cfg(overrides: list[str], workers: int, skyrl: tuple[str, ...] = (
        "trainer.placement.colocate_all=false", "trainer.algorithm.use_kl_loss=false")):
    """SkyRL's config of the tests' job: the tiny recipe with ``overrides`` (recipe keys), the
    SkyRL settings ``skyrl`` (default: no colocation, no KL); fp32 and the tiny recipe's LR,
    set through SkyRL's own fields (they decide them under SkyRL)."""
    from skyrl_megatron_kda.integrations.skyrl.config import KDASkyRLConfig

    return KDASkyRLConfig.from_cli_overrides([
        "trainer.strategy=megatron", "trainer.logger=console", *skyrl,
        f"trainer.placement.policy_num_gpus_per_node={workers}",
        f"trainer.placement.ref_num_gpus_per_node={workers}",
        f"generator.inference_engine.num_engines={workers}",
        f"trainer.algorithm.temperature={TEMPERATURE}",
        "trainer.bf16=false", "trainer.policy.optimizer_config.lr=3e-3",
        # 3 rows in micro-batches of 2: two packed rows per call, the second with one sequence.
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.micro_forward_batch_size_per_gpu=2",
        "trainer.kda.recipe=glm53_flash_tiny",
        *[f"trainer.kda.overrides.{o}" for o in overrides]])


def _batch():
    """SkyRL's layout (``TrainingInput``): every row left-padded, so the response is the last
    ``r`` tokens and its masks are right-aligned in the ``response_length`` columns; one response
    token is masked out of the loss."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    gen = torch.Generator().manual_seed(11)
    width, r_max = max(p + r for p, r in zip(PROMPTS, RESPONSES)), max(RESPONSES)
    sequences = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    attention_mask = torch.zeros_like(sequences)
    response_mask = torch.zeros(len(PROMPTS), r_max, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        sequences[i, width - p - r:] = torch.randint(1, 256, (p + r,), generator=gen)
        attention_mask[i, width - p - r:] = 1
        response_mask[i, r_max - r:] = 1
    loss_mask = response_mask.float()
    loss_mask[1, -2] = 0.0
    batch = TrainingInputBatch({
        "sequences": sequences, "attention_mask": attention_mask, "response_mask": response_mask,
        "loss_mask": loss_mask, "advantages": torch.randn(loss_mask.shape, generator=gen) * loss_mask,
    })
    batch.metadata = {"response_length": r_max}
    return batch


def _workers_of(overrides: list[str]) -> int:
    return int(next(o for o in overrides if o.startswith("run.num_workers")).split("=")[1])


def _worker(overrides: list[str], skyrl: tuple[str, ...] | None = None, model_path=None):
    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorkerBase

    worker = object.__new__(KDAPolicyWorkerBase)
    cfg = _cfg(overrides, _workers_of(overrides), *([skyrl] if skyrl is not None else []))
    worker.cfg = cfg.trainer
    worker.init_worker_process_group()
    worker.init_model(model_path)
    # Adam's first step moves each weight by lr * g / (|g| + eps): with the default eps (1e-8)
    # that is lr * sign(g) for all but the tiniest gradients, which would hide a wrong gradient
    # and amplify rounding in the tiny ones by lr / eps; with eps above the (clipped) gradients
    # the step is a smooth function of the gradient, so equal steps mean equal gradients.
    for group in worker.trainer.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return worker


def _weights(worker) -> dict:
    from skyrl_megatron_kda.model.hf_io import export_hf_tensors

    return {name: t.clone() for name, t in export_hf_tensors(worker.trainer.model.module)}


def _rl_calls(worker, old: torch.Tensor | None = None) -> dict:
    """forward, then forward_backward + optim_step. The old log-probs are near the current ones
    (so the PPO ratio clips some tokens, not all): drawn around this run's log-probs at CP1, and
    the CP1 run's passed in at CP2 (the same loss inputs on every mesh)."""
    batch = _batch()
    worker.trainer.model.module.reset_cp_bytes()
    logprobs = torch.tensor([s["logprobs"] for s in worker.forward(batch).loss_fn_outputs])
    if old is None:
        noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(5))
        old = (logprobs + 0.15 * noise) * batch["response_mask"]
    batch["action_log_probs"] = old
    out = worker.forward_backward(batch)
    grad_norm = worker.optim_step()
    return {"logprobs": logprobs, "old": old, "metrics": out.metrics,
            "outputs": out.loss_fn_outputs, "grad_norm": grad_norm,
            "exchange": worker.trainer.recipe.kda.cp_exchange,
            "cp_bytes": worker.trainer.model.module.cp_bytes()}


def _cp1_rank(rank, world, hf_dir):
    from skyrl_megatron_kda.model.hf_io import save_hf_checkpoint

    worker = _worker(CP1)
    save_hf_checkpoint(worker.trainer.model.module, hf_dir)
    before = _weights(worker)
    # The oracle: each sequence's real tokens alone through the model, log_softmax of its logits.
    batch, model = _batch(), worker.trainer.model.module
    model.eval()
    oracle = torch.zeros(batch["sequences"].shape)
    with torch.no_grad():
        for i, (seq, mask) in enumerate(zip(batch["sequences"], batch["attention_mask"])):
            cols = mask.nonzero().squeeze(1)
            logits = model(seq[cols][None])[0].float() / TEMPERATURE
            logp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, seq[cols][1:, None])[:, 0]
            oracle[i, cols[1:]] = logp
    result = _rl_calls(worker)
    result["after"] = _weights(worker)
    # SkyRL's SFT loss through the same call (gradients only: no step follows).
    batch["action_log_probs"] = result["old"]
    now = torch.tensor([s["logprobs"] for s in worker.forward(batch).loss_fn_outputs])
    sft = worker.forward_backward(batch, loss_fn="cross_entropy")
    result["checkpoint"] = _checkpoint_calls(worker)
    worker.trainer.close()
    return {**result, "oracle": oracle[:, -max(RESPONSES):], "before": before,
            "sft": {"logprobs": now, "metrics": sft.metrics, "outputs": sft.loss_fn_outputs}}


def _checkpoint_calls(worker) -> dict:
    """SkyRL's checkpoint calls as its trainer makes them: save to ``global_step_N/policy``, step
    on (the SFT gradients accumulated before), load the same folder, finalize, export to HF."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        policy = os.path.join(tmp, "global_step_1", "policy")
        worker.save_checkpoint(policy)
        saved, saved_lr = _weights(worker), worker.get_lr()
        worker.optim_step()
        stepped = _weights(worker)
        try:
            worker.load_checkpoint(os.path.join(tmp, "global_step_2", "policy"))
            missing = ""
        except FileNotFoundError as err:
            missing = str(err)
        resumed_step = worker.load_checkpoint(policy)
        worker.finalize_pending_saves()
        worker.save_hf_model(os.path.join(tmp, "hf"))
        exported = {}
        for name in sorted(os.listdir(os.path.join(tmp, "hf"))):
            if name.endswith(".safetensors"):
                exported.update(load_file(os.path.join(tmp, "hf", name)))
        return {"saved": saved, "saved_lr": saved_lr, "stepped": stepped, "missing": missing,
                "resumed_step": resumed_step, "loaded": _weights(worker), "lr": worker.get_lr(),
                "exported": exported}


def _cp2_rank(rank, world, hf_dir, old):
    out = {}
    for name, overrides in CP2_RUNS.items():
        worker = _worker([*CP2, *overrides, f"run.init_from_hf={hf_dir}"])
        result = _rl_calls(worker, old)
        result["after"] = _weights(worker)
        worker.trainer.close()
        out[name] = result if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def runs():
    """{"cp1": ..., "cp2": {exchange: ...}}: one 1-rank and one 4-rank spawn for all tests."""
    mp = pytest.MonkeyPatch()
    mp.delenv(CP_EXCHANGE_ENV, raising=False)  # the spawned ranks inherit the environment
    try:
        with tempfile.TemporaryDirectory() as hf_dir:
            cp1 = run_ranks(1, _cp1_rank, hf_dir)[0]
            cp2 = run_ranks(4, _cp2_rank, hf_dir, cp1["old"])[0]
    finally:
        mp.undo()
    return {"cp1": cp1, "cp2": cp2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _response_columns():
    """[B, R] mask of the response-block columns that hold a prediction: a real token that is not
    its row's first (the others, padding, must be 0). Shorter responses leave prompt tokens in
    the block; those are predicted too, as in SkyRL's workers, and masked by the loss."""
    mask = _batch()["attention_mask"].bool()
    predicted = mask & (mask.cumsum(dim=1) > 1)
    return predicted[:, -max(RESPONSES):]


def test_cp1_logprobs_equal_log_softmax_of_the_models_logits(runs):
    cp1, real = runs["cp1"], _response_columns()
    assert cp1["logprobs"].shape == real.shape
    err = _rel(cp1["logprobs"][real], cp1["oracle"][real])
    assert err < 1e-5, f"packed TP1 x CP1 log-probs vs per-sequence log_softmax: {err:.1e}"
    assert (cp1["logprobs"][~real] == 0).all()  # padding columns carry no prediction
    assert float(cp1["logprobs"][real].max()) < 0


@pytest.mark.parametrize("run", CP2_RUNS)
def test_tp2_cp2_logprobs_equal_cp1(runs, run):
    cp1, cp2, real = runs["cp1"], runs["cp2"][run], _response_columns()
    err = _rel(cp2["logprobs"][real], cp1["logprobs"][real])
    tol = TOL[cp2["exchange"]]
    assert err < tol, f"{run}: TP2 x CP2 vs TP1 x CP1 log-probs differ by {err:.1e}"
    assert (cp2["logprobs"][~real] == 0).all()


def test_policy_loss_is_skyrls_loss_on_the_cp1_logprobs(runs):
    """forward_backward's policy_loss equals SkyRL's registered loss applied to the log-probs
    ``forward`` returned, micro-batch by micro-batch (summed, as SkyRL's workers report it)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    cp1 = runs["cp1"]
    algorithm = _cfg(CP1, 1).trainer.algorithm
    loss_fn = PolicyLossRegistry.get(algorithm.policy_loss_type)
    batch = _batch()
    expected, clipped = 0.0, []
    for rows in (slice(0, 2), slice(2, 3)):
        loss, metrics = loss_fn(cp1["logprobs"][rows], cp1["old"][rows], batch["advantages"][rows],
                                config=algorithm, loss_mask=batch["loss_mask"][rows])
        expected += float(loss)
        clipped.append(metrics["clip_ratio"])
    m = cp1["metrics"]
    assert abs(m["policy_loss"] - expected) <= 1e-5 * abs(expected), (m["policy_loss"], expected)
    assert m["final_loss"] == pytest.approx(m["policy_loss"])  # no entropy / KL term configured
    assert m["loss_metrics/clip_ratio"] == pytest.approx(sum(clipped) / 2)
    assert 0 < sum(clipped) < 2  # some tokens clipped, not all: the loss has a gradient
    assert {"policy_entropy", "policy_kl", "policy_lr"} <= set(m)
    assert m["policy_entropy"] > 0
    # Per-sample log-probs: the last valid_len response values, as SkyRL's workers return them.
    assert [len(o["logprobs"]) for o in cp1["outputs"]] == list(RESPONSES)
    for out, row, r in zip(cp1["outputs"], cp1["logprobs"], RESPONSES):
        assert out["logprobs"] == pytest.approx(row[-r:].tolist(), rel=1e-5)


def test_cross_entropy_loss_fn_gives_skyrls_sft_metrics(runs):
    """forward_backward(loss_fn="cross_entropy"): SkyRL's registered SFT loss on the current
    log-probs, with its metric names and per-token elementwise_loss."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    sft, batch = runs["cp1"]["sft"], _batch()
    algorithm = _cfg(CP1, 1).trainer.algorithm
    loss_fn = PolicyLossRegistry.get("cross_entropy")
    expected = sum(float(loss_fn(sft["logprobs"][rows], None, batch["advantages"][rows],
                                 config=algorithm, loss_mask=batch["loss_mask"][rows])[0])
                   for rows in (slice(0, 2), slice(2, 3)))
    assert set(sft["metrics"]) == {"loss", "response_length"}
    assert sft["metrics"]["loss"] == pytest.approx(expected, rel=1e-5)
    assert expected > 0
    assert [len(o["elementwise_loss"]) for o in sft["outputs"]] == list(RESPONSES)


@pytest.mark.parametrize("run", CP2_RUNS)
def test_step_changes_weights_and_matches_cp1(runs, run):
    """optim_step moves the weights; loss, grad norm and every tensor's step agree across meshes
    (the step is a smooth function of the gradient, see ADAM_EPS, so this compares gradients),
    with the chunked loss too (its entropy enters policy_entropy)."""
    cp1, cp2 = runs["cp1"], runs["cp2"][run]
    exchange = cp2["exchange"]
    assert exchange == CP2_RUNS[run][0].split("=")[1] and cp2["cp_bytes"] > 0  # KDA crossed CP
    tol = TOL[exchange]
    assert cp1["grad_norm"] > 0
    moved = max(float((cp1["after"][k] - cp1["before"][k]).abs().max()) for k in cp1["before"])
    assert moved > 1e-4, "optim_step did not change the weights"
    for key in ("policy_loss", "final_loss", "policy_entropy"):
        a, b = cp2["metrics"][key], cp1["metrics"][key]
        assert abs(a - b) <= tol * abs(b), f"{exchange}: {key} {a} vs {b}"
    err = abs(cp2["grad_norm"] - cp1["grad_norm"]) / cp1["grad_norm"]
    assert err < tol, f"{exchange}: grad norm {cp2['grad_norm']} vs {cp1['grad_norm']}"
    assert set(cp2["after"]) == set(cp1["after"])
    for name, w in cp1["after"].items():
        if name.endswith("e_score_correction_bias"):
            # Not a gradient step: the router moves it by a fixed rate against the token count
            # per expert, which includes the padding tokens, and documents are padded to 2*cp
            # tokens (0 extra at CP1, several at CP2), so the counts differ by mesh by design.
            continue
        step1, step2 = w - cp1["before"][name], cp2["after"][name] - cp1["before"][name]
        if not step1.any():  # frozen (the DSA indexer): it must stay put on every mesh
            assert not step2.any(), f"{exchange}: {name} is frozen at CP1 but moved"
            continue
        err = float((step2 - step1).norm() / step1.norm())
        assert err < STEP_TOL, f"{exchange}: {name} stepped {err:.1e} apart from CP1"


def test_skyrl_checkpoint_calls_restore_the_saved_step(runs):
    """load_checkpoint(ckpt_dir) restores what save_checkpoint(ckpt_dir) wrote (SkyRL passes the
    same folder to both), after a step that moved the weights away from it."""
    ck = runs["cp1"]["checkpoint"]
    moved = max(float((ck["stepped"][k] - ck["saved"][k]).abs().max()) for k in ck["saved"])
    assert moved > 1e-4, "the step after the save did not change the weights"
    assert ck["resumed_step"] == 1
    assert set(ck["loaded"]) == set(ck["saved"])
    for name, w in ck["saved"].items():
        assert torch.equal(ck["loaded"][name], w), f"{name} differs from the saved checkpoint"
    assert ck["lr"] == ck["saved_lr"]
    assert "holds no checkpoint" in ck["missing"]


def test_save_hf_model_exports_the_models_weights(runs):
    ck = runs["cp1"]["checkpoint"]
    assert set(ck["exported"]) == set(ck["loaded"])
    for name, w in ck["loaded"].items():
        assert torch.equal(ck["exported"][name], w), name


def test_set_lr_is_refused_not_ignored():
    """SkyRL's inherited set_lr would return without effect (this worker's optimizer lives in its
    trainer); the worker refuses it instead."""
    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorkerBase

    worker = object.__new__(KDAPolicyWorkerBase)
    with pytest.raises(NotImplementedError, match="recipe's train schedule"):
        worker.set_lr(1e-5)


# -- reference model, KL and colocation (one rank, TP1) ------------------------------------------
# The initial weights are written as an HF folder, loaded by a reference worker (forward only) and
# by two policy workers with SkyRL's KL loss: one offloaded and backloaded around every call in
# the order SkyRL's WorkerDispatch uses under colocate_all=true, one never offloaded.

KL_COEF = 0.5
KL_JOB = ("trainer.algorithm.use_kl_loss=true", f"trainer.algorithm.kl_loss_coef={KL_COEF}",
          "trainer.algorithm.kl_estimator_type=k3")


def _ref(overrides: list[str], skyrl: tuple[str, ...], model_path: str):
    from skyrl_megatron_kda.integrations.skyrl.reference import KDARefWorkerBase

    ref = object.__new__(KDARefWorkerBase)
    ref.cfg = _cfg(overrides, _workers_of(overrides), skyrl).trainer
    ref.init_worker_process_group()
    ref.init_model(model_path)
    return ref


def _buffer_storage(worker) -> dict:
    """Storage sizes of DDP's parameter and gradient buffers (dense and expert)."""
    ddp = worker.trainer.model
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    return {"params": [b.param_data.untyped_storage().size() for b in buffers],
            "grads": [b.grad_data.untyped_storage().size() for b in buffers]}


def _kl_steps(worker, base: torch.Tensor, colocate: bool) -> dict:
    """Two RL steps with ``base`` as the reference's log-probs. With ``colocate``, SkyRL's
    dispatch order: everything offloaded after init_model; forward backloads the model only,
    forward_backward the optimizer too; after the step (the weight sync) both are offloaded."""
    out = {"steps": [], "offloaded": [], "backloaded": []}
    if colocate:
        worker.offload_to_cpu()
        out["offloaded"].append(_buffer_storage(worker))
    for _ in range(2):
        batch = _batch()
        if colocate:
            worker.backload_to_gpu(backload_optimizer=False, backload_model=True)
        logprobs = torch.tensor([s["logprobs"] for s in worker.forward(batch).loss_fn_outputs])
        if colocate:
            worker.backload_to_gpu(backload_optimizer=True, backload_model=False)
            out["backloaded"].append(_buffer_storage(worker))
        batch["action_log_probs"] = logprobs
        batch["base_action_log_probs"] = base
        metrics = worker.forward_backward(batch).metrics
        grad_norm = worker.optim_step()
        if colocate:
            worker.offload_to_cpu(offload_optimizer=True, offload_model=True)
            out["offloaded"].append(_buffer_storage(worker))
        out["steps"].append({"logprobs": logprobs, "metrics": metrics, "grad_norm": grad_norm})
    if colocate:
        worker.backload_to_gpu()
    out["after"] = _weights(worker)
    worker.trainer.close()
    return out


def _kl_rank(rank, world, hf_dir):
    from megatron.core.distributed import DistributedDataParallel

    from skyrl_megatron_kda.model.hf_io import save_hf_checkpoint

    seeded = _worker(CP1)
    save_hf_checkpoint(seeded.trainer.model.module, hf_dir)
    seeded.trainer.close()
    ref = _ref(CP1, KL_JOB, hf_dir)
    ref_is_bare = (not isinstance(ref.trainer.model, DistributedDataParallel)
                   and not hasattr(ref.trainer, "optimizer"))
    ref.offload_to_cpu()  # SkyRL offloads the reference after init_model under colocation
    ref.backload_to_gpu()
    base = torch.tensor([s["logprobs"] for s in ref.forward(_batch()).loss_fn_outputs])
    ref.init_model(hf_dir)  # update_ref_every_epoch: init_model again, on the same process
    again = torch.tensor([s["logprobs"] for s in ref.forward(_batch()).loss_fn_outputs])
    ref.trainer.close()
    worker = _worker(CP1, KL_JOB + ("trainer.placement.colocate_all=false",), hf_dir)
    r = worker.trainer.recipe
    built = {"lr": r.train.lr, "min_lr": r.train.min_lr, "seed": r.train.seed,
             "dtype": r.model.params_dtype, "weights": r.run.init_from_hf,
             "optimizer_lr": worker.get_lr(),
             "param_dtypes": {str(p.dtype) for p in worker.trainer.model.module.parameters()}}
    plain = _kl_steps(worker, base, colocate=False)
    colocated = _kl_steps(_worker(CP1, KL_JOB + ("trainer.placement.colocate_all=true",), hf_dir),
                          base, colocate=True)
    return {"base": base, "again": again, "ref_is_bare": ref_is_bare, "plain": plain,
            "colocated": colocated, "built": built, "hf_dir": hf_dir}


@pytest.fixture(scope="module")
def kl_runs():
    mp = pytest.MonkeyPatch()
    mp.delenv(CP_EXCHANGE_ENV, raising=False)
    try:
        with tempfile.TemporaryDirectory() as hf_dir:
            return run_ranks(1, _kl_rank, hf_dir)[0]
    finally:
        mp.undo()


def _skyrl_kl(logprobs: torch.Tensor, base: torch.Tensor) -> float:
    """policy_kl as SkyRL's workers compute it, with SkyRL's own functions: per micro-batch
    (rows 0-1, then 2) the masked mean per sequence of compute_approx_kl, then the mean; the
    micro-batches averaged as reduce_metrics does."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl
    from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean

    mask = _batch()["loss_mask"]
    per_micro = []
    for rows in (slice(0, 2), slice(2, 3)):
        kl = compute_approx_kl(logprobs[rows], base[rows], loss_mask=mask[rows],
                               kl_estimator_type="k3")
        per_micro.append(float(masked_mean(kl, mask[rows], dim=-1).mean()))
    return sum(per_micro) / len(per_micro)


def test_reference_worker_is_the_policys_model_without_training_state(kl_runs):
    """The reference (RankModel: no DDP, no optimizer) loaded from the same folder gives the
    policy's log-probs bit for bit, also after SkyRL re-initialises it."""
    assert kl_runs["ref_is_bare"]
    assert torch.equal(kl_runs["again"], kl_runs["base"])  # re-initialised from the same folder
    step1 = kl_runs["plain"]["steps"][0]["logprobs"]
    real = _response_columns()
    assert torch.equal(kl_runs["base"], step1)
    assert float(step1[real].max()) < 0


def test_worker_is_built_with_skyrls_settings(kl_runs):
    """The policy worker's model and optimizer follow SkyRL's config (_cfg: trainer.bf16=false,
    optimizer_config.lr=3e-3, SkyRL's default seed 42), not the tiny recipe's (lr 3e-3 too, but
    seed 1234), and its weights come from the model path init_model was given."""
    b = kl_runs["built"]
    assert (b["lr"], b["min_lr"], b["seed"], b["dtype"]) == (3e-3, 3e-3, 42, "float32")
    assert b["optimizer_lr"] == 3e-3  # no warm-up (SkyRL's num_warmup_steps=0): lr from step 1
    assert b["param_dtypes"] == {"torch.float32"}
    assert b["weights"] == kl_runs["hf_dir"]


def test_kl_is_zero_at_step_one_and_skyrls_kl_at_step_two(kl_runs):
    steps, base = kl_runs["plain"]["steps"], kl_runs["base"]
    assert steps[0]["metrics"]["policy_kl"] == 0.0  # reference weights = policy weights
    kl = steps[1]["metrics"]["policy_kl"]
    expected = _skyrl_kl(steps[1]["logprobs"], base)
    assert expected > 1e-6, "the first step did not move the policy away from the reference"
    assert abs(kl - expected) <= 1e-5 * expected, (kl, expected)
    for step in steps:  # the KL term is in the loss: final = policy + coef * kl (DP1)
        m = step["metrics"]
        assert m["final_loss"] == pytest.approx(m["policy_loss"] + KL_COEF * m["policy_kl"],
                                                rel=1e-6, abs=1e-9)


def test_colocated_run_offloads_and_continues_bit_identically(kl_runs):
    """colocate_all=true: after each offload the DDP parameter and gradient buffers hold no
    storage (so the offload did happen); after backload they are back; the two steps give the
    same log-probs, losses, grad norms and weights, bit for bit, as the run without offload."""
    plain, colocated = kl_runs["plain"], kl_runs["colocated"]
    assert len(colocated["offloaded"]) == 3 and len(colocated["backloaded"]) == 2
    for sizes in colocated["offloaded"]:
        assert sizes["params"], "DDP has no buffers"
        assert set(sizes["params"]) == {0} and set(sizes["grads"]) == {0}, sizes
    for sizes in colocated["backloaded"]:
        assert min(sizes["params"]) > 0 and min(sizes["grads"]) > 0, sizes
    for a, b in zip(plain["steps"], colocated["steps"]):
        assert torch.equal(a["logprobs"], b["logprobs"])
        assert a["grad_norm"] == b["grad_norm"]
        assert a["metrics"] == b["metrics"]
    assert set(plain["after"]) == set(colocated["after"])
    for name, w in plain["after"].items():
        assert torch.equal(colocated["after"][name], w), name


def test_kl_in_reward_goes_through_skyrls_penalty(kl_runs):
    """use_kl_in_reward: SkyRL's own apply_reward_kl_penalty on the reference's and the policy's
    log-probs (step 2) lowers the rewards by kl_loss_coef x compute_approx_kl."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl, get_kl_controller
    from skyrl.train.trainer import RayPPOTrainer

    cfg = _cfg(CP1, 1, ("trainer.algorithm.use_kl_loss=false", "trainer.algorithm.use_kl_in_reward=true",
                        f"trainer.algorithm.kl_loss_coef={KL_COEF}"))
    trainer = object.__new__(RayPPOTrainer)
    trainer.cfg, trainer.all_metrics = cfg, {}
    trainer.reward_kl_controller = get_kl_controller(cfg.trainer.algorithm)  # as RayPPOTrainer
    policy, base = kl_runs["plain"]["steps"][1]["logprobs"], kl_runs["base"]
    mask = _batch()["loss_mask"]
    rewards = torch.zeros_like(mask)
    data = TrainingInputBatch({"loss_mask": mask, "rewards": rewards.clone(),
                               "action_log_probs": policy, "base_action_log_probs": base})
    data.metadata = {}
    out = trainer.apply_reward_kl_penalty(data)
    kl = compute_approx_kl(policy, base, loss_mask=mask, kl_estimator_type="k3")
    assert torch.allclose(out["rewards"], rewards - KL_COEF * kl)
    assert float((rewards - out["rewards"]).abs().max()) > 0


OFFLOAD_RUNS = ("plain", "plain_again", "offload", "offload_losing_moments")


def _gpu_offload_rank(rank, world):
    """On one GPU: how much offload_to_cpu frees, the frozen parameters' storage while offloaded,
    and the step after backload (bf16, NCCL) in four runs: without offload twice (the GPU's own
    run-to-run noise), with offload, and with offload that loses Adam's
    first moments on the way back (the negative control)."""
    gpu = ["run.device=gpu", "model.dsa.kernel=torch"]
    skyrl = ("trainer.placement.colocate_all=true", "trainer.algorithm.use_kl_loss=false",
             "trainer.bf16=true")
    out = {}
    for run in OFFLOAD_RUNS:
        worker = _worker(CP1 + gpu, skyrl)
        batch = _batch()
        batch["action_log_probs"] = torch.tensor(
            [s["logprobs"] for s in worker.forward(batch).loss_fn_outputs])
        worker.forward_backward(batch)
        worker.optim_step()
        if run.startswith("offload"):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            worker.offload_to_cpu()
            frozen = [p for p in worker.trainer.model.parameters() if not p.requires_grad]
            out["frozen_offloaded"] = [p.untyped_storage().size() for p in frozen]
            out["freed"] = before - torch.cuda.memory_allocated()
            out["state_bytes"] = sum(p.numel() * p.element_size()
                                     for p in worker.trainer.model.module.parameters())
            worker.backload_to_gpu()
        if run == "offload_losing_moments":
            optimizer = worker.trainer.optimizer
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                for state in opt.optimizer.state.values():
                    state["exp_avg"].zero_()
        worker.forward_backward(batch)
        out[run] = {"grad_norm": worker.optim_step(),
                    "after": {k: w.float().cpu() for k, w in _weights(worker).items()}}
        worker.trainer.close()
    return out


def _distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(float((a[k] - b[k]).square().sum()) for k in a))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves GPU memory: needs CUDA")
def test_gpu_offload_frees_memory_and_continues_as_without_it():
    out = run_ranks(1, _gpu_offload_rank, backend="nccl")[0]
    # Freed at least the bf16 weights (plus fp32 grads, main params and Adam moments on top).
    assert out["freed"] >= out["state_bytes"], (out["freed"], out["state_bytes"])
    assert out["frozen_offloaded"] and set(out["frozen_offloaded"]) == {0}
    plain = out["plain"]["after"]
    noise = _distance(out["plain_again"]["after"], plain)
    gap = _distance(out["offload"]["after"], plain)
    lost = _distance(out["offload_losing_moments"]["after"], plain)
    print(f"weights after the step following backload, distance from the run without offload: "
          f"offload {gap:.3e}, the same run again {noise:.3e}, offload losing Adam's first "
          f"moments {lost:.3e}; grad norms {[out[r]['grad_norm'] for r in OFFLOAD_RUNS]}")
    assert lost > 10 * max(gap, noise), "the comparison cannot see lost optimizer state"
    # bitwise equal where the GPU repeats itself exactly, else within its own noise
    assert gap <= 10 * noise, (gap, noise)
    noise_norm = abs(out["plain_again"]["grad_norm"] - out["plain"]["grad_norm"])
    assert abs(out["offload"]["grad_norm"] - out["plain"]["grad_norm"]) <= 10 * noise_norm


def _nonfinite_optim_step(rank, world, mode: str) -> dict:
    """SkyRL's calls with one NaN advantage: the gradient norm is NaN at ``optim_step``."""
    from skyrl_megatron_kda.train.step_guard import NonFiniteStep

    worker = _worker([*CP1, f"train.on_nonfinite={mode}"])
    batch = _batch()
    batch["action_log_probs"] = torch.tensor(
        [s["logprobs"] for s in worker.forward(batch).loss_fn_outputs])
    batch["advantages"][0, -1] = float("nan")
    before = _weights(worker)
    worker.forward_backward(batch)
    try:
        out = {"grad_norm": worker.optim_step(), "error": None}
    except NonFiniteStep as err:
        out = {"grad_norm": None, "error": str(err)}
    after = _weights(worker)
    # The routers' expert-bias (load balancing from the routed token counts, not a gradient)
    # is updated by megatron's finalize_model_grads, before any optimizer step decides.
    out["changed"] = [k for k in before if not torch.equal(before[k], after[k])
                      and not k.endswith("e_score_correction_bias")]
    out["step"] = worker.trainer.step
    worker.trainer.close()
    return out


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_optim_step_applies_no_nonfinite_gradient(mode):
    """The policy worker's ``optim_step`` runs the recipe's ``train.on_nonfinite``: ``stop``
    raises with nothing applied, ``skip`` returns the NaN norm (SkyRL's ``grad_norm`` metric)
    and leaves the weights as they were."""
    out = run_ranks(1, _nonfinite_optim_step, mode)[0]
    assert out["changed"] == []
    if mode == "stop":
        assert out["error"].startswith("step 1: gradient norm nan: not finite"), out["error"]
    else:
        assert out["error"] is None and math.isnan(out["grad_norm"]) and out["step"] == 1
