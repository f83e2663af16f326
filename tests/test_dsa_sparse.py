"""The DSA layer's torch kernel (``model.dsa.kernel=torch``: blocked indexer + absorbed sparse
MLA over the KV latent) at TP1/CP1 on CPU, beyond the parity cases of tests/test_dsa.py (which
compare it with the unfused layer on every mesh and with transformers):

* negative controls: a wrong split of the kv up-projection weight into W_UK / W_UV, and token
  indices shifted by one, give output errors of order 1e-1 against the unfused layer;
* the saved-tensor census: the bytes the layer keeps for backward per query are the same at
  T = 48 and T = 192 for both kernels (what grows with T on the unfused path is its working set:
  whole-sequence keys/values and [queries x pools] scores, not saved tensors), equal memory/dsa.py's
  torch term at the test's sizes, and are over 3x smaller than the unfused path's; growing the top-k
  adds 4 bytes (one int32 index) per selected key and query, where megatron's unfused path adds
  the gathered fp32 key and value of every local head (and more); at TP2 + SP with the sequence
  split each rank keeps what memory/dsa.py says, the projections' gathered weights included;
* the kernel's settings are refused with one-line errors when they are not valid.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.kda_cases import saved_bytes
from tests.support.ranks import run_ranks
from tests.test_dsa import H, _config, _ours, _randomize, _record_topk

TOL = 1e-5


def _run(layer, batch):
    x = batch.x.clone().requires_grad_()
    out, _ = layer(x, attention_mask=None, packed_seq_params=batch.packed)
    (out * batch.grad_out).sum().backward()
    return out.detach(), x.grad


def _controls(rank, world):
    from megatron.core import parallel_state

    from skyrl_megatron_kda.kda.parity import make_batch, relative_error
    from skyrl_megatron_kda.dsa import sparse_mla
    from skyrl_megatron_kda.dsa import pool_topk

    parallel_state.initialize_model_parallel()
    batch = make_batch(H, lengths=(22, 3, 15, 8))
    layers = {}
    for kernel in ("unfused", "torch"):
        layers[kernel] = _ours(_config(4), 4, kernel=kernel)
        _randomize(layers[kernel], seed=7)
    ref_out, ref_dx = _run(layers["unfused"], batch)
    good_out, good_dx = _run(layers["torch"], batch)
    errors = {"good": (relative_error(good_out, ref_out), relative_error(good_dx, ref_dx))}

    split, write = sparse_mla.split_kv_up_weight, pool_topk.write_pool_tokens

    def keys_then_values(weight, heads, dn, dv):  # rows as [all heads' keys; all values]
        w = weight.view(heads * (dn + dv), -1)
        return w[: heads * dn].view(heads, dn, -1), w[heads * dn:].view(heads, dv, -1)

    def shifted(out, *args, **kwargs):  # every selected token one earlier (still causal)
        write(out, *args, **kwargs)
        out.copy_(torch.where(out > 0, out - 1, out))

    for name, module, attr, fake in (("wrong_split", sparse_mla, "split_kv_up_weight", keys_then_values),
                                     ("shifted_index", pool_topk, "write_pool_tokens", shifted)):
        original = getattr(module, attr)
        setattr(module, attr, fake)
        try:
            out, _ = _run(layers["torch"], batch)
        finally:
            setattr(module, attr, original)
        errors[name] = relative_error(out, ref_out)
    assert sparse_mla.split_kv_up_weight is split and pool_topk.write_pool_tokens is write
    return errors


def test_torch_kernel_controls_are_caught():
    (errors,) = run_ranks(1, _controls)
    print(errors)
    assert max(errors["good"]) < TOL, errors
    assert errors["wrong_split"] > 1e-2, errors
    assert errors["shifted_index"] > 1e-2, errors


def _census(rank, world, cases):
    from megatron.core import parallel_state

    from skyrl_megatron_kda.kda.parity import make_batch

    parallel_state.initialize_model_parallel()
    out = {}
    for kernel, tokens, topk in cases:
        layer = _ours(_config(4, topk=topk), 4, kernel=kernel)
        _randomize(layer, seed=7)
        topk_seen = _record_topk(layer)
        x = make_batch(H, tokens=tokens, batch=1).x.clone().requires_grad_()
        _, nbytes = saved_bytes(lambda: layer(x, attention_mask=None),
                                [*layer.parameters(), x])
        out[(kernel, tokens, topk)] = (nbytes / tokens, topk_seen[0].shape[-1])
    return out


def _recipe(kernel: str = "torch", topk: int = 8, tokens: int = 64, tp: int = 1):
    """The tiny recipe at the test layer's sizes (fp32), TP1 or TP2 + SP with the sequence
    split, CP1."""
    from skyrl_megatron_kda.config import DSAConfig
    from skyrl_megatron_kda.recipes import load_recipe

    mesh = [f"parallel.tp={tp}", "parallel.cp=1", "parallel.ep=1", f"run.num_workers={tp}",
            f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}", f"data.seq_len={tokens}"]
    tiny = load_recipe("glm53_flash_tiny", mesh).recipe
    dsa = DSAConfig(num_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                    v_head_dim=16, index_num_heads=8, index_head_dim=16, index_topk=topk,
                    index_kpool=4, kernel=kernel, tp_split="sequence" if tp > 1 else "heads")
    return tiny.model_copy(update={"model": tiny.model.model_copy(
        update={"hidden_size": H, "dsa": dsa})})


def _formula(tokens: int, kernel: str = "torch", topk: int = 8, tp: int = 1) -> int:
    """memory/dsa.py's DSA term of one rank for the test layer."""
    from skyrl_megatron_kda.memory.dsa import dsa_activation_bytes

    return dsa_activation_bytes(_recipe(kernel, topk, tokens, tp))


def _formula_per_query(kernel: str, topk: int) -> int:
    """memory/dsa.py's DSA term per token for the test layer's sizes (fp32, TP1/CP1), without the
    layer input (the census leaves the input tensor out)."""
    return _formula(64, kernel, topk) // 64 - H * 4


def test_kept_bytes_per_query_do_not_grow_with_t():
    kernels = ("torch", "fused", "latent", "unfused")
    cases = [(k, t, topk) for k in kernels for t, topk in ((48, 8), (192, 8), (48, 24))]
    (per_query,) = run_ranks(1, _census, cases)
    print(per_query)
    for kernel in kernels:
        short, long = per_query[(kernel, 48, 8)][0], per_query[(kernel, 192, 8)][0]
        assert short == long, (kernel, short, long)
    # memory/dsa.py's torch, fused and latent terms, to the byte (fused and latent: the CPU
    # stand-ins of the TileLang kernels, which keep nothing themselves; the unfused term is
    # checked on the GLM model in tests/test_memory_terms.py; on this layer megatron keeps one
    # more fp32 [heads, s] tensor).
    for kernel in ("torch", "fused", "latent"):
        for topk in (8, 24):
            assert per_query[(kernel, 48, topk)][0] == _formula_per_query(kernel, topk), topk
    wider = per_query[("torch", 48, 24)][1] - per_query[("torch", 48, 8)][1]
    assert wider == 16
    grow_torch = per_query[("torch", 48, 24)][0] - per_query[("torch", 48, 8)][0]
    grow_unfused = per_query[("unfused", 48, 24)][0] - per_query[("unfused", 48, 8)][0]
    assert grow_torch == wider * 4, grow_torch  # one int32 index per key
    heads, dq, dv = 4, 16, 16
    assert grow_unfused >= wider * heads * 4 * (dq + dv), grow_unfused
    assert per_query[("unfused", 48, 8)][0] > 3 * per_query[("torch", 48, 8)][0]


def _census_by_rows(rank, world, tokens):
    """What one TP2 + SP rank of the sequence split keeps (``forward_by_rows``), less its
    input rows."""
    from megatron.core import parallel_state

    from skyrl_megatron_kda.kda.parity import make_batch

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    layer = _ours(_config(4, tp=2, sp=True), 4, kernel="torch", tp_split="sequence")
    _randomize(layer, seed=7)
    tp = parallel_state.get_tensor_model_parallel_group()
    x = make_batch(H, tokens=tokens, batch=1).x
    own = x.chunk(2)[tp.rank()].clone().requires_grad_()
    _, nbytes = saved_bytes(lambda: layer(own, attention_mask=None), [*layer.parameters(), own])
    return nbytes


def test_the_sequence_split_keeps_what_the_plan_says():
    """TP2 + SP, ``tp_split=sequence``, 48 and 96 tokens: each rank's saved tensors equal
    memory/dsa.py's term to the byte (with the projections' whole weights, gathered over TP),
    and grow by exactly the per-row term with T (the weights are the constant)."""
    from skyrl_megatron_kda.memory.dsa import dsa_projection_weights

    sizes = {}
    for tokens in (48, 96):
        kept = run_ranks(2, _census_by_rows, tokens)
        assert kept[0] == kept[1], kept
        sizes[tokens] = kept[0]
        assert kept[0] == _formula(tokens, tp=2) - tokens // 2 * H * 4, (tokens, kept)
    recipe = _recipe(tp=2)
    per_row = sizes[96] - sizes[48]
    assert sizes[48] - per_row == dsa_projection_weights(recipe) * 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(kernel="triton", indexer_query_block=1, torch=dict(attention_block=1,
                                                             indexer_pool_block=1)), "kernel"),
    (dict(kernel="unfused", tp_split="sequence"), "tp_split=sequence needs"),
    (dict(kernel="torch", fused=dict(query_block=0)), "query_block"),
    (dict(kernel="torch", indexer_query_block=1, torch=dict(attention_block=0,
                                                            indexer_pool_block=1)),
     "attention_block"),
    (dict(kernel="torch", indexer_query_block=1, torch=dict(attention_block=1,
                                                            indexer_pool_block=-3)),
     "indexer_pool_block"),
])
def test_bad_kernel_settings_are_refused(kwargs, message):
    # The config refuses the sizes; the kernel's name and split are the registry's rules.
    from skyrl_megatron_kda.config import DSAConfig
    from skyrl_megatron_kda.recipe_rules import check_dsa

    with pytest.raises(ValueError, match=message):
        check_dsa(DSAConfig(**kwargs))


@pytest.mark.parametrize("override, message", [
    ("model.dsa.kernel=fused", "kernel"),
    ("model.dsa.torch.attention_block=0", "attention_block"),
    ("model.dsa.indexer_query_block=-1", "indexer_query_block"),
    ("model.dsa.torch.indexer_pool_block=2.5", "indexer_pool_block"),
])
def test_bad_recipe_settings_are_refused(override, message):
    from skyrl_megatron_kda.recipes import load_recipe

    with pytest.raises(Exception, match=message):
        load_recipe("glm53_flash_tiny", [override]).recipe
