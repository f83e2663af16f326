"""``bench/latent_backward_ablation.py`` on CPU: it loads without CUDA or tilelang and refuses an
unknown row or a shared fraction outside [0, 1] in one line before it touches a GPU; the
pool-shaped selections it times keep their contract with shared pools."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "latent_backward_ablation.py"


def _refusal(*args: str) -> list[str]:
    """The bench's error lines for ``args``, which it must refuse with exit status 2."""
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 2
    return [line for line in run.stderr.splitlines() if line.startswith("latent_backward")]


def test_an_unknown_row_is_one_line_naming_the_rows():
    error = _refusal("--rows", "as it is,no such row")
    assert len(error) == 1 and "unknown rows ['no such row']" in error[0]
    assert "'memory only: adds'" in error[0] and "'as it is'" in error[0]


def test_a_shared_fraction_outside_zero_to_one_is_one_line():
    error = _refusal("--shared-pools", "0,1.5")
    assert len(error) == 1 and "fractions in [0, 1], got '0,1.5'" in error[0]


def _indices(shared: float, seed: int = 0):
    import torch

    sys.path.insert(0, str(BENCH.parent))
    from latent_sparse_mla import KPOOL, TOPK, pool_shaped_indices

    positions = torch.arange(7168, 8192)  # every query sees at least 1,792 complete pools
    gen = torch.Generator().manual_seed(seed)
    return positions, pool_shaped_indices(positions, gen, block=256, shared=shared), KPOOL, TOPK


@pytest.mark.parametrize("shared", [0.0, 0.5, 0.9])
def test_pool_shaped_indices_keep_their_contract_with_shared_pools(shared):
    """Each query: 512 distinct whole pools it can see, then its tail; with ``shared`` that
    fraction of the pools common to its block of 256, and (the control) none at 0 beyond
    chance."""
    import torch

    positions, idx, kpool, topk = _indices(shared)
    assert idx.shape == (1024, topk + kpool - 1) and idx.dtype == torch.int32
    tokens = idx[:, :topk].long()
    pools = tokens.view(1024, -1, kpool)
    assert torch.equal(pools - pools[..., :1], torch.arange(kpool).expand_as(pools))  # whole pools
    starts = pools[..., 0] // kpool
    assert bool((starts.sort(-1).values.diff(dim=-1) > 0).all())                 # distinct
    assert bool((tokens <= positions[:, None]).all())                             # causal
    complete = (positions + 1) // kpool * kpool
    tail = idx[:, topk:].long()
    expected = complete[:, None] + torch.arange(kpool - 1)
    assert torch.equal(tail, torch.where(expected <= positions[:, None], expected, -1))
    for block in starts.view(4, 256, -1):
        common = set(block[0].tolist()).intersection(*(set(r.tolist()) for r in block[1:]))
        assert round(shared * 512) <= len(common) <= round(shared * 512) + 2


def test_without_shared_pools_the_draws_are_unchanged():
    import torch

    positions, unshared, *_ = _indices(0.0, seed=3)
    sys.path.insert(0, str(BENCH.parent))
    from latent_sparse_mla import pool_shaped_indices

    assert torch.equal(unshared, pool_shaped_indices(positions, torch.Generator().manual_seed(3),
                                                     block=256))
    assert not torch.equal(unshared, _indices(0.5, seed=3)[1])
