"""model/head.py: the fast path (``chunked_logprobs``, token chunks without the logits) equals the
reference (``logprobs_from_logits`` on the output layer's logits) in the log-probs, the entropies
and the gradients of a loss over both with respect to the hidden states and the output weight,
fp32 within 1e-6 relative, at sampling temperatures 1 and 0.7, at TP1 and at TP2 (vocabulary
split over the ranks) with and without SP (spawned gloo ranks), for chunks that divide the
tokens, do not, and exceed them; with ``entropy_grad`` off both leave the entropy out of the
gradients. ``GLMModel.token_logprobs`` runs one or the other, so the fine-tune loss and the RL
path get the same numbers under either setting.

Negative controls: the temperature left out, or every label moved to the next column, moves
the log-probs by order 1e-1; fp32 summation order moves them by ~1e-7.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.kda.parity import relative_error
from skyrl_megatron_kda.model.head import chunked_logprobs, logprobs_from_logits
from tests.support.head_cases import CHUNKS, V, inputs, output_logits, rank_leaves
from tests.support.ranks import run_ranks

TOL = 1e-6
TEMPERATURES = (1.0, 0.7)


def _reference(temperature, entropy_grad):
    def fn(hidden, weight, labels, group, sp):
        return logprobs_from_logits(output_logits(hidden, weight, group, sp), labels, group,
                                    temperature=temperature, entropy=True, entropy_grad=entropy_grad)
    return fn


def _fast(chunk, temperature, entropy_grad):
    def fn(hidden, weight, labels, group, sp):
        return chunked_logprobs(hidden, weight, labels, chunk=chunk, tp_group=group,
                                sequence_parallel=sp, temperature=temperature, entropy=True,
                                entropy_grad=entropy_grad)
    return fn


def _run(fn, rank, world, sp, group, label_shift=0):
    """Log-prob and entropy [S, B], and this rank's hidden and weight-shard gradients of a loss
    that uses both (the entropy's term drops out when it is not differentiable)."""
    hidden, weight, labels, mask = inputs()
    labels = (labels + label_shift) % V
    h, w = rank_leaves(hidden, weight, rank, world, sp)
    logp, ent = fn(h, w, labels, group, sp)
    coef = torch.linspace(-1.0, 1.0, ent.numel()).view(ent.shape)
    (-logp * mask + 0.3 * coef * ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad, ent.requires_grad


def _parity(rank, world, sp):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    out, kept_graph = {}, {}
    for entropy_grad in (True, False):
        for t in TEMPERATURES:
            *ref, ref_graph = _run(_reference(t, entropy_grad), rank, world, sp, group)
            kept_graph[("reference", t, entropy_grad)] = ref_graph
            for chunk in CHUNKS:
                *got, graph = _run(_fast(chunk, t, entropy_grad), rank, world, sp, group)
                kept_graph[(chunk, t, entropy_grad)] = graph
                out[(chunk, t, entropy_grad)] = [relative_error(a, b) for a, b in zip(got, ref)]
    *ref, _ = _run(_reference(0.7, True), rank, world, sp, group)
    # Negative controls: the temperature left out; every label moved to the next column (the
    # entropy does not read the labels, so the log-probs are what must differ).
    *wrong_t, _ = _run(_fast(5, 1.0, True), rank, world, sp, group)
    *shifted, _ = _run(_fast(5, 0.7, True), rank, world, sp, group, label_shift=1)
    controls = {"temperature": min(relative_error(a, b) for a, b in zip(wrong_t, ref)),
                "label": relative_error(shifted[0], ref[0])}
    return out, kept_graph, controls


@pytest.mark.parametrize("world,sp", [(1, False), (2, True), (2, False)], ids=["tp1", "tp2_sp", "tp2"])
def test_fast_path_equals_the_reference(world, sp):
    for rank, (errors, kept_graph, controls) in enumerate(run_ranks(world, _parity, sp)):
        print(rank, errors, controls)
        for (chunk, t, entropy_grad), errs in errors.items():
            logp, ent, grad_hidden, grad_weight = errs
            assert max(errs) < TOL, (
                f"rank {rank} chunk {chunk} temperature {t} entropy_grad {entropy_grad}: log-prob "
                f"{logp:.1e}, entropy {ent:.1e}, hidden grad {grad_hidden:.1e}, weight grad "
                f"{grad_weight:.1e} (budget {TOL:.0e}; a real bug is ~1e-1)")
        for (path, t, entropy_grad), graph in kept_graph.items():
            assert graph == entropy_grad, (rank, path, t, entropy_grad)
        assert controls["temperature"] > 1e-2, f"rank {rank}: a missing temperature went unnoticed {controls}"
        assert controls["label"] > 1e-2, f"rank {rank}: shifted labels went unnoticed {controls}"


def test_reference_refuses_a_temperature_of_zero():
    logits = torch.zeros(3, 1, V)
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        logprobs_from_logits(logits, torch.zeros(3, 1, dtype=torch.long), None, temperature=0.0)
