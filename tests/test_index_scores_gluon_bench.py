"""``bench/index_scores_gluon.py`` on CPU: its Gluon score kernel compiles for sm_90a under the
installed Triton and ptxas keeps the overlapped variant's products asynchronous (the second
tile's product still running while the first tile's epilogue runs); the same kernel with 8
queries a program is serialised (ptxas's C7512), the control that the check can fail. And
``bench/indexer_profile.py --gluon`` puts each variant in a kernel set with its own group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.support.sparse_mla_ops import torch_sparse_mla_ops

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    import index_scores_gluon

    return index_scores_gluon


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_overlapped_kernel_keeps_a_product_running_under_an_epilogue(bench, precision):
    ptx, log = bench.ptxas_report(precision, group=32, stages=4, overlap=True, query_tile=4)
    assert bench.serialised(log) == []
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "0 bytes spill stores" in log


def test_eight_queries_overlapped_are_serialised(bench):
    _, log = bench.ptxas_report("bf16", group=32, stages=4, overlap=True, query_tile=8)
    assert any("C7512" in message for message in bench.serialised(log))


def test_shapes_the_kernel_does_not_take_are_refused(bench):
    q, keys = torch.zeros(4, 16, 128), torch.zeros(64, 128)
    ends = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="expected 32 heads of 128"):
        bench.gluon_pool_scores(q, keys, torch.zeros(4, 16), ends, ends)


def test_the_indexer_profile_swaps_in_each_gluon_variant_with_its_group():
    """``bench/indexer_profile.py --gluon``: each precision's kernel set with a Gluon variant as
    its scorer and that variant's maxima group as the top-k's."""
    sys.path.insert(0, str(BENCH))
    import indexer_profile

    base = {"bf16": torch_sparse_mla_ops(), "fp8": torch_sparse_mla_ops()}
    variants = indexer_profile.gluon_variants(base)
    assert len(variants) == 2 * len(indexer_profile.GLUON_VARIANTS)
    for name, kernels in variants.items():
        precision = name.split(",")[0]
        assert kernels.index_scores.keywords["group"] == kernels.index_group
        assert kernels.index_scores.func.__name__ == {
            "bf16": "gluon_pool_scores", "fp8": "gluon_fp8_pool_scores"}[precision]
        assert kernels.forward is base[precision].forward
    assert {k.index_group for k in variants.values()} == {16, 32}
