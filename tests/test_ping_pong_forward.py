"""The ping-pong forward (``bench/experiments/ping_pong_forward.py``), an opt-in variant of our
sparse-MLA forward kept outside the package: its refusals on CPU (checked before TileLang is
needed), and on a GPU the attention it computes against the fp32 torch attention at 64- and
32-key blocks, with the wrong-head control the tolerance must catch. The cases and tolerance are
``tests/test_latent_sparse_mla.py``'s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.test_latent_sparse_mla import SCALE, TOL, _case, _rel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from experiments import ping_pong_forward as ping_pong  # noqa: E402

from skyrl_megatron_kda.dsa.ops.latent.interface import latent_backward  # noqa: E402
from skyrl_megatron_kda.dsa.sparse_mla import sparse_latent_attention  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="TileLang kernels need CUDA")
STACKED = {"stacked": True, "channel_split": 4, "store_split": 1}


def test_the_ping_pong_forward_refuses_shapes_it_does_not_cover():
    """64-head groups and pairs of key blocks, as the warp-specialised forward; it is one of
    those, so a tuning names both; the package's forward no longer takes the keyword."""
    for heads, topk in ((32, 2176), (64, 2112)):
        with pytest.raises(ValueError, match="ping-pong"):
            ping_pong.forward_program(heads, 512, topk, SCALE, warp_specialized=True,
                                      ping_pong=True)
    with pytest.raises(ValueError, match="name warp_specialized"):
        ping_pong.forward_program(64, 512, 2176, SCALE, ping_pong=True)
    with pytest.raises(ValueError, match="its own threads"):
        ping_pong.forward_program(64, 512, 2176, SCALE, warp_specialized=True, ping_pong=True,
                                  num_stages=3)
    with pytest.raises(TypeError, match="ping_pong"):
        ping_pong.package_forward.forward_program(64, 512, 2176, SCALE, warp_specialized=True,
                                                  ping_pong=True)


def _errors(q, kv, idx, grad, kernel_q=None, **forward_config):
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ref = sparse_latent_attention(qr, kvr, idx, SCALE)
    ref.backward(grad.float())
    kq = q if kernel_q is None else kernel_q
    out, lse = ping_pong.latent_forward(kq, kv, idx, SCALE, ping_pong=True,
                                        warp_specialized=True, **forward_config)
    delta = (out.float() * grad.float()).sum(-1)
    dq, dkv = latent_backward(kq, kv, grad, idx, lse, delta, SCALE, **STACKED)
    assert not out[7].any() and not dq[7].any() and not lse[7].any()
    return {"out": _rel(out, ref), "dq": _rel(dq, qr.grad), "dkv": _rel(dkv, kvr.grad)}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("key_block", [64, 32])
def test_the_ping_pong_forward_matches_the_fp32_attention(key_block):
    gen = torch.Generator(device="cuda").manual_seed(64)
    errors = _errors(*_case(64, gen, torch.device("cuda")), key_block=key_block)
    print(key_block, errors)
    assert max(errors.values()) < TOL, errors


@pytest.mark.gpu
@cuda
def test_a_wrong_head_is_caught():
    """Control, as ``tests/test_latent_sparse_mla.py::test_a_wrong_head_is_caught``."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, kv, idx, grad = _case(64, gen, torch.device("cuda"))
    q = (q.float() * 4).bfloat16()
    errors = _errors(q, kv, idx, grad, kernel_q=q.roll(1, dims=1))
    print(errors)
    assert min(errors.values()) > 10 * TOL, errors
