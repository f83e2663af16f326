"""The layer's projection GEMMs (kda/rows.py): gathered rows are not kept for backward."""

import torch

from skyrl_megatron_kda.kda import rows as rows_module
from skyrl_megatron_kda.kda.rows import project_rows
from tests.support.kda_cases import saved_bytes


class _Doubling:
    """A stand-in for a two-rank row gather: rows = [shard; 2 * shard], and its adjoint."""

    def __init__(self):
        self.calls = []

    def _started(self, name, result):
        self.calls.append(name)
        return lambda: (self.calls.append(f"wait {name}"), result)[1]

    def start_gather(self, shard, phase):
        return self._started(f"gather {phase}", torch.cat([shard, 2 * shard]))

    def start_reduce_scatter(self, rows_grad):
        n = rows_grad.shape[0] // 2
        return self._started("reduce_scatter", rows_grad[:n] + 2 * rows_grad[n:])


def test_gathered_projection_equals_autograd_and_keeps_only_the_shard():
    g = torch.Generator().manual_seed(0)
    shard = torch.randn(6, 2, 64, generator=g, dtype=torch.float64)
    w1 = torch.randn(12, 64, generator=g, dtype=torch.float64)
    w2 = torch.randn(5, 64, generator=g, dtype=torch.float64)
    w3 = torch.randn(4, 64, generator=g, dtype=torch.float64)
    gather = _Doubling()

    ours = [t.clone().requires_grad_() for t in (shard, w1, w2, w3)]
    (a, b), saved = saved_bytes(lambda: project_rows(ours[0], gather, (ours[1], ours[2]), (ours[3],)))
    ref = [t.clone().requires_grad_() for t in (shard, w1, w2, w3)]
    full = torch.cat([ref[0], 2 * ref[0]])
    ref_a = torch.nn.functional.linear(full, torch.cat([ref[1], ref[2]]))
    ref_b = torch.nn.functional.linear(full, ref[3])

    assert a.shape == (12, 2, 17) and b.shape == (12, 2, 4)
    torch.testing.assert_close(a, ref_a, rtol=0, atol=1e-12)
    torch.testing.assert_close(b, ref_b, rtol=0, atol=1e-12)
    da, db = torch.randn_like(a), torch.randn_like(b)
    ((a * da).sum() + (b * db).sum()).backward()
    ((ref_a * da).sum() + (ref_b * db).sum()).backward()
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    # One gather forward, one again in backward for all the weights, one reduce-scatter; the
    # input gradient (which needs no rows) is already reduce-scattering when backward waits for
    # the rows, and the weight gradients run before it waits for the reduce-scatter.
    assert gather.calls == ["gather fwd", "wait gather fwd", "gather bwd", "reduce_scatter",
                            "wait gather bwd", "wait reduce_scatter"]
    # Saved: the shard and the stacked, padded weights; not the gathered rows (twice the shard).
    weights = (24 + 8) * 64 * 8  # 12 + 5 rows padded to 24, 4 to 8
    assert saved == shard.numel() * 8 + weights


def test_odd_widths_are_padded_to_a_multiple_of_8(monkeypatch):
    """cuBLAS's fast kernels need 16-byte aligned bf16 widths: the GEMM runs on a weight padded
    with zero rows, and the padding's outputs are sliced off."""
    widths = []
    linear = torch.nn.functional.linear

    def spy(x, w):
        widths.append(w.shape[0])
        return linear(x, w)

    monkeypatch.setattr(rows_module.F, "linear", spy)
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    w12, w16 = torch.randn(12, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
    out12, out16 = project_rows(x, None, (w12,), (w16,))
    assert widths == [16, 16]
    assert torch.equal(out12, linear(x, w12)) and torch.equal(out16, linear(x, w16))


def test_a_single_unpadded_weight_is_saved_as_the_parameters_view():
    """q, k and v project with row slices of their parameters (``KimiDeltaAttention.project``):
    autograd keeps those views, no copy; only a stacked (or padded) weight is a new tensor, which
    is why memory/kda.py counts the low-rank | beta stack alone."""
    shard = torch.randn(6, 2, 64, dtype=torch.float64, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.float64))
    other = torch.nn.Parameter(torch.randn(8, 64, dtype=torch.float64))
    _, saved = saved_bytes(lambda: project_rows(shard, None, (param[8:24],)), exclude=[param, other])
    assert saved == shard.numel() * 8
    # Control: the same rows stacked with another weight are a new [24, 64] tensor.
    _, stacked = saved_bytes(lambda: project_rows(shard, None, (param[8:24], other)), exclude=[param, other])
    assert stacked == shard.numel() * 8 + 24 * 64 * 8
