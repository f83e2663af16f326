"""The state-passing kernel (kda/state_kernel.py) against the plain kernel on the whole sequence.

One process holds every piece of a sequence and chains them in order (what the CP link does
across ranks), with pieces cut into segments: outputs and every input gradient must equal the
plain kernel's. CPU: our torch KDA in fp32. GPU: fla's kernels called one by one vs fla's
chunk_kda, both bf16. The control drops the chain (every piece starts from zero state).
"""

import pytest
import torch

from skyrl_megatron_kda.kda.kernel import kda
from skyrl_megatron_kda.kda.parity import relative_error
from skyrl_megatron_kda.kda.state_kernel import IsolatedPieces, Segments, state_passing_kda


class PiecesInOrder:
    """Pieces 0..P-1 of one sequence, held by one process, chained in order."""

    def entry_states(self, summaries):
        V = summaries.shape[-1] - summaries.shape[-2]
        self.M = summaries[..., V:]
        state, out = torch.zeros_like(summaries[0, ..., :V]), []
        for summary in summaries:
            out.append(state)
            state = summary[..., V:] @ state + summary[..., :V]
        return torch.stack(out)

    def exit_grads(self, entry_grads):
        grad, out = torch.zeros_like(entry_grads[0]), [None] * len(entry_grads)
        for p in reversed(range(len(entry_grads))):
            out[p] = grad
            grad = entry_grads[p] + self.M[p].transpose(-1, -2) @ grad
        return torch.stack(out)


def _inputs(T, H, K, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)

    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt, generator=g).requires_grad_()

    q, k, v, f = (leaf(1, T, H, K) for _ in range(4))
    b = leaf(1, T, H)
    a_log = torch.rand(H, device=device, generator=g).mul(15).add(1).log().requires_grad_()
    dt_bias = leaf(H * K, dt=torch.float32)
    do = torch.randn(1, T, H, K, device=device, dtype=dtype, generator=g)
    return [q, k, v, f, b, a_log, dt_bias], do


NAMES = ["q", "k", "v", "f", "b", "A_log", "dt_bias"]


def _run(fn, leaves, do):
    for t in leaves:
        t.grad = None
    out = fn(*leaves)
    out.backward(do)
    return out.detach().float(), [t.grad.detach().float().clone() for t in leaves]


def _errors(T, piece_cu, H, K, device, dtype, backend, link, segments, lower_bound=-5.0):
    leaves, do = _inputs(T, H, K, device, dtype)
    whole = _run(lambda *t: kda(*t, lower_bound=lower_bound, backend=backend)[0], leaves, do)
    cu = torch.tensor(piece_cu, device=device)
    pieces = _run(lambda *t: state_passing_kda(*t, piece_cu=cu, link=link, lower_bound=lower_bound,
                                               backend=backend, segments=segments), leaves, do)
    errors = {"out": relative_error(pieces[0], whole[0])}
    errors.update({f"d{n}": relative_error(a, b) for n, a, b in zip(NAMES, pieces[1], whole[1])})
    return errors


def test_segments_are_whole_chunks():
    cut = Segments.cut(torch.tensor([0, 100, 333, 700]), target=6, chunk_size=64)
    assert cut.cu.tolist() == [0, 100, 228, 333, 461, 589, 700]
    assert cut.of_piece == [[0], [1, 2], [3, 4, 5]]
    assert cut.first.tolist() == [0, 1, 3] and cut.last.tolist() == [0, 2, 5]


CPU_PIECES = [0, 100, 333, 700]  # uneven pieces, not chunk aligned; the last cut into 3 segments


def test_chained_pieces_equal_whole_sequence_cpu():
    errors = _errors(700, CPU_PIECES, 2, 16, "cpu", torch.float32, "torch", PiecesInOrder(), segments=6)
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    assert not bad, f"state passing vs whole sequence (fp32) above 1e-5: {bad}"


def test_unchained_pieces_are_caught_cpu():
    errors = _errors(700, CPU_PIECES, 2, 16, "cpu", torch.float32, "torch", IsolatedPieces(), segments=6)
    assert errors["out"] > 1e-2, f"dropping the chain went unnoticed: {errors}"


class PiecesWithoutTransitions(PiecesInOrder):
    """The chain with every transition ``M`` taken as zero: only each predecessor's local state."""

    def entry_states(self, summaries):
        V = summaries.shape[-1] - summaries.shape[-2]
        return super().entry_states(torch.cat([summaries[..., :V], 0 * summaries[..., V:]], -1))


# Each token's log decay in (-0.005, 0): a segment's transition M is far from zero, so a chain
# step that used the wrong segment's M shows (at -5 a 100-token segment all but forgets its entry:
# there, M[j] for M[j-1] in a step of ``_compose_entries`` passed; here it fails at 7e-2).
SLOW_DECAY = -0.005


def test_chained_pieces_with_slow_decay_equal_whole_sequence_cpu():
    errors = _errors(700, CPU_PIECES, 2, 16, "cpu", torch.float32, "torch", PiecesInOrder(), segments=6,
                     lower_bound=SLOW_DECAY)
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    assert not bad, f"state passing vs whole sequence (fp32, slow decay) above 1e-5: {bad}"


def test_dropped_transitions_are_caught_with_slow_decay_cpu():
    errors = _errors(700, CPU_PIECES, 2, 16, "cpu", torch.float32, "torch", PiecesWithoutTransitions(),
                     segments=6, lower_bound=SLOW_DECAY)
    assert errors["out"] > 1e-3 and errors["dv"] > 1e-3, f"dropping M went unnoticed: {errors}"


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: fla's KDA kernels are Triton GPU kernels")
GPU_PIECES = [0, 1000, 3333, 8192]
# Both sides are fla bf16 kernels; they differ only in where chunks start, so rounding (about
# 1e-3) is what is left; the A_log gradient (a per-head sum of cancelling terms) amplifies it.
BF16, BF16_A_LOG = 2e-2, 0.15


@pytest.mark.gpu
@gpu
def test_chained_pieces_equal_whole_sequence_gpu():
    errors = _errors(8192, GPU_PIECES, 4, 128, "cuda", torch.bfloat16, "fla", PiecesInOrder(), segments=16)
    print({k: f"{v:.1e}" for k, v in errors.items()})
    bad = {k: v for k, v in errors.items() if not v <= (BF16_A_LOG if k == "dA_log" else BF16)}
    assert not bad, f"fla state passing vs fla chunk_kda above tolerance: {bad}"


@pytest.mark.gpu
@gpu
def test_unchained_pieces_are_caught_gpu():
    errors = _errors(8192, GPU_PIECES, 4, 128, "cuda", torch.bfloat16, "fla", IsolatedPieces(), segments=16)
    assert errors["out"] > 5e-2, f"dropping the chain went unnoticed: {errors}"
