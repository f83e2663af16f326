"""``model.dsa.kernel=fused`` (GPU): megatron-core's TileLang sparse-MLA kernels in the absorbed
layout (``fused_sparse_mla`` on ``ops/fused.py``) and our Triton indexer scores
(``ops/index_scores.py``) with the exact top-k from a floor (``ops/threshold_topk.py``) per query
block (``pool_topk.fused_block_topk``). The kernels are loaded when the model is built
(``load_kernels``: a clear error where CUDA or TileLang is missing); the CPU tests replace
``load_kernels`` with a torch stand-in of the same contract."""

from __future__ import annotations

from ..fused_sparse_mla import fused_absorbed_sparse_mla
from ..ops.contract import KERNEL_VALUE_WIDTH, KERNEL_WIDTH
from ..ops.fused import fused_sparse_mla_ops
from ..ops.index_scores import GROUP
from ..ops.threshold_topk import CANDIDATES_PER_PICK
from ..pool_topk import LAG, fused_block_topk
from .absorbed import AbsorbedKernel, indexer_inputs_bytes
from .base import DSAShape


class FusedKernel(AbsorbedKernel):
    name = "fused"
    working_set_label = "one call's working set"
    options = "fused"
    rate_key = "fused"
    load_kernels = staticmethod(fused_sparse_mla_ops)
    """Where the ``ops.contract.SparseMLAOps`` come from (the CPU tests swap in a stand-in)."""
    width, value_width = KERNEL_WIDTH, KERNEL_VALUE_WIDTH
    """The sparse-MLA kernels' input and output channels (the latent is zero-padded to width)."""
    backward_adds_dkv = False
    """The backward adds into the layer's fp32 latent gradient (``SparseMLAOps.backward_adds_dkv``)
    rather than returning its own [T, width] fp32 and bf16 copies."""
    masks_empty_queries = True
    """The wrapper masks the output and its gradient of queries with no selected key
    (``SparseMLAOps.zero_without_keys`` false): one more [f, n, value_width] copy each."""

    def __init__(self, dsa):
        super().__init__(dsa)
        self.kernels = type(self).load_kernels(**self.kernel_options(dsa))

    @classmethod
    def kernel_options(cls, dsa) -> dict:
        """What ``load_kernels`` takes from the recipe's ``model.dsa``."""
        return {"indexer_scores": cls.options_of(dsa).indexer_scores}

    @classmethod
    def refusal(cls, device: str) -> str | None:
        if device != "gpu":
            return (f"model.dsa.kernel={cls.name} needs run.device=gpu (TileLang kernels on "
                    "CUDA); use model.dsa.kernel=torch or auto on CPU")
        return None

    def index_keys(self, pool_k):
        return self.kernels.index_keys(pool_k)

    def top_pools(self, q, weights, pool_k, candidates, rows, n_select, out, later):
        fused_block_topk(q, weights, pool_k, candidates, rows, n_select, self.kernels.index_scores,
                         self.kernels.index_group, out, later)

    def attend(self, query, latent, kv_up_weight, indices, scale, v_head_dim):
        options = self.options_of(self.dsa)
        return fused_absorbed_sparse_mla(query, latent, kv_up_weight, indices, scale, v_head_dim,
                                         options.query_block, self.kernels,
                                         keep_output=options.keep_attention_output)

    @classmethod
    def kept_bytes(cls, shape: DSAShape) -> int:
        """The absorbed layout's (``AbsorbedKernel.kept_bytes``), and under its options'
        ``keep_attention_output`` the kernel's output [rows, heads, value_width] w and fp32
        log-sum-exp [rows, heads] of every call."""
        kept = super().kept_bytes(shape)
        if cls.options_of(shape.dsa).keep_attention_output:
            kept += shape.rows * shape.heads * (cls.value_width * shape.act_bytes + 4)
        return kept

    @classmethod
    def forward_index_multiple(cls, shape: DSAShape) -> int:
        """What the forward kernel's copy of the indices is padded to: megatron-core's kernel
        takes its selected keys 64 at a time."""
        return 64

    @classmethod
    def working_sets(cls, shape: DSAShape) -> dict[str, int]:
        """As the code allocates them (q = indexer_query_block and f = the options' query_block
        queries per call, P = T / kpool pools, n the share's heads, w the activation bytes):

        * ``indexer``: the indexer inputs (``absorbed.indexer_inputs_bytes``), one block's
          indexer queries [q, index_heads, index_head_dim], its fp32 head weights, the Triton
          scores [q, P] fp32 and their group maxima [q, P / GROUP] fp32, ``threshold_topk``'s
          two compacted buffers (groups, then scores: fp32 values + int32 ids, c =
          CANDIDATES_PER_PICK x k per query, k = index_topk / kpool) and its top-k (fp32 values,
          int64 ids, the int64 picked ids); the queries' candidate runs [index_rows] (two int64)
          and, while ``DeferredRows`` waits to read a block's crowded rows, LAG more blocks'
          indexer queries, head weights and int64 pool ids; under ``indexer_scores=fp8``
          the pass's FP8 pool keys and their fp32 scales [P] (quantised once, before the
          blocks) and a block's FP8 queries and scales.
        * ``attention forward``: the latent in the kernels' width (``width``: 576, zero-padded,
          for megatron-core's; 512 for ours) [T, width] w; per call: the absorbed queries
          [f, n, width] w, the kernel's output and (``masks_empty_queries``) its masked copy [f,
          n, value_width] w each, less the one that ``keep_attention_output`` keeps
          (in ``kept_bytes``), the int32 indices copy and the kernel's copy padded to
          ``forward_index_multiple``.
        * ``attention backward``: that latent, the fp32 latent gradient [T, R] and (unless the
          kernel adds into it, ``backward_adds_dkv``) the kernel's fp32 latent gradient [T,
          width] and its w copy; per call the absorbed queries, the recomputed output (not
          under ``keep_attention_output``: the kept one is read), the output gradient
          in latent space (einsum, then padded and masked where ``masks_empty_queries``: two
          alive) [f, n, value_width] w and dq
          [f, n, width] w (the weight gradients' GEMMs read them as they are, with fp32
          output)."""
        w, a, o = shape.act_bytes, shape.dsa, cls.options_of(shape.dsa)
        T, R, n = shape.whole, a.kv_lora_rank, shape.heads
        K = a.index_topk + a.index_kpool - 1
        K_pad = -(-K // cls.forward_index_multiple(shape)) * cls.forward_index_multiple(shape)
        q = min(a.indexer_query_block, shape.index_rows)
        f = min(o.query_block, shape.rows)
        hi, di = a.index_num_heads, a.index_head_dim
        pools = T // a.index_kpool
        selected = a.index_topk // a.index_kpool
        width, value = cls.width, cls.value_width
        latent = T * width * w
        candidates = CANDIDATES_PER_PICK * selected
        indexer = (indexer_inputs_bytes(shape) + q * hi * (di * w + 4)
                   + q * (pools + -(-pools // GROUP)) * 4 + 2 * q * candidates * (4 + 4)
                   + q * selected * (4 + 8 + 8) + shape.index_rows * 2 * 8
                   + LAG * q * (hi * (di * w + 4) + selected * 8))
        if o.indexer_scores == "fp8":  # the pass's FP8 keys and scales, a block's FP8 queries
            indexer += (pools + q * hi) * (di + 4)
        masked = 1 if cls.masks_empty_queries else 0
        transient = 1 + masked - (1 if o.keep_attention_output else 0)
        forward = latent + f * n * (width + transient * value) * w + f * (K + K_pad) * 4
        outputs = (1 if o.keep_attention_output else 2) + masked
        kernel_dkv = 0 if cls.backward_adds_dkv else T * width * (4 + w)
        backward = (latent + T * R * 4 + kernel_dkv + f * n * (2 * width + outputs * value) * w)
        return {"indexer": indexer, "attention forward": forward, "attention backward": backward}
