"""mHC hyper-connections: ours vs transformers' glm5_next on CPU.

The transformers comparison runs in a spawned process (``run_ranks(1, ...)``) so that hiding fla
there (transformers would pick its GPU kernels) cannot affect other tests.
"""

import pytest
import torch

from skyrl_megatron_kda.model.hyper_connections import (
    HyperConnection,
    NormalizedProjection,
    expand_to_streams,
    normalized_projection,
    reduce_streams,
    sinkhorn_knopp,
)
from tests.support.ranks import run_ranks

HIDDEN, STREAMS = 64, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def _tiny_config():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    return Glm5NextTextConfig(
        vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=HIDDEN,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
        q_lora_rank=48, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, index_topk=8,
        index_kpool=4, index_head_dim=16, index_n_heads=2, linear_num_heads=4, linear_head_dim=16,
        hc_mult=STREAMS)


@torch.no_grad()
def _scramble_hc(hc: torch.nn.Module) -> None:
    """Far-from-uniform maps, so that a wrong Sinkhorn or a transposed comb shows."""
    hc.fn.normal_(0, 0.5)
    hc.base.normal_(0, 1.0)
    hc.scale.uniform_(0.5, 2.0)


def _compare_maps(rank, world):
    import sys

    sys.modules["fla"] = None  # transformers would pick fla's Triton kernels, which need a GPU
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    torch.set_grad_enabled(False)  # this spawned process only compares values
    torch.manual_seed(0)
    config = _tiny_config()
    ref = Glm5NextTextHyperConnection(config).float()
    _scramble_hc(ref)
    ours = HyperConnection(HIDDEN, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
    ours.load_state_dict(ref.state_dict())
    one_iter = HyperConnection(HIDDEN, config.hc_mult, 1, config.hc_eps, config.rms_norm_eps)
    one_iter.load_state_dict(ref.state_dict())

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        streams = torch.randn(2, 7, STREAMS, HIDDEN).to(dtype)  # [B, S, N, D]
        block_out = torch.randn(2, 7, HIDDEN).to(dtype)
        post_r, comb_r, collapsed_r = ref(streams)
        new_r = post_r.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb_r.to(dtype).transpose(-1, -2), streams)  # as Glm5NextTextDecoderLayer does
        pre, post, comb = ours.mixing_maps(streams)
        collapsed = ours.collapse(streams, pre)
        new = ours.expand(block_out, streams, post, comb)
        # megatron layout [S, B, N, D] gives the same numbers
        coll_sb, post_sb, comb_sb = ours(streams.transpose(0, 1))
        res = dict(post=_rel(post, post_r), comb=_rel(comb, comb_r), collapse=_rel(collapsed, collapsed_r),
                   expand=_rel(new, new_r), sb_layout=_rel(coll_sb.transpose(0, 1), collapsed_r),
                   dtypes=(str(collapsed.dtype), str(new.dtype), str(post.dtype), str(comb.dtype)))
        if dtype == torch.float32:
            _, _, comb_1 = one_iter.mixing_maps(streams)
            res["control_one_iter"] = _rel(comb_1, comb_r)
            res["control_transposed"] = _rel(ours.expand(block_out, streams, post, comb.transpose(-1, -2)), new_r)
            res["col_sum_err"] = float((comb.sum(-2) - 1).abs().max())
            res["row_sum_err"] = float((comb.sum(-1) - 1).abs().max())
        out[str(dtype)] = res
    return out


def _compare_model(rank, world):
    """Whole tiny model: capture each decoder layer's streams and block outputs with hooks, then
    check that ours reproduces every block input, every layer output, the embedding expansion and
    the final collapse, layer by layer."""
    import sys

    sys.modules["fla"] = None
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    torch.manual_seed(0)
    config = _tiny_config()
    model = Glm5NextTextModel(config).float().eval()
    for layer in model.layers:
        _scramble_hc(layer.attn_hc)
        _scramble_hc(layer.ffn_hc)

    seen: dict[str, torch.Tensor] = {}

    def keep(name, pre=False):
        def hook(module, args, output=None):
            t = args[0] if pre else output
            seen[name] = (t[0] if isinstance(t, tuple) else t).detach().clone()
        return hook

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(keep(f"{i}.in", pre=True))
        layer.register_forward_hook(keep(f"{i}.out"))
        layer.input_layernorm.register_forward_pre_hook(keep(f"{i}.attn_in", pre=True))
        layer.self_attn.register_forward_hook(keep(f"{i}.attn_out"))
        layer.post_attention_layernorm.register_forward_pre_hook(keep(f"{i}.ffn_in", pre=True))
        layer.mlp.register_forward_hook(keep(f"{i}.ffn_out"))
    model.norm.register_forward_pre_hook(keep("final_in", pre=True))

    ids = torch.randint(3, 256, (2, 12))
    with torch.no_grad():
        model(input_ids=ids)
        errs = {"embed_expand": _rel(expand_to_streams(model.embed_tokens(ids), STREAMS), seen["0.in"])}
        for i, layer in enumerate(model.layers):
            hcs = []
            for ref_hc in (layer.attn_hc, layer.ffn_hc):
                hc = HyperConnection(HIDDEN, STREAMS, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
                hc.load_state_dict(ref_hc.state_dict())
                hcs.append(hc)
            streams = seen[f"{i}.in"]
            attn_in, post, comb = hcs[0](streams)
            mid = hcs[0].expand(seen[f"{i}.attn_out"], streams, post, comb)
            ffn_in, post, comb = hcs[1](mid)
            out = hcs[1].expand(seen[f"{i}.ffn_out"], mid, post, comb)
            errs[f"layer{i}.attn_in"] = _rel(attn_in, seen[f"{i}.attn_in"])
            errs[f"layer{i}.ffn_in"] = _rel(ffn_in, seen[f"{i}.ffn_in"])
            errs[f"layer{i}.out"] = _rel(out, seen[f"{i}.out"])
        errs["final_collapse"] = _rel(reduce_streams(seen["3.out"]), seen["final_in"])
    return errs


def test_maps_match_transformers():
    ((res,),) = [run_ranks(1, _compare_maps)]
    print(res)
    f32, bf16 = res["torch.float32"], res["torch.bfloat16"]
    for key in ("post", "comb", "collapse", "expand", "sb_layout"):
        assert f32[key] < 1e-6, f"fp32 {key}: relative error {f32[key]:.2e}"
        assert bf16[key] < 1e-3, f"bf16 {key}: relative error {bf16[key]:.2e}"
    assert f32["control_one_iter"] > 1e-3, f"1 Sinkhorn iteration went unnoticed ({f32['control_one_iter']:.2e})"
    assert f32["control_transposed"] > 1e-3, f"transposed comb went unnoticed ({f32['control_transposed']:.2e})"
    # Sinkhorn ends on a column pass: columns sum to 1; rows only approximately after 20
    # iterations on these far-from-uniform logits (reported, not asserted).
    assert f32["col_sum_err"] < 1e-5
    assert bf16["dtypes"] == ("torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32")


def test_model_streams_match_transformers():
    (errs,) = run_ranks(1, _compare_model)
    print(errs)
    for key, err in errs.items():
        assert err < 1e-6, f"{key}: relative error {err:.2e}"


def test_module_dtypes_grads_and_tp_tags():
    torch.manual_seed(0)
    hc = HyperConnection(HIDDEN, STREAMS)
    assert all(p.dtype == torch.float32 and p.sequence_parallel for p in hc.parameters())
    assert hc.fn.shape == ((2 + STREAMS) * STREAMS, STREAMS * HIDDEN)
    streams = expand_to_streams(torch.randn(5, 3, HIDDEN, dtype=torch.bfloat16), STREAMS)  # [S, B, N, D]
    block_in, post, comb = hc(streams)
    assert block_in.dtype == torch.bfloat16 and block_in.shape == (5, 3, HIDDEN)
    assert post.dtype == comb.dtype == torch.float32 and comb.shape == (5, 3, STREAMS, STREAMS)
    new = hc.expand(torch.tanh(block_in), streams, post, comb)
    assert new.dtype == torch.bfloat16 and new.shape == streams.shape
    reduce_streams(new).float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in hc.parameters())
    # Sinkhorn alone: columns normalised, rows converge with more iterations.
    logits = torch.randn(10, 4, 4) * 3
    m = sinkhorn_knopp(logits, 20, 1e-6)
    assert (m.sum(-2) - 1).abs().max() < 1e-5
    row_err = [float((sinkhorn_knopp(logits, it, 1e-6).sum(-1) - 1).abs().max()) for it in (1, 20, 200)]
    assert row_err[0] > row_err[1] > row_err[2] and row_err[2] < 1e-3, row_err


def _projection_grads(project, flat, weight, grad, eps=1e-5):
    flat = flat.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    out = project(flat, weight, eps)
    out.backward(grad)
    return out, flat.grad, weight.grad


@pytest.mark.parametrize("chunk_rows", [35, 8, 1], ids=["one_chunk", "chunks_of_8", "rows"])
def test_normalized_projection_grads_are_autograds(chunk_rows):
    """The projection that keeps only its input and weight, run in chunks of rows, gives the
    plain autograd graph's output and gradients bit for bit in one chunk (it rebuilds the same
    ops). Over several chunks the GEMMs run on fewer rows (another blocking, so another fp32
    rounding) and the weight gradient is a sum over chunks: within 1e-6 in fp32, and the bf16
    input gradient within one bf16 rounding step, for fp32 and bf16 streams."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        flat = (torch.randn(7, 5, STREAMS * HIDDEN, generator=gen) * 3).to(dtype)
        weight = torch.randn(24, STREAMS * HIDDEN, generator=gen) * 0.02
        grad = torch.randn(7, 5, 24, generator=gen)
        plain = _projection_grads(normalized_projection, flat, weight, grad)
        kept = _projection_grads(_chunked(chunk_rows), flat, weight, grad)
        for a, b, name in zip(plain, kept, ("output", "input grad", "weight grad")):
            assert a.dtype == b.dtype, name
            if chunk_rows >= 35:
                assert torch.equal(a, b), (dtype, name)
            else:
                tol = 1e-6 if b.dtype == torch.float32 else 2.0**-7
                assert _rel(b, a) < tol, (dtype, name, _rel(b, a))
        # Controls: a different eps in the rebuilt graph shows up in the input gradient; one
        # chunk's share missing from the weight gradient is far outside the tolerance.
        other = _projection_grads(_chunked(chunk_rows, eps=1e-1), flat, weight, grad)
        assert not torch.equal(other[1], plain[1])
        if chunk_rows < 35:
            partial = grad.flatten(0, 1).clone()
            partial[-chunk_rows:] = 0
            missing = _projection_grads(normalized_projection, flat, weight, partial.view_as(grad))
            assert _rel(missing[2], plain[2]) > 1e-3


def _chunked(chunk_rows: int, eps: float | None = None):
    return lambda flat, weight, e: NormalizedProjection.apply(flat, weight, e if eps is None else eps, chunk_rows)


def test_map_backward_holds_one_chunk_as_the_plan_counts():
    """Census of the maps' backward working set on CPU (every storage its ops allocate, from
    allocation to the death of its last tensor), against ``memory.blocks.mhc_map_backward_bytes`` for
    the recipe's rows, width and ``map_chunk_rows``: within 7% below it (the plan is an upper
    bound), and with chunks a fraction of one whole-rows chunk's (the control: the working set
    without chunks, 6 fp32 copies of every row, 48 GiB at 131,072 rows of GLM's width)."""
    from skyrl_megatron_kda.memory.blocks import mhc_map_backward_bytes
    from skyrl_megatron_kda.memory.rows import rows_of
    from skyrl_megatron_kda.recipes import load_recipe
    from tests.support.live_bytes import LiveBytes

    peaks = {}
    for chunk in (256, 100, 32):
        recipe = load_recipe("glm53_flash_tiny", ["model.params_dtype=bfloat16", "data.seq_len=1024",
                                                  f"model.hyper_connections.map_chunk_rows={chunk}"]).recipe
        m, rows = recipe.model, rows_of(recipe).sp
        width, n = m.hyper_connections.num_streams * m.hidden_size, m.hyper_connections.num_streams
        gen = torch.Generator().manual_seed(0)
        flat = torch.randn(rows, width, generator=gen).to(torch.bfloat16).requires_grad_()
        weight = torch.randn((2 + n) * n, width, generator=gen, requires_grad=True)
        out = NormalizedProjection.apply(flat, weight, 1e-5, chunk)
        grad = torch.randn(out.shape, generator=gen)
        with LiveBytes() as live:
            out.backward(grad)
        planned = mhc_map_backward_bytes(recipe)
        assert 0.93 * planned < live.peak <= planned, (chunk, live.peak, planned)
        peaks[chunk] = live.peak
    assert peaks[32] < 0.3 * peaks[256], peaks


def test_normalized_projection_keeps_no_fp32_upcast():
    """What autograd holds for backward: the bf16 input and the weight, nothing of [N*D] in
    fp32 (the plain graph keeps the upcast and its normalised copy, 4x the input's bytes)."""
    flat = torch.randn(64, STREAMS * HIDDEN).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(24, STREAMS * HIDDEN, requires_grad=True)

    def kept_bytes(project) -> int:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            project(flat, weight, 1e-5)
        storages.pop(weight.untyped_storage().data_ptr())
        return sum(storages.values())

    assert kept_bytes(_chunked(16)) == flat.numel() * 2
    assert kept_bytes(normalized_projection) >= flat.numel() * 8  # the control: today's graph
