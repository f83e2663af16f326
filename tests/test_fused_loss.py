"""model/fused_loss.py: the chunked output layer + cross entropy equals megatron's (the output
layer's matmul, then ``vocab_parallel_cross_entropy`` on the fp32 logits) in the loss, the
hidden-state gradient and the output-weight gradient, fp32 within 1e-6 relative, at TP1 and at
TP2 with and without SP (spawned gloo ranks), for chunks that divide the tokens, do not, and
exceed them, with masked tokens; it keeps no [tokens x vocab] tensor for backward (a census that
fails on megatron's loss); and the tiny recipe trains to the same losses with it (TP2 x CP2 +SP).

A wrong target column, max or normalisation moves the loss by order 1e-1; a missing TP
reduction of the hidden-state gradient by about half of it; fp32 summation order by ~1e-7.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import tensor_parallel

from skyrl_megatron_kda.kda.parity import relative_error
from skyrl_megatron_kda.model.fused_loss import chunked_linear_cross_entropy
from tests.support.head_cases import B, CHUNKS, D, S, V, inputs, output_logits, rank_leaves
from tests.support.kda_cases import saved_bytes
from tests.support.ranks import run_ranks

TOL = 1e-6


def _unfused(hidden, weight, labels, group, sp):
    """What GLMModel computes without the setting: the output layer, then megatron's
    vocab-parallel cross entropy on the fp32 logits."""
    logits = output_logits(hidden, weight, group, sp)
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels, tp_group=group)


def _fused(chunk):
    def loss(hidden, weight, labels, group, sp):
        return chunked_linear_cross_entropy(hidden, weight, labels, chunk=chunk, tp_group=group,
                                            sequence_parallel=sp)
    return loss


def _run(fn, rank, world, sp, group, label_shift=0):
    """Loss [S, B], this rank's hidden gradient and weight-shard gradient."""
    hidden, weight, labels, mask = inputs()
    labels = (labels + label_shift) % V
    h, w = rank_leaves(hidden, weight, rank, world, sp)
    loss = fn(h, w, labels, group, sp)
    (loss * mask).sum().backward()
    return loss.detach(), h.grad, w.grad


def _parity(rank, world, sp):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    ref = _run(_unfused, rank, world, sp, group)
    out = {}
    for chunk in CHUNKS:
        got = _run(_fused(chunk), rank, world, sp, group)
        out[chunk] = [relative_error(a, b) for a, b in zip(got, ref)]
    # Negative control: every label moved to the next column (a wrong target column).
    wrong = _run(_fused(5), rank, world, sp, group, label_shift=1)
    out["control"] = min(relative_error(a, b) for a, b in zip(wrong, ref))
    return out


@pytest.mark.parametrize("world,sp", [(1, False), (2, True), (2, False)], ids=["tp1", "tp2_sp", "tp2"])
def test_equals_megatron_loss_and_gradients(world, sp):
    for rank, errors in enumerate(run_ranks(world, _parity, sp)):
        control = errors.pop("control")
        print(rank, errors, control)
        for chunk, (loss, grad_hidden, grad_weight) in errors.items():
            assert max(loss, grad_hidden, grad_weight) < TOL, (
                f"rank {rank} chunk {chunk}: loss {loss:.1e}, hidden grad {grad_hidden:.1e}, "
                f"weight grad {grad_weight:.1e} (budget {TOL:.0e}; a real bug is ~1e-1)")
        assert control > 1e-2, f"rank {rank}: wrong target columns went unnoticed ({control:.1e})"


def _census(rank, world, sp):
    """(shapes, bytes) of what each loss keeps for backward on this rank, the weight left out."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    hidden, weight, labels, _ = inputs()
    out = {}
    for name, fn in (("unfused", _unfused), ("fused", _fused(5))):
        h, w = rank_leaves(hidden, weight, rank, world, sp)
        shapes = []

        def keep(t, shapes=shapes, w=w):
            if t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr():
                shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            fn(h, w, labels, group, sp)
        loss, nbytes = saved_bytes(lambda: fn(h, w, labels, group, sp), [w])  # noqa: B023
        loss.sum().backward()
        out[name] = (shapes, nbytes)
    return out


@pytest.mark.parametrize("world,sp", [(1, False), (2, True)], ids=["tp1", "tp2_sp"])
def test_keeps_no_tokens_by_vocabulary_tensor(world, sp):
    """Megatron's loss keeps the fp32 softmax [S, B, V/tp] (the control: the census finds it);
    the fused one keeps the rank's hidden rows, the labels and two fp32 numbers per token,
    what memory/head.py counts for ``train.loss_chunk_tokens``."""
    from skyrl_megatron_kda.memory.head import loss_kept_bytes_per_token
    from skyrl_megatron_kda.recipes import load_recipe

    per_token = sum(loss_kept_bytes_per_token(
        load_recipe("glm53_flash_tiny", ["train.loss_chunk_tokens=5"]).recipe))
    for rank, census in enumerate(run_ranks(world, _census, sp)):
        print(rank, census)
        shapes, _ = census["unfused"]
        assert any(V // world in shape for shape in shapes), f"the control found no logits: {shapes}"
        shapes, nbytes = census["fused"]
        assert not any(V // world in shape for shape in shapes), shapes
        rows = S // world if sp else S
        assert nbytes == rows * B * D * 4 + S * B * per_token, (nbytes, shapes)


def _train(rank, world, chunk):
    """Two optimizer steps of the tiny recipe (TP2 x CP2 +SP, EP2) with ``train.loss_chunk_tokens``
    = ``chunk`` (None: megatron's loss): (loss, grad norm) of each step as rank 0 reports them."""
    from skyrl_megatron_kda.model import head
    from skyrl_megatron_kda.recipes import load_recipe
    from skyrl_megatron_kda.train.trainer import RankTrainer

    calls = []
    fused = head.chunked_linear_cross_entropy
    # Counted, so that equal losses cannot come from the setting being ignored.
    head.chunked_linear_cross_entropy = lambda *a, **k: calls.append(k["chunk"]) or fused(*a, **k)
    setting = [] if chunk is None else [f"train.loss_chunk_tokens={chunk}"]
    trainer = RankTrainer(load_recipe("glm53_flash_tiny", ["train.steps=2", *setting], environ={}).recipe)
    steps = [trainer.train_step() for _ in range(2)]
    trainer.close()
    return [(m["loss"], m["grad_norm"]) for m in steps], calls


def test_tiny_recipe_trains_the_same_with_the_fused_loss():
    """The whole model through the trainer at TP2 x CP2 +SP: the first loss and gradient norm,
    and the second loss (after a step on the first gradients), equal with and without the
    setting; 48 tokens per chunk leaves a partial last chunk of the CP rank's 128."""
    plain, plain_calls = run_ranks(4, _train, None)[0]
    fused, fused_calls = run_ranks(4, _train, 48)[0]
    print(plain, fused)
    assert plain_calls == [] and fused_calls == [48, 48], (plain_calls, fused_calls)
    for (loss_a, norm_a), (loss_b, norm_b) in zip(plain, fused):
        assert abs(loss_b - loss_a) <= TOL * loss_a, (plain, fused)
        assert abs(norm_b - norm_a) <= TOL * norm_a, (plain, fused)
    assert abs(plain[1][0] - plain[0][0]) > 1e-3, "the step must move the loss for the check to bite"
