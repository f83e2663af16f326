"""GLMModel (megatron-core) loaded from a glm5_next safetensors checkpoint equals transformers'
Glm5NextForConditionalGeneration: logits and per-token loss, fp32, on CPU gloo ranks.

One spawned rank writes the random checkpoint (``save_pretrained``), computes the reference and
checks TP1/CP1; a 4-rank spawn checks TP2 x CP2 (+SP, EP2) for each KDA CP exchange. fla is
hidden in the ranks so transformers uses its torch fallbacks. Tolerance 1e-4 relative (max-abs
over max-abs); a mis-sharded or transposed weight gives errors of order 1e-1 (controls below).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.ranks import run_ranks
from tests.support.tiny_models import token_loss

T, B = 32, 2  # tokens per sequence (divides by 2*cp*tp for the zigzag + SP split), batch
DOCS = (12, 8, 12)  # packed THD row of T tokens: each document divides by 2*cp (zigzag)
TOL = 1e-4
# 8 indexer heads: with few heads many relu'd indexer scores are exactly 0 and tie at the top-k
# boundary, where dsa/layer.py and transformers may break ties differently.

TINY_MODEL = dict(
    hidden_size=32, params_dtype="float32", num_layers=4, vocab_size=64, dsa_every=4, dsa_offset=3,
    num_dense_layers=1, dense_ffn_hidden_size=48,
    moe=dict(num_experts=4, top_k=2, ffn_hidden_size=16, num_shared_experts=1),
    dsa=dict(num_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0,
             v_head_dim=8, index_num_heads=8, index_head_dim=8, index_topk=8, index_kpool=4,
             kernel="torch"),  # what auto resolves to on a CPU (the model takes it resolved)
)
TINY_KDA = dict(num_heads=4, head_dim=8, gate_low_rank=8, output_gate_low_rank=8, kernel="torch")


def tiny_recipe(tp=1, cp=1, ep=1, etp=1, sp=False, exchange="a2a", shared_experts=1, workers=None):
    from skyrl_megatron_kda.config import Recipe

    model = {**TINY_MODEL, "moe": {**TINY_MODEL["moe"], "num_shared_experts": shared_experts}}
    return Recipe.model_validate(dict(
        model=model, kda={**TINY_KDA, "cp_exchange": exchange},
        parallel=dict(tp=tp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp),
        data=dict(seq_len=T), run=dict(num_workers=workers or tp * cp)))


def _hide_fla():
    import sys

    sys.modules["fla"] = None  # transformers would pick fla's GPU-only kernels otherwise


def _randomize(model) -> None:
    """Every tensor random and away from its init value, so that each mapping matters."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5)
            elif p.ndim == 1 and ("norm" in name or name.endswith("scale")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def _batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (B, T), generator=gen)
    targets = torch.randint(0, TINY_MODEL["vocab_size"], (B, T), generator=gen)
    return ids, targets


def _packed():
    """One packed row of ``DOCS`` documents: ids, targets [1, T] and the global cu_seqlens."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (1, T), generator=gen)
    targets = torch.randint(0, TINY_MODEL["vocab_size"], (1, T), generator=gen)
    cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, targets, cu


def _make_checkpoint(path: str, recipe=None) -> dict:
    """Random glm5_next (text + a tiny vision tower) of ``recipe`` (default ``tiny_recipe()``)
    saved to ``path``; reference outputs."""
    _hide_fla()
    import torch.nn.functional as F
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from skyrl_megatron_kda.model.hf_io import hf_text_config

    text = dict(hf_text_config(recipe or tiny_recipe()), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                  projection_intermediate_size=16, patch_size=2, temporal_patch_size=1)
    torch.manual_seed(0)
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision)).float()
    hf.config.text_config._attn_implementation = "eager"
    _randomize(hf)
    hf.save_pretrained(path)
    ids, targets = _batch()
    with torch.no_grad():
        out = hf(input_ids=ids, labels=targets)  # HF shifts: logits[t] predicts targets[t+1]
    logits = out.logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.roll(-1, 1).reshape(-1),
                           reduction="none").view(B, T)
    # Packed documents: the reference runs each document on its own.
    ids, targets, cu = _packed()
    with torch.no_grad():
        docs = [hf(input_ids=ids[:, lo:hi]).logits.float() for lo, hi in zip(cu[:-1], cu[1:])]
    packed = torch.cat(docs, dim=1)
    packed_loss = F.cross_entropy(packed[0], targets[0], reduction="none")[None]
    return dict(logits=logits, loss=loss, hf_loss=float(out.loss), packed_logits=packed,
                packed_loss=packed_loss)


def _rel(a, b) -> float:
    from skyrl_megatron_kda.kda.parity import relative_error

    return relative_error(a.detach(), b.detach())


def _run_ours(recipe, path, ref, tp_rank, cp_rank, *, backward=False):
    """Our model on this rank: errors of logits and loss against the reference at this rank's
    rows (CP zigzag) and vocab slice (TP)."""
    from skyrl_megatron_kda.distributed.cp_layout import rank_rows
    from skyrl_megatron_kda.model.glm import build_model
    from skyrl_megatron_kda.model.hf_io import load_hf_checkpoint

    torch.manual_seed(0)
    model = build_model(recipe, use_cpu=True)
    load_hf_checkpoint(model, path)
    p = recipe.parallel
    rows = rank_rows(torch.tensor([0, T]), p.cp, p.tp, cp_rank, tp_rank, False, recipe.parallel.cp_layout)
    ids, targets = _batch()
    vocab = recipe.model.vocab_size // p.tp
    cols = slice(tp_rank * vocab, (tp_rank + 1) * vocab)
    logits = model(ids[:, rows])
    model.reset_cp_bytes()
    loss = token_loss(model, ids[:, rows], targets.roll(-1, 1)[:, rows])
    out = dict(logits=_rel(logits, ref["logits"][:, rows][..., cols]),
               loss=_rel(loss, ref["loss"][:, rows]), cp_bytes=model.cp_bytes(),
               logits_shape=tuple(logits.shape), loss_dtype=loss.dtype,
               exchange=model.recipe.kda.cp_exchange)
    out.update(_run_packed(model, recipe, ref, tp_rank, cp_rank, cols))
    if backward:
        loss.sum().backward()
        out["grads_finite"] = all(bool(q.grad.isfinite().all()) for q in model.parameters()
                                  if q.grad is not None)
    return model, out


def _run_packed(model, recipe, ref, tp_rank, cp_rank, cols):
    """The packed THD row through ``model`` (b = 1, global cu_seqlens), vs per-document HF."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from skyrl_megatron_kda.distributed.cp_layout import rank_rows

    ids, targets, cu = _packed()
    p = recipe.parallel
    rows = rank_rows(cu, p.cp, p.tp, cp_rank, tp_rank, False, recipe.parallel.cp_layout)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(DOCS), max_seqlen_kv=max(DOCS))
    with torch.no_grad():
        logits = model(ids[:, rows], packed_seq_params=params)
        loss = token_loss(model, ids[:, rows], targets[:, rows], packed_seq_params=params)
    return dict(packed_logits=_rel(logits, ref["packed_logits"][:, rows][..., cols]),
                packed_loss=_rel(loss, ref["packed_loss"][:, rows]))


# --- TP1 / CP1 --------------------------------------------------------------------------------


def _single(rank, world, path, export_path):
    from megatron.core import parallel_state

    from skyrl_megatron_kda.model import hf_io

    ref = _make_checkpoint(path)
    torch.save(ref, os.path.join(path, "reference.pt"))  # for the mesh ranks
    parallel_state.initialize_model_parallel()
    recipe = tiny_recipe()
    model, res = _run_ours(recipe, path, ref, 0, 0)
    ids, targets = _batch()
    loss = token_loss(model, ids, targets.roll(-1, 1))
    res["mean_loss_vs_hf_loss"] = abs(float(loss[:, :-1].mean()) - ref["hf_loss"]) / ref["hf_loss"]
    hf_io.save_hf_checkpoint(model, export_path, source=path)
    res["recompute"] = _recompute_gap(recipe, path, model, ids, targets.roll(-1, 1))
    res["fused_loss"] = _fused_loss_gap(recipe, path, model, ids, targets.roll(-1, 1))

    # Negative control: one transposed (square) weight in the checkpoint is caught by parity.
    square = "model.language_model.layers.1.self_attn.q_proj.weight"
    get = hf_io.SafetensorsCheckpoint.get
    hf_io.SafetensorsCheckpoint.get = lambda self, n: get(self, n).t() if n == square else get(self, n)
    try:
        _, bad = _run_ours(recipe, path, ref, 0, 0)
    finally:
        hf_io.SafetensorsCheckpoint.get = get
    res["control_transposed"] = bad["logits"]
    # Negative control: the recipe has one more routed expert than the checkpoint.
    wrong = recipe.model_copy(update={"model": recipe.model.model_copy(update={
        "moe": recipe.model.moe.model_copy(update={"num_experts": 8})})})
    try:
        hf_io.check_hf_keys(wrong, hf_io.SafetensorsCheckpoint(path).keys())
        res["missing_error"] = ""
    except KeyError as err:
        res["missing_error"] = str(err)
    try:
        hf_io.check_hf_config(wrong, path)
        res["config_error"] = ""
    except ValueError as err:
        res["config_error"] = str(err)
    return res


def _without_shared_experts(rank, world, path):
    from megatron.core import parallel_state

    from safetensors.torch import load_file

    recipe = tiny_recipe(shared_experts=0)
    ref = _make_checkpoint(path, recipe)
    saved = load_file(os.path.join(path, "model.safetensors"))
    empty = sorted(n for n, t in saved.items() if "shared_experts" in n and t.numel() == 0)
    parallel_state.initialize_model_parallel()
    _, res = _run_ours(recipe, path, ref, 0, 0)
    parallel_state.destroy_model_parallel()
    return dict(res, empty_in_checkpoint=empty)


def test_checkpoint_without_shared_experts_loads(tmp_path):
    """transformers saves n_shared_experts=0 as zero-element shared-expert tensors (an MLP of
    width 0); they load as nothing, and the model equals transformers'."""
    (res,) = run_ranks(1, _without_shared_experts, str(tmp_path / "hf"))
    assert len(res["empty_in_checkpoint"]) == 9, res["empty_in_checkpoint"]  # 3 MoE layers x 3
    assert res["logits"] < TOL and res["loss"] < TOL, res


# settings that change what is kept for backward or when it is computed, not what is computed:
# recipe section -> its fields
MEMORY_VARIANTS = {
    "full": {"train": {"recompute": "full"}},
    "selective": {"train": {"recompute": "selective"}},
    "full_dsa_only": {"train": {"recompute": "full", "recompute_layers": ["dsa"]}},
    # the recompute selects again instead of attending with the forward's kept selection
    "full_reselecting": {"train": {"recompute": "full", "keep_dsa_selection": False}},
    "selective_kda_offload": {"train": {"recompute": "selective", "recompute_layers": ["kda"],
                                        "offload_activations": True}},
    "offload": {"train": {"offload_activations": True}},
    "full_offload": {"train": {"recompute": "full", "offload_activations": True}},
    # 4 heads in calls of 3 and 1
    "kda_head_groups": {"kda": {"kernel_head_group": 3}},
    # the mHC maps' projection over chunks of 7 rows (7 does not divide the rows)
    "mhc_map_chunks": {"model": {"hyper_connections": {"map_chunk_rows": 7}}},
}


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    loss = token_loss(model, ids, labels)
    loss.mean().backward()
    return loss.detach(), {n: q.grad for n, q in model.named_parameters()}


def _recompute_gap(recipe, path, model, ids, labels) -> dict[str, float]:
    """Each recompute / offload setting gives the same loss and gradients as keeping all."""
    from skyrl_megatron_kda.model.glm import build_model
    from skyrl_megatron_kda.model.hf_io import load_hf_checkpoint

    from skyrl_megatron_kda.config.dotpath import merge

    l0, g0 = _loss_and_grads(model, ids, labels)
    gaps = {}
    for name, update in MEMORY_VARIANTS.items():
        other = build_model(type(recipe).model_validate(merge(recipe.model_dump(), update)), use_cpu=True)
        load_hf_checkpoint(other, path)
        l1, g1 = _loss_and_grads(other, ids, labels)
        gaps[name] = max([_rel(l1, l0)] + [_rel(g1[n], g0[n]) for n in g0 if g0[n] is not None])
    return gaps


HEAD = ("embedding.weight", "output_layer.weight", "final_norm.weight")


def _fused_loss_gap(recipe, path, model, ids, labels) -> dict[str, float]:
    """``train.loss_chunk_tokens=7`` (7 does not divide the B x T = 64 rows) against megatron's
    loss: the loss, the head's gradients and the trunk's."""
    from skyrl_megatron_kda.model.glm import build_model
    from skyrl_megatron_kda.model.hf_io import load_hf_checkpoint

    l0, g0 = _loss_and_grads(model, ids, labels)
    fused = build_model(recipe.model_copy(update={"train": recipe.train.model_copy(
        update={"loss_chunk_tokens": 7})}), use_cpu=True)
    load_hf_checkpoint(fused, path)
    l1, g1 = _loss_and_grads(fused, ids, labels)
    gaps = {n: _rel(g1[n], g0[n]) for n in g0 if g0[n] is not None}
    return {"loss": _rel(l1, l0), "head": max(gaps[n] for n in HEAD),
            "trunk": max(v for n, v in gaps.items() if n not in HEAD)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("glm")
    path, export = str(base / "hf"), str(base / "export")
    (res,) = run_ranks(1, _single, path, export)
    return dict(path=path, export=export, res=res)


def test_tp1_matches_transformers(checkpoint):
    res = checkpoint["res"]
    print({k: v for k, v in res.items() if not isinstance(v, (str, dict))}, res["recompute"])
    assert res["logits_shape"] == (B, T, TINY_MODEL["vocab_size"])
    assert res["loss_dtype"] == torch.float32
    assert res["logits"] < TOL and res["loss"] < TOL, res
    assert res["packed_logits"] < TOL and res["packed_loss"] < TOL, res
    assert res["mean_loss_vs_hf_loss"] < TOL, "our per-token loss averages to transformers' loss"
    assert res["cp_bytes"] == 0
    assert res["recompute"].keys() == MEMORY_VARIANTS.keys()
    # Head groups run the same math, but the CPU torch kernel's batched matmuls round a head
    # differently by batch size (1e-7 relative at the kernel, tests/test_kernel.py), which 4
    # layers grow to a few 1e-6 in the smallest gradients; a wrong head slice is 1e-1. The mHC
    # map chunks likewise (their GEMMs on fewer rows round differently, 1e-7 at the projection,
    # tests/test_hyper_connections.py): the loss is equal, KDA's dt_bias gradient (a sum of
    # cancelling terms) moves by 3e-6.
    tolerance = {"kda_head_groups": 1e-5, "mhc_map_chunks": 1e-5}
    bad = {name: gap for name, gap in res["recompute"].items() if not gap < tolerance.get(name, 1e-6)}
    assert not bad, f"recompute / offload changed the loss or gradients: {bad}"


def test_fused_loss_matches_the_unfused_loss(checkpoint):
    """The loss and the head's gradients (output layer, final norm, embedding) within 1e-6. The
    chunk's matmuls round differently from the whole one (CPU GEMM blocking: ~1e-7 in the
    hidden-state gradient), and the trunk's smallest gradients (mHC scales, sums of cancelling
    terms) amplify that: 1e-4 there, where a wrong loss gradient is of order 1."""
    gap = checkpoint["res"]["fused_loss"]
    print(gap)
    assert gap["loss"] < 1e-6 and gap["head"] < 1e-6, gap
    assert gap["trunk"] < 1e-4, gap


def test_negative_controls_are_caught(checkpoint):
    res = checkpoint["res"]
    assert res["control_transposed"] > 1e-2, f"a transposed q_proj went unnoticed: {res}"
    assert "missing 36 tensors" in res["missing_error"], res  # 4 more experts x 3 tensors x 3 layers
    assert "layers.1.mlp.experts.7.down_proj.weight" in res["missing_error"]
    assert "n_routed_experts: checkpoint 4, recipe 8" in res["config_error"]


def _same_tensors(a_dir: str, b_dir: str) -> list[str]:
    from skyrl_megatron_kda.model.hf_io import SafetensorsCheckpoint

    a, b = SafetensorsCheckpoint(a_dir), SafetensorsCheckpoint(b_dir)
    if a.keys() != b.keys():
        return [f"keys differ: only in source {sorted(a.keys() - b.keys())[:10]}, "
                f"only in export {sorted(b.keys() - a.keys())[:10]}"]
    return [k for k in sorted(a.keys())
            if a.get(k).dtype != b.get(k).dtype or not torch.equal(a.get(k), b.get(k))]


def test_export_round_trips_bit_exactly(checkpoint):
    assert os.path.exists(os.path.join(checkpoint["export"], "model.safetensors.index.json"))
    assert _same_tensors(checkpoint["path"], checkpoint["export"]) == []


# --- TP2 x CP2 (+SP) with EP2 -----------------------------------------------------------------

MESH = dict(tp=2, cp=2, ep=2, sp=True)
EXCHANGES = ("a2a", "allgather", "state")


def _mesh(rank, world, path, export_path):
    from megatron.core import parallel_state

    from skyrl_megatron_kda.distributed import tensor_parallel
    from skyrl_megatron_kda.model import hf_io

    _hide_fla()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=MESH["tp"], context_parallel_size=MESH["cp"],
        expert_model_parallel_size=MESH["ep"], expert_tensor_parallel_size=1)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    ref = torch.load(os.path.join(path, "reference.pt"))
    out = {}
    for exchange in EXCHANGES:
        recipe = tiny_recipe(MESH["tp"], MESH["cp"], MESH["ep"], sp=MESH["sp"], exchange=exchange)
        model, out[exchange] = _run_ours(recipe, path, ref, tp_rank, cp_rank, backward=True)
    hf_io.save_hf_checkpoint(model, export_path, source=path)

    # Negative control: GLU fc1 sliced as a plain tensor (not [gate shard; up shard]).
    shard_of = tensor_parallel.shard_of
    hf_io.shard_of = lambda full, p, r, s, glu=False: shard_of(full, p, r, s)
    try:
        _, out["control_glu"] = _run_ours(tiny_recipe(MESH["tp"], MESH["cp"], MESH["ep"], sp=True),
                                          path, ref, tp_rank, cp_rank)
    finally:
        hf_io.shard_of = shard_of
    return out


@pytest.fixture(scope="module")
def mesh(checkpoint, tmp_path_factory):
    path = checkpoint["path"]
    export = str(tmp_path_factory.mktemp("glm_mesh") / "export")
    return dict(res=run_ranks(4, _mesh, path, export), export=export, path=path)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_tp2_cp2_sp_ep2_matches_transformers(mesh, exchange):
    for rank, res in enumerate(mesh["res"]):
        r = res[exchange]
        print(exchange, rank, r)
        assert r["exchange"] == exchange
        assert r["logits_shape"] == (B, T // MESH["cp"], TINY_MODEL["vocab_size"] // MESH["tp"])
        assert r["logits"] < TOL and r["loss"] < TOL, f"rank {rank}: {r}"
        assert r["packed_logits"] < TOL and r["packed_loss"] < TOL, f"rank {rank}: {r}"
        assert r["cp_bytes"] > 0, "the KDA layers' CP ledgers count the exchange"
        assert r["grads_finite"]


def test_mesh_negative_control_is_caught(mesh):
    worst = max(res["control_glu"]["logits"] for res in mesh["res"])
    assert worst > 1e-2, f"plainly sliced SwiGLU fc1 went unnoticed ({worst:.2e})"


def test_mesh_export_round_trips_bit_exactly(mesh):
    assert _same_tensors(mesh["path"], mesh["export"]) == []


# --- initialisation ----------------------------------------------------------------------------

INIT_MESHES = {
    # name: (tp, cp, ep, etp, world); TP > 1 needs SP (MoE and DSA layers)
    "tp1_ep1": (1, 1, 1, 1, 1),  # the reference: one rank holds every full tensor
    "tp2_cp2_ep2": (2, 2, 2, 1, 4),
    "tp2_ep2_etp2_dp2": (2, 1, 2, 2, 4),  # experts split over ETP too, two data-parallel replicas
}


def _initial_weights(rank, world, mesh):
    """The seeded model of ``mesh`` built as a training rank builds it, gathered to full tensors
    under their HF names (every expert, every TP/ETP shard)."""
    from megatron.core import parallel_state

    from skyrl_megatron_kda.model.hf_io import export_hf_tensors
    from skyrl_megatron_kda.model.glm import build_model
    from skyrl_megatron_kda.train.setup import init_parallel_state, seed_everything

    tp, cp, ep, etp, _ = mesh
    recipe = tiny_recipe(tp, cp, ep, etp, sp=tp > 1, workers=world)
    init_parallel_state(recipe)
    seed_everything(recipe.train.seed, use_cpu=True)
    model = build_model(recipe, use_cpu=True)
    full = {name: t.clone() for name, t in export_hf_tensors(model)}
    parallel_state.destroy_model_parallel()
    return full if rank == 0 else None


def test_same_seed_gives_the_same_full_weights_at_every_mesh():
    """A user debugging on one rank starts from exactly the cluster mesh's weights: every full
    tensor is equal bitwise (the routed experts of the EP and ETP ranks included)."""
    ref = run_ranks(1, _initial_weights, INIT_MESHES["tp1_ep1"])[0]
    assert all(t.abs().sum() > 0 for n, t in ref.items() if n.endswith("proj.weight")), \
        "a projection drew all zeros: nothing would be compared"
    for name, mesh in INIT_MESHES.items():
        if name == "tp1_ep1":
            continue
        got = run_ranks(mesh[-1], _initial_weights, mesh)[0]
        assert got.keys() == ref.keys()
        differ = sorted(n for n in ref if not torch.equal(got[n], ref[n]))
        assert not differ, f"{name}: {len(differ)} of {len(ref)} tensors differ from TP1/EP1: {differ[:8]}"
