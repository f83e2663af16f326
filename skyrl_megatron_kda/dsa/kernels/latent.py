"""``model.dsa.kernel=latent`` (GPU): the ``fused`` kernel's indexer and absorbed layout with our
TileLang sparse-MLA programs (``ops/latent/``), built for GLM's 512-wide NoPE latent: no
padding to 576 channels, every head of a query in one thread block; and, under
``model.dsa.latent.deterministic_backward``, a backward that sums the latent gradient in a fixed
order; under ``model.dsa.latent.attention_forward=flashmla``, FlashMLA's sparse forward."""

from __future__ import annotations

from ..ops.flashmla_forward import KEY_BLOCK as FLASHMLA_KEY_BLOCK
from ..ops.latent.common import LATENT_WIDTH, padded_heads, padded_width
from ..ops.latent.interface import (
    BACKWARD_ADDS_DKV,
    ORDERED_QUERY_BLOCK,
    backward_index_multiple,
    default_backward_config,
    forward_index_multiple,
    latent_sparse_mla_ops,
)
from .base import DSAShape
from .fused import FusedKernel


class LatentKernel(FusedKernel):
    name = "latent"
    load_kernels = staticmethod(latent_sparse_mla_ops)
    width, value_width = LATENT_WIDTH, LATENT_WIDTH
    backward_adds_dkv = BACKWARD_ADDS_DKV
    options = "latent"
    rate_key = "latent"
    masks_empty_queries = False  # the kernels give 0 themselves (zero_without_keys)

    @classmethod
    def kernel_options(cls, dsa) -> dict:
        options = cls.options_of(dsa)
        return {**super().kernel_options(dsa), "ordered": options.deterministic_backward,
                "attention_forward": options.attention_forward}

    @classmethod
    def forward_index_multiple(cls, shape: DSAShape) -> int:
        """FlashMLA's 128-key blocks, or ours (``ops.latent.interface.forward_index_multiple``: a
        pair of 64-key blocks for the warp-specialised forward that whole 64-head groups take,
        else one)."""
        if cls.options_of(shape.dsa).attention_forward == "flashmla":
            return FLASHMLA_KEY_BLOCK
        return forward_index_multiple(padded_heads(shape.heads))

    @classmethod
    def working_sets(cls, shape: DSAShape) -> dict[str, int]:
        """The fused kernel's (``FusedKernel.working_sets``); under
        ``deterministic_backward`` the backward also holds one ordered call's latent
        gradient rows [b, K32, R] fp32 (K32 the selection padded to the backward's key block,
        b = ORDERED_QUERY_BLOCK queries or fewer where a call has fewer) and their sort: the
        pairs' int32 keys and int64 order, twice (the sort's own buffers), the runs' int32 keys,
        int64 counts and int64 starts. Under
        ``attention_forward=flashmla`` each forward call has an int32 length per
        query, and FlashMLA also returns the rows' maxima [f, n] fp32
        beside a copy of the log-sum-exp with +inf made 0 (the indices' padding:
        ``forward_index_multiple``)."""
        sets = super().working_sets(shape)
        a, o = shape.dsa, cls.options_of(shape.dsa)
        K = a.index_topk + a.index_kpool - 1
        if o.attention_forward == "flashmla":
            f = min(o.query_block, shape.rows)
            sets["attention forward"] += f * 4 + 2 * f * shape.heads * 4
        if o.deterministic_backward:
            queries = min(ORDERED_QUERY_BLOCK, o.query_block, shape.rows)
            multiple = backward_index_multiple(default_backward_config(padded_heads(shape.heads)))
            pairs = queries * padded_width(K, multiple)
            sets["attention backward"] += pairs * (a.kv_lora_rank * 4 + 2 * (4 + 8) + 4 + 8 + 8)
        return sets
