"""megatron's MoE token dispatchers (``model.moe.dispatcher``) compute the same model.

On 4 gloo ranks, ``alltoall`` equals ``allgather`` (the dispatcher that moves every row, the
reference) in the loss of 5 training steps, the gradient norm, all parameters' gradients (as
one vector, and each feed-forward parameter's own), the MoE layers' input gradients, the
routers' token counts and expert-bias updates: TP2 x CP2 +SP with EP2 on packed rows of uneven
documents, TP2 +SP with EP2 x ETP2 (the padded gather on gloo,
``distributed.cpu.gather_uneven_rows``), ``train.moe_chunk_tokens`` on, and routing forced so
that one expert gets no token (NVIDIA/Megatron-LM#1877's empty view). On SkyRL's RL path, where
each data-parallel replica packs its micro-batch to its own length, ``alltoall`` over an EP x ETP
group spanning the replicas (with and without token chunks, which then agree on a chunk count)
equals the same batch without expert parallelism; ``allgather`` is refused there. A dispatcher
that delivers one row to the wrong place is caught (negative control). The config rules, the
resume rule and ``recipe.yaml`` are checked without ranks.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda import recipe_rules
from skyrl_megatron_kda.config.recipe import model_meaning
from skyrl_megatron_kda.recipes import get_recipe, load_recipe
from tests.support.ranks import run_ranks

TINY = "glm53_flash_tiny"
DISPATCHERS = ("allgather", "alltoall")
STEPS = 5

TOLERANCE = 1e-6
"""Relative fp32 gap between the dispatchers (``_gap``) of the loss, the gradient norm, all
parameter gradients as one vector, each MoE block parameter's gradient and the MoE inputs'
gradients. Each expert sees its rows in the same order under both; under ETP the combine sums
the ETP shards' partial outputs in another order (reduce-scatter over ETP, then all-to-all,
against one reduce-scatter over TP x EP: ~1e-7 relative). The other parameters are compared as
part of the whole vector only: the smallest of them (mHC scales and biases, A_log: sums of
cancelling terms, norms of 1e-5 to 1e-4) amplify that rounding to up to 1e-4 of their own norm,
as for ``train.moe_chunk_tokens`` (tests/test_moe_chunks.py). Two rows swapped after the
all-to-all move the MoE gradients by far more (the negative control asserts 1e3 x this)."""

FORCING_BIAS = 2.0
"""Router expert bias that decides the top-k alone: sigmoid scores lie in (0, 1), so an expert
with +FORCING_BIAS is chosen by every token, one with -FORCING_BIAS by none (a few steps of the
bias update, 1e-3 each, do not change that)."""

CASES = {
    # The tiny recipe's own mesh: TP2 x CP2 +SP, EP2 (ETP1), packed rows of uneven documents.
    "tp2_cp2_sp_ep2": [],
    # TP2 +SP, CP1 (DP2), the experts over EP2 x ETP2: the all-to-all dispatcher's ETP gather of
    # uneven row counts.
    "tp2_sp_ep2_etp2": ["parallel.cp=1", "parallel.etp=2"],
    # Token chunks that leave a partial last chunk of the 64 rows each rank holds.
    "moe_chunks": ["train.moe_chunk_tokens=40"],
    # Expert 0 gets no token, expert 1 every token (top-2 of 8).
    "imbalanced": [],
}
IMBALANCED = "imbalanced"
CONTROL = "tp2_cp2_sp_ep2"

# SkyRL's RL path: TP2 +SP, DP2, the experts over all 4 ranks (the EP x ETP group spans both
# replicas), against the same batches without expert parallelism.
RL_MESH = ["parallel.cp=1", "parallel.etp=2"]
RL_REFERENCE = ["parallel.cp=1", "parallel.ep=1", "parallel.etp=1"]
RL_CHUNK = ["train.moe_chunk_tokens=8"]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (0 where both are zero: an expert without tokens has no gradient)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float64).tiny))


def _moe_layers(model):
    from skyrl_megatron_kda.model.moe_layer import GLMMoELayer

    return [m for m in model.modules() if isinstance(m, GLMMoELayer)]


def _forced_routing(recipe, **kwargs):
    """The recipe's model with every router's bias forcing expert 1 and starving expert 0."""
    from skyrl_megatron_kda.model.glm import build_model

    model = build_model(recipe, **kwargs)
    with torch.no_grad():
        for layer in _moe_layers(model):
            layer.router.expert_bias[0] = -FORCING_BIAS
            layer.router.expert_bias[1] = FORCING_BIAS
    return model


class _Watch:
    """What the MoE layers see on the first forward: their inputs (kept for their gradients) and
    the routers' token counts per expert."""

    def __init__(self, model):
        self.inputs, self.counts = [], []
        self.handles = [layer.register_forward_hook(self._seen) for layer in _moe_layers(model)]

    def _seen(self, layer, args, output):
        if len(self.inputs) < len(self.handles):
            args[0].retain_grad()
            self.inputs.append(args[0])
            self.counts.append(layer.router.local_tokens_per_expert.detach().clone())

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _grads(module) -> dict:
    """Each trained parameter's gradient in megatron's DDP buffer."""
    return {n: p.main_grad.detach().clone() for n, p in module.named_parameters()
            if p.requires_grad}


def _biases(module) -> list:
    return [layer.router.expert_bias.detach().clone() for layer in _moe_layers(module)]


def _train(overrides, steps, forced=False, misdeliver=False):
    """``steps`` training steps of the tiny recipe; the first step's gradients (after megatron's
    reduction), MoE input gradients, router counts and updated biases, every step's metrics."""
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = load_recipe(TINY, [f"train.steps={steps}", *overrides], environ={}).recipe
    trainer = RankTrainer(recipe, build_model=_forced_routing if forced else None)
    module = trainer.model.module
    watch, first, initial_bias = _Watch(module), {}, _biases(module)
    step = trainer.optimizer_step

    def snapshot_then_step(loss=None):
        if not first:
            first.update(grads=_grads(module), bias=_biases(module))
        return step(loss)

    trainer.optimizer_step = snapshot_then_step
    with _misdelivered(misdeliver):
        metrics = [trainer.train_step() for _ in range(steps)]
    watch.close()
    out = dict(metrics=metrics, **first, initial_bias=initial_bias, final_bias=_biases(module),
               input_grads=[x.grad.detach().clone() for x in watch.inputs], counts=watch.counts)
    trainer.close()
    return out


class _misdelivered:
    """Negative control: the all-to-all dispatcher hands each rank's experts its first two
    received rows swapped (each goes to the other's expert, with the other's weight)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        self.cls, self.original = MoEAlltoAllTokenDispatcher, MoEAlltoAllTokenDispatcher.token_dispatch
        if self.on:
            original = self.original

            def swapped(dispatcher, tokens, probs):
                tokens, probs = original(dispatcher, tokens, probs)
                order = list(range(len(tokens)))
                order[:2] = order[1::-1]
                return tokens[order], probs
            self.cls.token_dispatch = swapped

    def __exit__(self, *exc):
        self.cls.token_dispatch = self.original


def _grad_gaps(got: dict, ref: dict) -> dict:
    """Gradient gaps: all parameters as one vector, and the largest of each feed-forward block
    parameter's own (``.mlp.``: the MoE blocks' router, experts and shared expert)."""
    names = list(ref)
    return {
        "param_grads": _gap(torch.cat([got[n].flatten() for n in names]),
                            torch.cat([ref[n].flatten() for n in names])),
        "mlp_param_grads": max(_gap(got[n], ref[n]) for n in names if ".mlp." in n),
    }


def _gaps(got: dict, ref: dict) -> dict:
    """The largest relative gap of each compared quantity."""
    pairs = {
        "loss": [(torch.tensor(g["loss"]), torch.tensor(r["loss"]))
                 for g, r in zip(got["metrics"], ref["metrics"])],
        "grad_norm": [(torch.tensor(g["grad_norm"]), torch.tensor(r["grad_norm"]))
                      for g, r in zip(got["metrics"], ref["metrics"])],
        "input_grads": list(zip(got["input_grads"], ref["input_grads"])),
        "counts": list(zip(got["counts"], ref["counts"])),
        "bias_step1": list(zip(got["bias"], ref["bias"])),
        "bias_final": list(zip(got["final_bias"], ref["final_bias"])),
    }
    gaps = {key: max(_gap(a, b) for a, b in values) for key, values in pairs.items()}
    return gaps | _grad_gaps(got["grads"], ref["grads"])


def _within(gaps: dict) -> bool:
    return all(gap <= TOLERANCE for gap in gaps.values())


def _routing_facts(run: dict) -> dict:
    """Whether the first step updated every router's bias, and this rank's tokens per expert
    in each MoE layer (the ranks hold disjoint rows: their sum is what each expert got)."""
    moved = all(not torch.equal(a, b) for a, b in zip(run["bias"], run["initial_bias"]))
    return dict(bias_moved=moved, counts=torch.stack(run["counts"]))


def _rl_batch(dp_rank: int, vocab: int):
    """SkyRL-shaped rollout rows of one replica: left-padded prompts, right-padded responses,
    lengths drawn per replica so that the replicas' packed rows differ in length."""
    gen = torch.Generator().manual_seed(100 + dp_rank)
    rows, width = 2, 48 * (dp_rank + 1)
    sequences = torch.randint(3, vocab, (rows, width), generator=gen)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for b in range(rows):
        start = int(torch.randint(0, width // 4, (), generator=gen))
        stop = int(torch.randint(width // 2, width + 1, (), generator=gen))
        mask[b, start:stop] = 1
    weights = torch.randn(rows, width, generator=gen)
    return sequences * mask, mask, weights


def _rl_step(overrides):
    """Log-probs of this replica's rollout rows, the dense parameters' and MoE inputs' gradients
    of a weighted sum of them, and the packed row's length."""
    from skyrl_megatron_kda.train.rl import pack_rollout, token_logprobs
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = load_recipe(TINY, overrides, environ={}).recipe
    trainer = RankTrainer(recipe)
    module = trainer.model.module
    sequences, mask, weights = _rl_batch(trainer.dp_rank, recipe.model.vocab_size)
    rollout = pack_rollout(sequences, mask, recipe.parallel, recipe.parallel.cp_layout)
    watch = _Watch(module)
    trainer.model.train()
    logp, _ = token_logprobs(trainer, rollout)
    (logp * weights).sum().backward()
    watch.close()
    grads = {n: g for n, g in _grads(module).items() if ".experts." not in n}
    out = dict(logp=logp.detach(), grads=grads, rows=rollout.row.tokens.numel(),
               input_grads=[x.grad.detach().clone() for x in watch.inputs])
    trainer.close()
    return out


def _rl_gaps(got: dict, ref: dict) -> dict:
    return dict(logp=_gap(got["logp"], ref["logp"]),
                input_grads=max(_gap(a, b) for a, b in zip(got["input_grads"], ref["input_grads"])),
                **_grad_gaps(got["grads"], ref["grads"]))


def _uneven_gather(rank, world) -> bool:
    """What a CPU rank's ``all_gather`` gives for tensors of different row counts (gloo alone
    refuses them): every rank's rows, in rank order."""
    import torch.distributed as dist

    from skyrl_megatron_kda.distributed.cpu import gather_uneven_rows

    rows = [r + 1 for r in range(world)]
    parts = [torch.empty(n, 3) for n in rows]
    dist.all_gather(parts, torch.full((rows[rank], 3), float(rank)))
    return dist.all_gather is gather_uneven_rows and all(
        torch.equal(part, torch.full((n, 3), float(r))) for r, (part, n) in enumerate(zip(parts, rows)))


def _on_four_ranks(rank, world):
    out = {"cases": {}, "routing": {}, "uneven_gather": _uneven_gather(rank, world)}
    for name, overrides in CASES.items():
        steps = STEPS if name == CONTROL else 1
        runs = {d: _train([*overrides, f"model.moe.dispatcher={d}"], steps,
                          forced=name == IMBALANCED) for d in DISPATCHERS}
        out["cases"][name] = _gaps(runs["alltoall"], runs["allgather"])
        out["routing"][name] = _routing_facts(runs["alltoall"])
        if name == CONTROL:
            out["curve"] = [m["loss"] for m in runs["allgather"]["metrics"]]
            control_ref = runs["allgather"]
    bad = _train(["model.moe.dispatcher=alltoall"], 1, misdeliver=True)
    out["control"] = _grad_gaps(bad["grads"], control_ref["grads"])
    reference = _rl_step([*RL_REFERENCE, "model.moe.dispatcher=alltoall"])
    out["rl"] = {}
    for name, extra in (("alltoall", []), ("alltoall_chunks", RL_CHUNK)):
        got = _rl_step([*RL_MESH, "model.moe.dispatcher=alltoall", *extra])
        out["rl"][name] = _rl_gaps(got, reference)
    out["rl_rows"] = got["rows"]
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, _on_four_ranks)


@pytest.mark.parametrize("case", list(CASES))
def test_alltoall_equals_allgather(four_ranks, case):
    for rank, result in enumerate(four_ranks):
        gaps = result["cases"][case]
        print(f"{case} rank {rank}: {gaps}")
        assert _within(gaps), (case, rank, gaps)


def test_the_comparison_covers_bias_updates_a_moving_curve_and_an_empty_expert(four_ranks):
    for result in four_ranks:
        assert all(facts["bias_moved"] for facts in result["routing"].values()), result["routing"]
    tokens = {case: sum(result["routing"][case]["counts"] for result in four_ranks)
              for case in CASES}
    # Forced routing leaves an expert without a single token (its EP rank receives no row for
    # it); the tiny recipe's own routing gives every expert some.
    assert int(tokens[IMBALANCED].min()) == 0, tokens[IMBALANCED]
    assert int(tokens[CONTROL].min()) > 0, tokens[CONTROL]
    curve = four_ranks[0]["curve"]
    assert len(curve) == STEPS and max(curve) - min(curve) > 1e3 * TOLERANCE, curve


def test_cpu_ranks_gather_uneven_rows(four_ranks):
    assert all(result["uneven_gather"] for result in four_ranks)


def test_a_misdelivered_row_is_caught(four_ranks):
    for rank, result in enumerate(four_ranks):
        gaps = result["control"]
        print(f"two rows swapped after the all-to-all, rank {rank}: {gaps}")
        assert gaps["mlp_param_grads"] > 1e3 * TOLERANCE, gaps


def test_rl_path_with_replicas_of_different_lengths(four_ranks):
    """Each replica packs its own micro-batch (different row counts in one EP x ETP group, so
    chunked layers run as many chunks as the longest rank); the log-probs and gradients equal
    those of the same batches without expert parallelism."""
    rows = {result["rl_rows"] for result in four_ranks}
    assert len(rows) > 1, f"the replicas' packed rows have one length: {rows}"
    for rank, result in enumerate(four_ranks):
        for name, gaps in result["rl"].items():
            print(f"RL {name} rank {rank}: {gaps}")
            assert _within(gaps), (name, rank, gaps)


# --- Rules without ranks ------------------------------------------------------------------------


def test_every_recipe_runs_alltoall_by_default():
    for name in ("glm53_flash_1m", "glm53_flash_slice", TINY):
        assert get_recipe(name, environ={}).model.moe.dispatcher == "alltoall", name


@pytest.mark.parametrize("overrides, rule", [
    (["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
      "run.num_workers=1"], r"model\.moe\.dispatcher=flex needs parallel\.ep \* parallel\.etp > 1 "
     r".*1 \* 1 = 1\): set model\.moe\.dispatcher=alltoall"),
    ([], r"model\.moe\.dispatcher=flex needs run\.device=gpu .*: set model\.moe\.dispatcher=alltoall"),
], ids=["one-rank-group", "cpu"])
def test_flex_is_refused_naming_the_rule_and_the_fix(overrides, rule):
    with pytest.raises(ValueError, match=rule):
        get_recipe(TINY, ["model.moe.dispatcher=flex", *overrides], environ={})


def test_flex_needs_deep_ep(monkeypatch):
    gpu = ["model.moe.dispatcher=flex", "run.device=gpu", "kda.kernel=auto"]
    monkeypatch.setattr(recipe_rules, "deep_ep_importable", lambda: False)
    with pytest.raises(ValueError, match=r"model\.moe\.dispatcher=flex needs the deep_ep package "
                                         r"\(DeepEP\).*set model\.moe\.dispatcher=alltoall"):
        get_recipe(TINY, gpu, environ={})
    monkeypatch.setattr(recipe_rules, "deep_ep_importable", lambda: True)
    assert get_recipe(TINY, gpu, environ={}).model.moe.dispatcher == "flex"


@pytest.mark.parametrize("tp, cp, ep, etp, differ", [
    (2, 2, 2, 1, False),  # the tiny recipe: the EP group is a CP rank's two TP ranks
    (2, 1, 2, 2, True),   # EP2 x ETP2 over two TP2 replicas
    (8, 2, 32, 2, True),  # the 1M recipe: 64 expert ranks over 4 replicas of 16
    (1, 1, 1, 1, False),  # no dispatch group
    (4, 2, 4, 2, False),  # a group of 8 ranks, one replica of 8
])
def test_dispatch_rows_can_differ_exactly_where_a_group_spans_replicas(tp, cp, ep, etp, differ):
    from skyrl_megatron_kda.config import ParallelConfig

    parallel = ParallelConfig(tp=tp, cp=cp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    assert recipe_rules.dispatch_rows_can_differ(parallel) is differ


def test_skyrl_refuses_allgather_where_replicas_share_a_dispatch_group():
    pytest.importorskip("skyrl")
    from skyrl_megatron_kda.integrations.skyrl.config import KDASkyRLConfig, apply_recipe

    job = ["trainer.strategy=megatron", "trainer.logger=console",
           "trainer.placement.colocate_all=false", "trainer.algorithm.use_kl_loss=false",
           "trainer.placement.policy_num_gpus_per_node=4", f"trainer.kda.recipe={TINY}",
           "trainer.kda.sampler=glm5_next"]
    spanning = [f"trainer.kda.overrides.{key}" for key in RL_MESH]
    problems = {}
    for dispatcher in DISPATCHERS:
        cfg = KDASkyRLConfig.from_cli_overrides(
            job + spanning + [f"trainer.kda.overrides.model.moe.dispatcher={dispatcher}"])
        problems[dispatcher] = [p for p in apply_recipe(cfg, cfg.trainer.kda.resolve())
                                if "dispatcher" in p]
    assert problems["alltoall"] == []
    (line,) = problems["allgather"]
    assert line.startswith("model.moe.dispatcher=allgather: ") and line.endswith(
        "set trainer.kda.overrides.model.moe.dispatcher=alltoall"), line
    # Within one replica's ranks (the tiny recipe's own mesh) allgather is served.
    cfg = KDASkyRLConfig.from_cli_overrides(
        job + ["trainer.kda.overrides.model.moe.dispatcher=allgather"])
    assert not [p for p in apply_recipe(cfg, cfg.trainer.kda.resolve()) if "dispatcher" in p]


def test_a_resume_may_change_the_dispatcher_and_recipe_yaml_records_it():
    """A resume compares the model's meaning with the run's ``recipe.yaml``
    (``train.run_folder``), which leaves the dispatcher out; tests/test_checkpoint.py loads a
    checkpoint saved under alltoall into a run under allgather (``mesh_runs.LEVERS``)."""
    import yaml

    from skyrl_megatron_kda.config import Recipe
    from tests.support.mesh_runs import LEVERS

    dumps = {d: get_recipe(TINY, [f"model.moe.dispatcher={d}"], environ={}).model_dump(mode="json")
             for d in DISPATCHERS}
    assert model_meaning(dumps["alltoall"]) == model_meaning(dumps["allgather"])
    assert "model.moe.dispatcher=allgather" in LEVERS
    assert get_recipe(TINY, environ={}).model.moe.dispatcher == "alltoall"  # what it saved under
    # Negative control: a setting that is not a lever changes the model's meaning.
    other = get_recipe(TINY, ["model.moe.top_k=3"], environ={}).model_dump(mode="json")
    assert model_meaning(other) != model_meaning(dumps["alltoall"])
    # recipe.yaml is the recipe's JSON dump (train/run.py): the dispatcher is in it.
    written = yaml.safe_load(yaml.safe_dump(dumps["allgather"], sort_keys=False))
    assert written["model"]["moe"]["dispatcher"] == "allgather"
    assert Recipe.model_validate(written).model.moe.dispatcher == "allgather"
