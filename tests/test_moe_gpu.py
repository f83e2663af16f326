"""Our MoE layer (``model/moe.py``'s ``build_moe_layer``: ``GLMMoELayer``) under megatron's
``alltoall`` token dispatcher on one GPU, against the ``allgather`` dispatcher on the same GPU and
against the CPU in fp32: outputs, the input's gradient, every parameter's gradient and the
router's token counts (the expert-bias update's input), whole and in token chunks
(``train.moe_chunk_tokens``), for three routings: the 1M recipe's rank share (9 local experts,
top-8), a sparse one (16 experts, top-2) and the sparse one with an expert that gets no row (at
EP=1 the empty expert of NVIDIA/Megatron-LM#1877). Skips without CUDA: megatron's alltoall
dispatcher makes a CUDA stream when it is built.

At EP=1 the dispatchers differ only in local work: allgather permutes the rows by the routing
map and masks the fp32 probabilities out of it; alltoall permutes rows and fp32 probabilities
together, sorts the permuted chunks by local expert and unsorts them before unpermuting. The
experts' GEMMs see the same rows in the same order; what may differ is the order in which
unpermute's scatter-add sums a row's top-k outputs (CUDA atomics).

Every run sees the same values: weights and input are bf16-representable, and the router's
weights and input are coarse dyadic numbers, so its fp32 logits are exact in any summation order
and every run (CPU or GPU, fp32 or bf16) routes every row the same way (asserted); a routing
flip from rounding would otherwise look like a permutation bug.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from skyrl_megatron_kda.config import MoEConfig
from tests.support.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: megatron's alltoall dispatcher builds a CUDA stream"),
]

HIDDEN = 256
ROWS, BATCH = 1000, 2  # [s, b]: 2,000 tokens
CHUNK = 384
"""``chunk_tokens``: rows of s per chunk; 1,000 rows give two full chunks and a partial one."""

ROUTINGS = {
    "share": dict(num_experts=9, top_k=8, idle_expert=False),
    "sparse": dict(num_experts=16, top_k=2, idle_expert=False),
    "idle_expert": dict(num_experts=16, top_k=2, idle_expert=True),
}

FP32 = 1e-5
"""fp32, relative norm error of outputs and of every gradient, alltoall against allgather on the
GPU and against the CPU: only summation order differs (~1e-7). One misrouted (token, expert)
pair of the 16,000 moves the output by about 1e-2 (the negative control)."""
BF16 = 1e-2
"""bf16 on the GPU, alltoall against allgather, relative norm error of outputs and gradients:
the same bf16 arithmetic up to the order of the scatter-add (a few bf16 ulps in some elements)."""
BF16_ROW = 5e-2
"""bf16, alltoall against allgather, the largest error of one output row over the rows' RMS
norm: catches a single misrouted pair (a row off by one expert's share, about 1e-1), which the
norm over all rows dilutes."""
BF16_VS_CPU = 3e-2
"""bf16 on the GPU against fp32 on the CPU, relative norm error of the output: bf16 rounding of
the experts' GEMMs and activations (4e-3 measured with bf16 on the CPU); rows routed to the wrong
expert give order 1e-1 or more."""
BF16_VS_CPU_GRAD = 0.15
"""The same for the input's and the parameters' gradients: near the SwiGLU clamp's limit the
bf16 rounding of an element decides whether its gradient is zero, so the fc1 gradients and the
input's differ by up to 6.4e-2 (bf16 against fp32, both on the CPU); misrouted rows give order 1."""


def _moe(routing: str) -> MoEConfig:
    r = ROUTINGS[routing]
    return MoEConfig(num_experts=r["num_experts"], top_k=r["top_k"], ffn_hidden_size=64,
                     num_shared_experts=1, routed_scaling_factor=2.5)


def _config(moe: MoEConfig, dispatcher: str, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from skyrl_megatron_kda.model.moe import check_glm_moe_config, moe_transformer_config_kwargs

    kwargs = moe_transformer_config_kwargs(moe.model_copy(update={"dispatcher": dispatcher}))
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, **kwargs)
    check_glm_moe_config(config)
    return config


def _state(layer, routing: str, gen: torch.Generator) -> dict:
    """Weights for ``layer``'s state dict: bf16-representable, the router's dyadic (multiples of
    2^-8, |w| <= 1/4) so that its logits are exact; the clamp fires in some experts."""
    state = {}
    for name, value in layer.state_dict().items():
        if not isinstance(value, torch.Tensor):  # a linear's (empty) extra state
            state[name] = value
            continue
        if name == "router.weight":
            w = (torch.randn(value.shape, generator=gen) * 12.8).round().clamp(-64, 64) / 256
        elif name == "router.expert_bias":
            w = torch.randn(value.shape, generator=gen) * 0.1
            if ROUTINGS[routing]["idle_expert"]:
                w[0] = -100.0  # below every other expert's score + bias: expert 0 gets no row
        elif "linear_fc1" in name:
            w = torch.randn(value.shape, generator=gen) * 0.15
        elif "linear_fc2" in name:
            w = torch.randn(value.shape, generator=gen) * 0.05
        else:
            raise AssertionError(f"unexpected MoE state {name}")
        state[name] = w if name == "router.expert_bias" else w.to(torch.bfloat16).float()
    return state


@contextlib.contextmanager
def _cuda_device_named_cpu(active: bool):
    """megatron's router moves a CPU weight to ``torch.cuda.current_device()`` before its GEMM
    and makes its buffers there: for the CPU reference in this CUDA process, that is the CPU."""
    if not active:
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _run(moe, dispatcher, device, dtype, chunk, state, x, grad_out, pgs) -> dict:
    with _cuda_device_named_cpu(device == "cpu"):
        return _run_on(moe, dispatcher, device, dtype, chunk, state, x, grad_out, pgs)


def _run_on(moe, dispatcher, device, dtype, chunk, state, x, grad_out, pgs) -> dict:
    from skyrl_megatron_kda.model.moe import build_moe_layer

    layer = build_moe_layer(moe, config=_config(moe, dispatcher, dtype), layer_number=1,
                            pg_collection=pgs, chunk_tokens=chunk)
    layer.load_state_dict(state, strict=True)
    layer.to(device)
    maps = []
    layer.router.register_forward_hook(lambda _m, _i, out: maps.append(out[1].cpu()))
    x_in = x.to(device, dtype).detach().clone().requires_grad_()
    y, bias = layer(x_in)
    assert bias is None
    y.backward(grad_out.to(device, dtype))
    cpu = lambda t: t.detach().float().cpu()  # noqa: E731
    return {"y": cpu(y), "dx": cpu(x_in.grad),
            "grads": {n: cpu(p.grad) for n, p in layer.named_parameters()},
            "routing_map": torch.cat(maps), "tokens_per_expert": cpu(layer.router.local_tokens_per_expert)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative norm error; absolute where ``b`` is zero (the idle expert's gradients)."""
    scale = b.norm()
    return float((a - b).norm() / scale) if scale > 0 else float(a.norm())


def _row_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    rms = rows_b.norm(dim=-1).pow(2).mean().sqrt()
    return float((rows_a - rows_b).norm(dim=-1).max() / rms)


def _errors(run: dict, ref: dict) -> dict:
    out = {"y": _rel(run["y"], ref["y"]), "dx": _rel(run["dx"], ref["dx"]),
           "y_row": _row_rel(run["y"], ref["y"])}
    out.update({f"grad.{n}": _rel(g, ref["grads"][n]) for n, g in run["grads"].items()})
    return out


def _swap_first_two_dispatched_rows() -> None:
    """Negative control: alltoall's dispatch hands the experts its first two permuted rows in
    swapped order (two tokens of one expert exchange that expert's output)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    postprocess = MoEAlltoAllTokenDispatcher.dispatch_postprocess

    def swapped(self, tokens, probs):
        tokens, per_expert, probs = postprocess(self, tokens, probs)
        return tokens[torch.tensor([1, 0, *range(2, tokens.shape[0])], device=tokens.device)], per_expert, probs
    MoEAlltoAllTokenDispatcher.dispatch_postprocess = swapped


def _compare_on_rank(rank, world, routings, chunks, devices=("cuda",), swap_rows=False):
    """Per (routing, chunk): the errors of each alltoall run against allgather on its device and
    dtype and against allgather in fp32 on the CPU, and whether all runs routed alike."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from skyrl_megatron_kda.model.moe import build_moe_layer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if swap_rows:
        _swap_first_two_dispatched_rows()
    parallel_state.initialize_model_parallel()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    results = {}
    for routing in routings:
        moe = _moe(routing)
        gen = torch.Generator().manual_seed(7)
        probe = _config(moe, "allgather", torch.float32)
        state = _state(build_moe_layer(moe, config=probe, layer_number=1, pg_collection=pgs), routing, gen)
        # dyadic input: multiples of 1/32 within +-8 (bf16-exact, exact router products)
        x = ((torch.randn(ROWS, BATCH, HIDDEN, generator=gen) * 3 * 32).round().clamp(-256, 256) / 32)
        grad_out = torch.randn(ROWS, BATCH, HIDDEN, generator=gen).to(torch.bfloat16).float()
        for chunk in chunks:
            args = (chunk, state, x, grad_out, pgs)
            cpu_ref = _run(moe, "allgather", "cpu", torch.float32, *args)
            case = {}
            runs = {"cpu_ref": cpu_ref}
            for device in devices:
                for dtype in (torch.float32, torch.bfloat16):
                    name = f"{device}_{str(dtype).split('.')[-1]}"
                    ag = _run(moe, "allgather", device, dtype, *args)
                    a2a = _run(moe, "alltoall", device, dtype, *args)
                    runs[f"{name}_allgather"], runs[f"{name}_alltoall"] = ag, a2a
                    case[f"{name}: alltoall vs allgather"] = _errors(a2a, ag)
                    case[f"{name}: alltoall vs cpu fp32"] = _errors(a2a, cpu_ref)
            case["same_routing"] = all(torch.equal(r["routing_map"], cpu_ref["routing_map"]) for r in runs.values())
            case["same_token_counts"] = all(torch.equal(r["tokens_per_expert"], cpu_ref["tokens_per_expert"])
                                            for r in runs.values())
            counts = cpu_ref["tokens_per_expert"]
            case["rows_per_expert_min_max"] = (int(counts.min()), int(counts.max()))
            results[f"{routing} chunk={chunk}"] = case
    parallel_state.destroy_model_parallel()
    return results


def _failures(results: dict) -> list[str]:
    """Each comparison above its tolerance, named."""
    bad = []
    for case, r in results.items():
        if not (r["same_routing"] and r["same_token_counts"]):
            bad.append(f"{case}: runs routed differently")
        for what, errors in r.items():
            if not isinstance(errors, dict):
                continue
            fp32 = "float32" in what
            for key, err in errors.items():
                if key == "y_row":  # the norms catch one misrouted pair in fp32, not in bf16
                    limit = BF16_ROW if not fp32 and what.endswith("vs allgather") else None
                elif fp32:
                    limit = FP32
                elif "cpu fp32" in what:
                    limit = BF16_VS_CPU if key == "y" else BF16_VS_CPU_GRAD
                else:
                    limit = BF16
                if limit is not None and not err <= limit:
                    bad.append(f"{case} {what} {key}: {err:.2e} > {limit:.0e}")
    return bad


def _show(results: dict) -> None:
    for case, r in results.items():
        print(case, {k: v for k, v in r.items() if not isinstance(v, dict)})
        for what, errors in r.items():
            if isinstance(errors, dict):
                worst_grad = max((v for k, v in errors.items() if k.startswith("grad.")), default=0.0)
                print(f"  {what}: y {errors['y']:.1e} y_row {errors['y_row']:.1e} dx {errors['dx']:.1e} "
                      f"worst grad {worst_grad:.1e}")


@pytest.fixture(scope="module")
def compared():
    (results,) = run_ranks(1, _compare_on_rank, list(ROUTINGS), (0, CHUNK), backend="nccl")
    _show(results)
    return results


@pytest.mark.parametrize("chunk", [0, CHUNK], ids=["whole", "chunks"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_alltoall_equals_allgather_and_cpu(compared, routing, chunk):
    case = {k: v for k, v in compared.items() if k == f"{routing} chunk={chunk}"}
    assert case, sorted(compared)
    (r,) = case.values()
    assert not _failures(case), _failures(case)
    if ROUTINGS[routing]["idle_expert"]:
        assert r["rows_per_expert_min_max"][0] == 0, "no expert is left without rows"
    else:
        assert r["rows_per_expert_min_max"][0] > 0


def test_negative_control_a_swapped_pair_is_caught():
    """Two dispatched rows swapped inside alltoall: the fp32 comparisons (with allgather and with
    the CPU) and the bf16 one with allgather fail their tolerances, whole and in chunks."""
    (results,) = run_ranks(1, _compare_on_rank, ["sparse"], (0, CHUNK), ("cuda",), True, backend="nccl")
    _show(results)
    for case, r in results.items():
        assert r["same_routing"], case  # the router is untouched: only the dispatch is wrong
        for what in ("cuda_float32: alltoall vs allgather", "cuda_float32: alltoall vs cpu fp32"):
            assert r[what]["y"] > FP32 and r[what]["dx"] > FP32, (case, what, r[what])
        bf16 = r["cuda_bfloat16: alltoall vs allgather"]
        assert bf16["y_row"] > BF16_ROW, (case, bf16)
        assert _failures({case: r}), case
