"""GLM DSA layer on megatron-core: equal to transformers' Glm5NextTextAttention at TP1/CP1, packed
documents independent, and every TP/SP/CP mesh equal to the TP1/CP1 layer (CPU, fp32).

The mesh cases only move rows and heads, so outputs and gradients may differ from the TP1/CP1
layer by fp32 summation order (~1e-7; tolerance 1e-5) and the top-k must be identical. A layout
bug (wrong CP ordering, rows left out of natural order) gives errors of order 1e-1 (controls).
"""

from dataclasses import dataclass

import pytest
import torch

from tests.support.ranks import run_ranks

S, B, H = 40, 2, 64
CFG = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
           kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, qk_rope_head_dim=0,
           index_n_heads=8, index_head_dim=16, index_topk=8, index_kpool=4, rms_norm_eps=1e-5)
TOL = 1e-5
# Indexer scores are sums over heads of relu'd products: with few heads many are exactly 0 and tie.
# We break ties toward the earlier pool; transformers' torch.topk breaks them arbitrarily. Eight
# heads make an exact-zero tie at the top-k boundary vanishingly rare in the comparison data.


def _reference(kpool):
    import sys

    sys.modules["fla"] = None  # transformers would pick fla's GPU-only kernels otherwise
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    cfg = Glm5NextTextConfig(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             num_hidden_layers=4, **{**CFG, "index_kpool": kpool})
    cfg._attn_implementation = "eager"
    assert cfg.indexer_types[3] == "full"
    torch.manual_seed(0)
    ref = Glm5NextTextAttention(cfg, layer_idx=3).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.1) + (1.0 if p.ndim == 1 else 0.0))
        ref.indexer.index_kpool_compress_ape.normal_()
        ref.indexer.index_kpool_compress_gate.normal_(std=0.3)
    return ref


def _config(kpool, topk=CFG["index_topk"], tp=1, cp=1, sp=False):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=4 * H,
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
        cp_comm_type="allgather", experimental_attention_variant="dsa",
        multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16,
        qk_pos_emb_head_dim=0, v_head_dim=16, rope_type="rope", rotary_scaling_factor=1.0,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, qk_layernorm=True,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False,
        dsa_indexer_n_heads=CFG["index_n_heads"], dsa_indexer_head_dim=16,
        dsa_indexer_topk=topk - topk % kpool, dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True, dsa_indexer_k_norm_epsilon=1e-6,
    )


def _kernel(name, tp_split="heads", kpool=4):
    """The DSA implementation with small block sizes that divide none of the test's query and
    pool counts, so every block loop takes several steps and ends on a partial block."""
    from skyrl_megatron_kda.config import DSAConfig

    block = {"torch": {"attention_block": 7, "indexer_pool_block": 3},
             "fused": {"query_block": 5}, "latent": {"query_block": 5}}
    return DSAConfig(kernel=name, tp_split=tp_split, index_kpool=kpool, indexer_query_block=9,
                     **({name: block[name]} if name in block else {}))


def _ours(config, kpool, pg=None, cp_layout="zigzag", kernel="torch", tp_split="heads",
          stand_in=None):
    """Our layer; ``fused`` and ``latent`` run the CPU stand-in of megatron's TileLang kernels
    and of ours (the layer's padding, absorption and TP layout are what is tested; the real
    kernels on a GPU); ``stand_in``: another stand-in for ``fused``."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from skyrl_megatron_kda.dsa import layer as dsa
    from skyrl_megatron_kda.dsa.kernels import FusedKernel, LatentKernel
    from tests.support.sparse_mla_ops import torch_sparse_mla_ops

    if not torch.cuda.is_available():
        FusedKernel.load_kernels = staticmethod(lambda **_: stand_in or torch_sparse_mla_ops())
        rank = config.kv_lora_rank
        LatentKernel.load_kernels = staticmethod(lambda **_: torch_sparse_mla_ops(rank, rank))
    pg = pg or ProcessGroupCollection.use_mpu_process_groups()
    return build_module(dsa.glm_dsa_layer_spec(cp_layout, _kernel(kernel, tp_split, kpool)),
                        config=config, layer_number=4, pg_collection=pg)


def _copy(ref, ours):
    ix, rx = ours.core_attention.indexer, ref.indexer
    pairs = [(ref.q_a_proj.weight, ours.linear_q_down_proj.weight),
             (ref.q_a_layernorm.weight, ours.q_layernorm.weight),
             (ref.q_b_proj.weight, ours.linear_q_up_proj.weight),
             (ref.kv_a_proj_with_mqa.weight, ours.linear_kv_down_proj.weight),
             (ref.kv_a_layernorm.weight, ours.kv_layernorm.weight),
             (ref.kv_b_proj.weight, ours.linear_kv_up_proj.weight),
             (ref.o_proj.weight, ours.linear_proj.weight),
             (rx.wq_b.weight, ix.linear_wq_b.weight), (rx.wk.weight, ix.linear_wk.weight),
             (rx.k_norm.weight, ix.k_norm.weight), (rx.k_norm.bias, ix.k_norm.bias),
             (rx.weights_proj.weight, ix.linear_weights_proj.weight),
             (rx.index_kpool_compress_ape, ix.kpool_compress_ape),
             (rx.index_kpool_compress_gate, ix.kpool_compress_gate)]
    with torch.no_grad():
        for src, dst in pairs:
            assert src.shape == dst.shape, (src.shape, dst.shape)
            dst.copy_(src)


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def _record_topk(layer):
    """Capture the indexer's output (natural key positions) on every forward."""
    seen = []
    layer.core_attention.indexer.register_forward_hook(lambda m, args, out: seen.append(out))
    return seen


def _compare(rank, world, kpool, kernel):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    ref = _reference(kpool)
    ours = _ours(_config(kpool), kpool, kernel=kernel)
    _copy(ref, ours)
    dense = _ours(_config(kpool, topk=S + kpool), kpool, kernel=kernel)  # every pool selected
    _copy(ref, dense)
    topk = _record_topk(ours)

    torch.manual_seed(1)
    x = torch.randn(B, S, H, requires_grad=True)
    out_ref, _, _ = ref(x, attention_mask=torch.ones(B, S, dtype=torch.bool))
    out_ref.backward(torch.ones_like(out_ref) / out_ref.numel() ** 0.5)

    xm = x.detach().transpose(0, 1).clone().requires_grad_(True)  # megatron is [s, b, h]
    out, bias = ours(xm, attention_mask=None)
    assert bias is None
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    out_dense, _ = dense(x.detach().transpose(0, 1), attention_mask=None)

    # Index parity: same selected token sets per query as the reference indexer.
    q_resid = ref.q_a_layernorm(ref.q_a_proj(x.detach()))
    ref_idx = ref.indexer(x.detach(), q_resid, torch.ones(B, S, dtype=torch.bool), None)
    (our_idx,) = topk
    sets_equal = all(
        set(ref_idx[b, s].tolist()) - {-1} == set(our_idx[b, s].tolist()) - {-1}
        for b in range(B) for s in range(S))
    kept = float((our_idx >= 0).sum(-1).float().mean())
    return dict(
        out=_rel(out.transpose(0, 1), out_ref), grad=_rel(xm.grad.transpose(0, 1), x.grad),
        dense=_rel(out_dense.transpose(0, 1), out_ref), sets_equal=sets_equal, kept=kept)


@pytest.mark.parametrize("kernel", ["torch", "fused", "latent", "unfused"])
@pytest.mark.parametrize("kpool", [4, 1])
def test_dsa_matches_transformers(kpool, kernel):
    (r,) = run_ranks(1, _compare, kpool, kernel)
    print(kpool, kernel, r)
    assert r["sets_equal"]
    assert r["kept"] < S / 2, f"top-k should drop keys: {r['kept']} kept of up to {S}"
    assert r["out"] < TOL, r
    assert r["grad"] < TOL, r
    assert r["dense"] > 1e-3, r  # negative control: all causal keys instead of the top-k


# ---------------------------------------------------------------------------------------------
# Packed THD: documents do not see each other; pools and the tail restart at each document.

DOC_LENGTHS = (22, 3, 17, 8)  # not multiples of kpool: partial pools at every document end


def _packed_vs_documents(rank, world, kernel):
    from megatron.core import parallel_state

    from skyrl_megatron_kda.kda.parity import make_batch, relative_error

    parallel_state.initialize_model_parallel()
    layer = _ours(_config(4), 4, kernel=kernel)
    _randomize(layer, seed=3)
    batch = make_batch(H, lengths=DOC_LENGTHS)
    x = batch.x.clone().requires_grad_()
    out, _ = layer(x, attention_mask=None, packed_seq_params=batch.packed)
    (out * batch.grad_out).sum().backward()
    outs, dxs = [], []
    for lo, hi in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
        xd = batch.x[lo:hi].clone().requires_grad_()
        od, _ = layer(xd, attention_mask=None)
        (od * batch.grad_out[lo:hi]).sum().backward()
        outs.append(od.detach())
        dxs.append(xd.grad)
    # Control: the same rows as one sequence (documents attending across boundaries).
    joined, _ = layer(batch.x, attention_mask=None)
    return dict(out=relative_error(out.detach(), torch.cat(outs)),
                dx=relative_error(x.grad, torch.cat(dxs)),
                joined=relative_error(joined.detach(), torch.cat(outs)))


@pytest.mark.parametrize("kernel", ["torch", "fused", "unfused"])
def test_packed_documents_are_independent(kernel):
    (r,) = run_ranks(1, _packed_vs_documents, kernel)
    print(r)
    assert r["out"] < TOL and r["dx"] < TOL, r
    assert r["joined"] > 1e-2, r  # packing must not be the same as one long sequence


class _Prepared(tuple):
    """Pool keys wrapped by a stand-in's ``index_keys``: slicing takes a range of pools."""

    def __getitem__(self, pools):
        return _Prepared((tuple.__getitem__(self, 0)[pools],))


def _keys_prepared_once(rank, world):
    """The fused layer with a stand-in whose score kernel takes only keys its ``index_keys``
    prepared: how often the layer prepares them per forward, and its output against the plain
    stand-in's (the same scores)."""
    from dataclasses import replace

    from megatron.core import parallel_state

    from tests.support.sparse_mla_ops import torch_sparse_mla_ops

    parallel_state.initialize_model_parallel()
    plain, prepared = torch_sparse_mla_ops(), []

    def index_keys(keys):
        prepared.append(keys.shape[0])
        return _Prepared((keys,))

    def index_scores(q, keys, *rest):
        assert isinstance(keys, _Prepared), type(keys)  # never the raw keys
        return plain.index_scores(q, tuple.__getitem__(keys, 0), *rest)

    outs = []
    for stand_in in (plain, replace(plain, index_keys=index_keys, index_scores=index_scores)):
        layer = _ours(_config(4), 4, kernel="fused", stand_in=stand_in)
        _randomize(layer, seed=5)
        torch.manual_seed(2)
        outs.append(layer(torch.randn(S, B, H), attention_mask=None)[0].detach())
    return dict(prepared=prepared, same=torch.equal(*outs))


def test_the_fused_layer_prepares_the_pool_keys_once_per_pass():
    """``SparseMLAOps.index_keys`` (FP8: the keys quantised) runs once per batch row and pass,
    not once per indexer block (``indexer_query_block`` 9 gives several blocks here), and the
    score kernel gets its result."""
    (r,) = run_ranks(1, _keys_prepared_once)
    assert r["prepared"] == [S // 4] * B and r["same"], r


# ---------------------------------------------------------------------------------------------
# TP / SP / CP meshes against the TP1/CP1 layer with the same weights (one 4-rank spawn).

SBHD_TOKENS = 48  # per batch row; zigzag CP2 x SP2 needs a multiple of 2*cp*tp = 8
THD_LENGTHS = (24, 8, 12, 4)  # uneven, each a multiple of 2*cp (zigzag)
THD_CONTIGUOUS = (22, 3, 15, 8)  # any lengths: contiguous cuts documents anywhere
WORLD = 4


@dataclass(frozen=True)
class Case:
    tp: int
    cp: int
    fmt: str  # "sbhd" or "thd"
    layout: str = "zigzag"
    corrupt: str | None = None  # "wrong_layout": shards in contiguous order; "no_reorder"
    kernel: str = "unfused"  # the mesh layer's; the TP1/CP1 reference always runs "unfused"
    tp_split: str = "heads"  # model.dsa.tp_split: "sequence" = all heads on this rank's SP rows

    @property
    def sp(self) -> bool:
        return self.tp > 1

    @property
    def id(self) -> str:
        sp = "+sp" if self.sp else ""
        bad = f"-{self.corrupt}" if self.corrupt else ""
        split = "-by-rows" if self.tp_split == "sequence" else ""
        return f"{self.kernel}{split}-tp{self.tp}{sp}-cp{self.cp}-{self.fmt}-{self.layout}{bad}"


CASES = [
    Case(2, 1, "sbhd"),  # TP + SP only
    Case(2, 1, "thd"),
    Case(1, 2, "sbhd"),  # CP only
    Case(1, 2, "thd"),
    Case(1, 2, "thd", "contiguous"),
    Case(2, 2, "sbhd"),  # TP2 x CP2 + SP: the production mesh
    Case(2, 2, "thd"),
    Case(2, 2, "thd", "contiguous"),
    # The torch kernel against the unfused TP1/CP1 layer. THD zigzag cuts every document over
    # both CP ranks; THD contiguous has a 3-token document (shorter than a pool) and documents
    # cut at the CP split.
    Case(1, 1, "sbhd", kernel="torch"),
    Case(1, 1, "thd", "contiguous", kernel="torch"),
    Case(2, 1, "sbhd", kernel="torch"),
    Case(1, 2, "thd", kernel="torch"),
    Case(2, 2, "sbhd", kernel="torch"),
    Case(2, 2, "thd", kernel="torch"),
    Case(2, 2, "thd", "contiguous", kernel="torch"),
    # Sequence-split TP (``forward_by_rows``: every projection with its whole weight, every
    # head on a balanced share of the CP rank's rows, indices for those rows only).
    Case(2, 1, "sbhd", kernel="torch", tp_split="sequence"),
    Case(2, 2, "sbhd", kernel="torch", tp_split="sequence"),
    Case(2, 2, "thd", kernel="torch", tp_split="sequence"),
    # The fused path (CPU stand-in of the TileLang kernels) in both TP splits.
    Case(1, 1, "sbhd", kernel="fused"),
    Case(2, 2, "thd", kernel="fused"),
    Case(2, 2, "thd", "contiguous", kernel="fused", tp_split="sequence"),
    Case(2, 2, "thd", "contiguous", kernel="latent", tp_split="sequence"),
]
CONTROLS = [
    Case(1, 2, "thd", corrupt="wrong_layout"),  # data in contiguous order, layer told zigzag
    Case(2, 2, "sbhd", corrupt="no_reorder"),  # gathered rows left in rank order
    Case(2, 2, "thd", corrupt="no_reorder", kernel="torch"),
    # Sequence split whose indexer takes the first TP rank's rows on every TP rank.
    Case(2, 2, "sbhd", corrupt="first_rows", kernel="torch", tp_split="sequence"),
    # Sequence split whose output stays in the share's rows instead of going back to the SP rows.
    Case(2, 2, "sbhd", corrupt="share_not_returned", kernel="torch", tp_split="sequence"),
]


def _randomize(layer, seed):
    """Weights with no symmetry (norm weights away from 1, a non-trivial pool gate)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.3 if p.ndim > 1 else 1.0 + 0.1 * noise)
        layer.core_attention.indexer.kpool_compress_ape.normal_(generator=gen)


def _batch(case):
    from skyrl_megatron_kda.kda.parity import make_batch

    if case.fmt == "sbhd":
        return make_batch(H, tokens=SBHD_TOKENS, batch=B)
    return make_batch(H, lengths=THD_CONTIGUOUS if case.layout == "contiguous" else THD_LENGTHS)


def _finalize_grads(layer, config, tp_group, cp_group):
    """What megatron's DDP does after backward: sum the SP/qk-norm grads over TP (its own
    function), then the DP x CP all-reduce (CP part); TP-sharded grads gathered for comparison."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    from skyrl_megatron_kda.distributed.tensor_parallel import gather_full_grads

    layer.ddp_config = DistributedDataParallelConfig()
    _allreduce_non_tensor_model_parallel_grads([layer], config, tp_group)
    with_grad = {n for n, p in layer.named_parameters() if p.grad is not None}
    grads = {n: g for n, g in gather_full_grads(layer, tp_group).items() if n in with_grad}
    for g in grads.values():
        dist.all_reduce(g, group=cp_group)
    return grads


def _run_case(case, single):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from skyrl_megatron_kda.distributed.cp_layout import rank_rows
    from skyrl_megatron_kda.kda.parity import relative_error
    from skyrl_megatron_kda.distributed.tensor_parallel import load_full_state
    from skyrl_megatron_kda.dsa import batch_rows as dsa

    batch = _batch(case)
    ref = _ours(_config(4), 4, ProcessGroupCollection(tp=single, cp=single), kernel="unfused")
    _randomize(ref, seed=7)
    full_state = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_topk = _record_topk(ref)
    x_ref = batch.x.clone().requires_grad_()
    out_ref, _ = ref(x_ref, attention_mask=None, packed_seq_params=batch.packed)
    (out_ref * batch.grad_out).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=case.tp,
                                             context_parallel_size=case.cp)
    tp_group, cp_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
    config = _config(4, tp=case.tp, cp=case.cp, sp=case.sp)
    layer = _ours(config, 4, ProcessGroupCollection.use_mpu_process_groups(), case.layout,
                  case.kernel, case.tp_split)
    load_full_state(layer, full_state, tp_group.rank(), case.tp)
    topk = _record_topk(layer)
    data_layout = "contiguous" if case.corrupt == "wrong_layout" else case.layout
    rows = rank_rows(batch.cu_seqlens, case.cp, case.tp, cp_group.rank(), tp_group.rank(),
                     case.sp, data_layout)
    saved_sort, saved_own = dsa.sort_index, dsa.DSABatchRows.attention_rows
    saved_back = dsa.DSABatchRows.from_share
    if case.corrupt == "no_reorder":
        dsa.sort_index = lambda p: torch.arange(p.numel(), device=p.device)
    if case.corrupt == "first_rows":
        dsa.DSABatchRows.attention_rows = lambda self, t: t[:t.shape[0] // self.tp_group.size()]
    if case.corrupt == "share_not_returned":
        dsa.DSABatchRows.from_share = lambda self, t: t
    try:
        x = batch.x[rows].clone().requires_grad_()
        out, _ = layer(x, attention_mask=None, packed_seq_params=batch.packed)
        (out * batch.grad_out[rows]).sum().backward()
    finally:
        dsa.sort_index, dsa.DSABatchRows.attention_rows = saved_sort, saved_own
        dsa.DSABatchRows.from_share = saved_back

    errors = {"out": relative_error(out.detach(), out_ref.detach()[rows]),
              "dx": relative_error(x.grad, x_ref.grad[rows])}
    grads = _finalize_grads(layer, config, tp_group, cp_group)
    assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
    errors.update({f"grad.{n}": relative_error(g, ref_grads[n]) for n, g in grads.items()})
    # The rows the indexer ran for: this CP rank's (the TP-gathered SP shards, i.e. the rows
    # without the SP split), or with the sequence split this rank's balanced share of them.
    q_rows = rank_rows(batch.cu_seqlens, case.cp, case.tp, cp_group.rank(), tp_group.rank(),
                       False, case.layout)
    if case.tp_split == "sequence" and case.sp:
        shares = dsa.balanced_row_order(q_rows.numel(), case.tp).view(case.tp, -1)
        q_rows = q_rows[shares[tp_group.rank()]]
    (ours,), (theirs,) = topk, ref_topk
    return dict(errors=errors, topk_equal=torch.equal(ours.long(), theirs[:, q_rows]),
                kept=float((ours >= 0).sum(-1).float().mean()), grads=sorted(grads),
                frozen=not any(p.requires_grad for p in layer.core_attention.indexer.parameters()))


def _mesh_matrix(rank, world, cases):
    import torch.distributed as dist

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    singles = [dist.new_group([r]) for r in range(world)]
    results = {}
    for case in cases:
        results[case.id] = _run_case(case, singles[rank])
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def mesh_results():
    return run_ranks(WORLD, _mesh_matrix, CASES + CONTROLS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_mesh_equals_single_rank(mesh_results, case):
    for rank, res in enumerate(mesh_results):
        r = res[case.id]
        worst = max(r["errors"], key=r["errors"].get)
        print(case.id, rank, worst, r["errors"][worst], r["kept"])
        assert r["topk_equal"], f"rank {rank}: top-k differs from the TP1/CP1 layer"
        assert r["errors"][worst] < TOL, f"rank {rank}: {worst} = {r['errors'][worst]:.2e}"
        assert r["kept"] < 16, r  # the top-k drops keys (the tail adds up to 3 to the 8)
        # The attention path gets gradients; the indexer (no grad, as in transformers) does not.
        assert "linear_kv_up_proj.weight" in r["grads"]
        assert not any("indexer" in n for n in r["grads"]) and r["frozen"]


@pytest.mark.parametrize("case", CONTROLS, ids=lambda c: c.id)
def test_layout_bugs_are_caught(mesh_results, case):
    errs = [res[case.id]["errors"]["out"] for res in mesh_results]
    print(case.id, errs)
    assert max(errs) > 1e-2, errs


def _refusals(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    msgs = []
    for build in (lambda: _ours(_config(4, tp=2, sp=False), 4),
                  lambda: _ours(_config(4), 4, cp_layout="diagonal")):
        try:
            build()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_settings_are_refused():
    msgs = run_ranks(2, _refusals)[0]
    assert "needs sequence_parallel" in msgs[0], msgs
    assert "unknown CP layout" in msgs[1], msgs
