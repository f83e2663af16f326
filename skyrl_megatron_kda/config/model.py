"""The GLM-5.3-Flash text model: layer pattern, MoE, DSA and hyper-connection sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import ConfigSection, NonNegativeInt, PositiveInt, refuse_former_keys

LayerType = Literal["kda", "dsa"]
"""Token mixer of one trunk layer: KDA linear attention or DSA (MLA + lightning indexer)."""

MLPType = Literal["dense", "moe"]
"""Feed-forward block of one trunk layer."""


class MoEConfig(ConfigSection):
    """The routed experts of the sparse layers; defaults are GLM-5.3-Flash's."""

    num_experts: PositiveInt = 288
    """Routed experts per MoE layer."""
    top_k: PositiveInt = 8
    """Routed experts each token is sent to."""
    ffn_hidden_size: PositiveInt = 2048
    """Intermediate width of one expert (SwiGLU); the shared expert has the same width."""
    num_shared_experts: NonNegativeInt = 1
    """Always-on shared experts added to the routed output (0: none)."""
    routed_scaling_factor: float = Field(default=2.5, gt=0)
    """Multiplier on the combined routed output (after top-k normalisation)."""
    score_function: Literal["sigmoid", "softmax"] = "sigmoid"
    """Router score function (GLM-5.3-Flash: sigmoid)."""
    score_correction_bias: bool = Field(default=True, strict=True)
    """Per-expert bias added to the scores for top-k selection only (aux-loss-free, noaux_tc)."""
    norm_topk_prob: bool = Field(default=True, strict=True)
    """Renormalise the selected top-k scores to sum to 1."""
    swiglu_limit: float | None = Field(default=10.0, gt=0)
    """SwiGLU clamp: gate <= limit, up in [-limit, limit] (None: no clamp); dense FFN too."""
    dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """megatron-core's token dispatcher: how routed rows reach their experts' ranks over EP x ETP
    (``alltoall``: each routed row to its expert's rank only; ``allgather``: every row of the
    group to every rank, which needs the same number of rows on each, so SkyRL's variable-length
    micro-batches refuse it; ``flex``: DeepEP, needs ``deep_ep``, a GPU and ep x etp > 1). The
    same arithmetic per row: free to change on a resume (``recipe_rules``, docs/model.md)."""

    @model_validator(mode="after")
    def _top_k_fits_experts(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} must be <= model.moe.num_experts="
                f"{self.num_experts}: a token cannot pick more experts than there are"
            )
        return self

    @model_validator(mode="after")
    def _router_expressible(self) -> MoEConfig:
        # megatron-core's router (model/moe.py maps these fields onto it) computes only some of
        # GLM's router variants; the others would fail at model build, after Ray has started.
        k = self.top_k
        if self.score_function == "sigmoid" and k > 1 and not self.norm_topk_prob:
            raise ValueError(
                f"model.moe.norm_topk_prob=false with model.moe.top_k={k} and sigmoid scores: "
                "megatron-core's sigmoid router always renormalises the top-k scores; set "
                "model.moe.norm_topk_prob=true")
        if k == 1 and self.norm_topk_prob:
            what = ("does not renormalise a single sigmoid score (GLM would weigh it 1)"
                    if self.score_function == "sigmoid" else
                    "refuses a softmax over the one selected logit (weight 1, zero router gradient)")
            raise ValueError(
                f"model.moe.top_k=1 with model.moe.norm_topk_prob=true: megatron-core {what}; set "
                "model.moe.norm_topk_prob=false (the expert's weight is then its router score)")
        if self.score_function == "softmax" and self.score_correction_bias:
            raise ValueError(
                "model.moe.score_correction_bias=true with model.moe.score_function=softmax: "
                "megatron-core's expert bias supports only sigmoid scores; set "
                "model.moe.score_correction_bias=false or score_function=sigmoid")
        return self


class FusedOptions(ConfigSection):
    """``model.dsa.fused``: the options of the fused kernel (megatron-core's TileLang sparse MLA
    with our indexer); refused while another kernel runs (``recipe_rules``)."""

    query_block: PositiveInt = 8192
    """Queries per call of the sparse-attention kernel (forward and backward): each call's
    transient tensors are about query_block x heads x the kernel's width in bf16, a few times
    over."""
    keep_attention_output: bool = False
    """Keep each call's latent-space output [rows, heads, width] (bf16) and log-sum-exp
    [rows, heads] (fp32) from the forward for the backward instead of running the kernel forward
    again there: one sparse-attention forward less per DSA layer and step, for that memory from
    the layer's (recomputed) forward to its backward (plan counts it). Off by default: the
    memory is the price (docs/benchmarks.md)."""
    indexer_scores: Literal["bf16", "fp8"] = "bf16"
    """Precision of the indexer's q . k products. bf16: the reference's; fp8: e4m3 with a scale
    per query head and per pool, as DeepSeek-V3.2's indexer (dsa/ops/index_scores.py), on the FP8
    tensor cores; pools that score within FP8's rounding of the k-th may be chosen differently,
    hence bf16 by default (docs/benchmarks.md)."""


class LatentOptions(FusedOptions):
    """``model.dsa.latent``: the options of the latent kernel (our TileLang sparse MLA for the
    512-wide latent): the fused kernel's, and its own backward order and forward kernel; refused
    while another kernel runs (``recipe_rules``)."""

    deterministic_backward: bool = False
    """Sum the sparse attention's latent gradient in a fixed order (the backward writes each
    query's gradient rows, ``dsa/ops/ordered_row_sums.py`` adds them key by key) instead of with
    fp32 atomics, so the DSA layers' attention backward gives bitwise-equal gradients on every
    run (replaying an RL step). Off by default: it is slower and holds one ordered call's
    gradient rows in backward (plan counts them; docs/benchmarks.md)."""
    attention_forward: Literal["tilelang", "flashmla"] = "tilelang"
    """Which kernel runs the sparse attention's forward. tilelang: ours; flashmla: FlashMLA's
    sparse prefill kernel from vLLM's install (dsa/ops/flashmla_forward.py), equal within bf16
    rounding (docs/benchmarks.md); needs vllm, hence tilelang by default. The backward is ours
    either way."""


class TorchOptions(ConfigSection):
    """``model.dsa.torch``: the block sizes of the torch kernel (the CPU path and the GPU
    kernels' reference); refused while another kernel runs (``recipe_rules``)."""

    attention_block: PositiveInt = 64
    """Queries per step of the sparse attention (forward and backward): the step's working set
    is about attention_block x (index_topk + kpool - 1) x kv_lora_rank fp32 values."""
    indexer_pool_block: PositiveInt = 4096
    """Pools scored per step of the indexer: the live scores are indexer_query_block x
    index_num_heads x indexer_pool_block fp32 values."""


KERNEL_OPTIONS = ("fused", "latent", "torch")
"""The ``model.dsa`` sections that hold one kernel's options, each named as its kernel."""

_DSA_FORMER_KEYS = {
    "fused_query_block": "is now model.dsa.fused.query_block (or model.dsa.latent.query_block)",
    "keep_attention_output": ("is now model.dsa.latent.keep_attention_output (or "
                              "model.dsa.fused.keep_attention_output)"),
    "indexer_scores": "is now model.dsa.latent.indexer_scores (or model.dsa.fused.indexer_scores)",
    "deterministic_backward": "is now model.dsa.latent.deterministic_backward",
    "attention_forward": "is now model.dsa.latent.attention_forward",
    "attention_block": "is now model.dsa.torch.attention_block",
    "indexer_pool_block": "is now model.dsa.torch.indexer_pool_block",
}
"""The kernel options that ``model.dsa`` held before each kernel's own section, refused with the
key that holds them now."""


class DSAConfig(ConfigSection):
    """The DSA layers: MLA without RoPE plus the lightning indexer; defaults are GLM-5.3-Flash's."""

    num_heads: PositiveInt = 64
    """Attention heads of the MLA (query and key/value heads alike)."""
    q_lora_rank: PositiveInt = 1536
    """Rank of the low-rank query projection."""
    kv_lora_rank: PositiveInt = 512
    """Rank of the compressed key/value latent."""
    qk_nope_head_dim: PositiveInt = 256
    """Per-head query/key width without positional rotation."""
    qk_rope_head_dim: NonNegativeInt = 0
    """Per-head query/key width with RoPE (GLM-5.3-Flash's text tower: 0, no RoPE)."""
    v_head_dim: PositiveInt = 256
    """Per-head value width."""
    index_num_heads: PositiveInt = 32
    """Heads of the lightning indexer that scores keys for each query."""
    index_head_dim: PositiveInt = 128
    """Per-head width of the lightning indexer."""
    index_topk: PositiveInt = 2048
    """Keys each query attends to, chosen by the indexer (tokens; the tail is always selected)."""
    index_kpool: PositiveInt = 4
    """Keys pooled into one indexer block (tokens per pooled key)."""
    kernel: str = Field(default="auto", strict=True)
    """Sparse attention implementation: a registered kernel (``dsa.kernels``) or ``auto``, which
    is resolved once when the recipe is loaded to run (``recipes.load_recipe``: the first kernel
    the device does not refuse). latent: our TileLang sparse-MLA kernels for GLM's 512-wide NoPE
    latent (CUDA, the ``tilelang`` package; dsa/kernels/latent.py) and our Triton indexer scores;
    fused: the same with megatron-core's TileLang SparseMLA kernels (the latent zero-padded to
    576 channels; dsa/kernels/fused.py); torch: the absorbed sparse MLA over the KV latent in
    query blocks (dsa/kernels/torch_blocks.py), the CPU path and the GPU kernels' reference;
    unfused: megatron-core's ``unfused_dsa_fn`` on whole-sequence keys and values with the full
    [queries x pools] indexer scores (the oracle the others are tested against); auto: latent
    when run.device=gpu, else torch. latent, fused and torch share the blocked indexer top-k;
    memory is linear in the tokens for all three. Each kernel's own options sit under its name
    (``model.dsa.latent``, ``fused``, ``torch``). The name, the device, the split and the options
    are checked against the live registry (``recipe_rules``)."""
    tp_split: Literal["heads", "sequence"] = "sequence"
    """How tensor parallelism splits the sparse attention. heads: each TP rank attends with its
    heads/tp heads from all query rows of its CP rank (the indexer runs on all of them, on every
    TP rank); sequence: an all-to-all inside the TP group gives each TP rank all heads for a
    balanced 1/tp of its CP rank's rows (Ulysses; a piece from each end, so that every TP rank's
    queries see as many earlier keys on average), so each selected latent row serves every head
    and the indexer runs once per row; the whole layer then runs on rows (every projection with
    its whole weight, the q latent and the output moved by all-to-all; dsa/layer.py's
    ``forward_by_rows``). Needs kernel fused, latent or torch. sequence is the default because it
    takes less time and memory per step (docs/benchmarks.md); with a kernel that cannot attend
    by rows (unfused) the default is heads (``recipe_rules.kernel_split``)."""
    indexer_query_block: PositiveInt = 1024
    """Queries per step of the indexer (query projection, pool scores, top-k, indices); the
    fused and latent kernels' step holds indexer_query_block x (visible pools) fp32 scores."""
    fused: FusedOptions = Field(default_factory=FusedOptions)
    """Options of the fused kernel."""
    latent: LatentOptions = Field(default_factory=LatentOptions)
    """Options of the latent kernel."""
    torch: TorchOptions = Field(default_factory=TorchOptions)
    """Options of the torch kernel."""

    @model_validator(mode="before")
    @classmethod
    def _former_keys(cls, data):
        return refuse_former_keys(data, "model.dsa", _DSA_FORMER_KEYS)

    def attends_by_rows(self, tp: int, sequence_parallel: bool) -> bool:
        """Whether a rank attends with every head on a 1/tp of its CP rank's rows
        (``tp_split=sequence`` where SP splits the rows over TP > 1); otherwise with its heads/tp
        heads on all its CP rank's rows."""
        return self.tp_split == "sequence" and sequence_parallel and tp > 1

    @model_validator(mode="after")
    def _topk_divisible_by_kpool(self) -> DSAConfig:
        if self.index_topk % self.index_kpool:
            raise ValueError(
                f"model.dsa.index_topk={self.index_topk} must be divisible by "
                f"model.dsa.index_kpool={self.index_kpool}: the indexer selects whole pooled blocks"
            )
        return self


class HyperConnectionConfig(ConfigSection):
    """mHC (manifold-constrained hyper-connections) around every layer; defaults are GLM-5.3-Flash's."""

    num_streams: PositiveInt = 4
    """Parallel residual streams (hc_mult); the final collapse is their unweighted mean."""
    sinkhorn_iterations: PositiveInt = 20
    """Sinkhorn normalisation steps making the stream-mixing matrix doubly stochastic."""
    eps: float = Field(default=1e-6, gt=0)
    """Epsilon of the Sinkhorn normalisation (hc_eps)."""
    map_chunk_rows: PositiveInt = 4096
    """Rows (tokens) per chunk of the maps' normalised projection, forward and backward: its fp32
    upcast of the N*D-wide streams and that upcast's gradients exist for one chunk at a time
    (4096 rows of GLM's 16,384 columns: 256 MiB each) instead of for every row of the rank. The
    numerics do not depend on it beyond the weight gradient's fp32 summation order over
    chunks."""


class ModelConfig(ConfigSection):
    """The GLM-5.3-Flash text model (trunk without the MTP layer); defaults are the full model's.

    The KDA layers' own sizes live in the recipe's ``kda`` section (``KDAConfig``)."""

    hidden_size: PositiveInt = 4096
    """Width of the residual stream (the layer's input and output)."""
    params_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype as a torch dtype name; the model builder resolves it (no torch here)."""
    num_layers: PositiveInt = 45
    """Trunk layers (the MTP layer is not counted)."""
    vocab_size: PositiveInt = 154880
    """Token vocabulary of the embedding and the output layer."""
    dsa_every: PositiveInt = 4
    """Layer i is DSA where i % dsa_every == dsa_offset, KDA otherwise."""
    dsa_offset: NonNegativeInt = 3
    """See dsa_every (GLM-5.3-Flash: DSA at layers 3, 7, ..., 43)."""
    num_dense_layers: NonNegativeInt = 3
    """The first num_dense_layers layers have a dense FFN, the others MoE."""
    dense_ffn_hidden_size: PositiveInt = 12288
    """Intermediate width of the dense SwiGLU FFN."""
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    """Epsilon of the RMSNorms (layer inputs, final norm, mHC input norm)."""
    moe: MoEConfig = Field(default_factory=MoEConfig)
    """Routed and shared experts of the MoE layers."""
    dsa: DSAConfig = Field(default_factory=DSAConfig)
    """MLA and lightning indexer of the DSA layers."""
    hyper_connections: HyperConnectionConfig = Field(default_factory=HyperConnectionConfig)
    """mHC residual streams."""
    tie_word_embeddings: bool = Field(default=False, strict=True)
    """Share the embedding matrix with the output layer (GLM-5.3-Flash: false, own lm_head)."""

    @model_validator(mode="after")
    def _layer_pattern_fits(self) -> ModelConfig:
        if self.dsa_offset >= self.dsa_every:
            raise ValueError(
                f"model.dsa_offset={self.dsa_offset} must be < model.dsa_every={self.dsa_every}: "
                "layer i is DSA where i % dsa_every == dsa_offset"
            )
        if self.num_dense_layers > self.num_layers:
            raise ValueError(
                f"model.num_dense_layers={self.num_dense_layers} must be <= model.num_layers="
                f"{self.num_layers}"
            )
        return self

    def layer_types(self) -> list[LayerType]:
        """Token mixer of each trunk layer, in order (GLM-5.3-Flash: 34 KDA, 11 DSA)."""
        return ["dsa" if i % self.dsa_every == self.dsa_offset else "kda"
                for i in range(self.num_layers)]

    def mlp_types(self) -> list[MLPType]:
        """Feed-forward block of each trunk layer, in order (GLM-5.3-Flash: 3 dense, 42 MoE)."""
        return ["dense" if i < self.num_dense_layers else "moe" for i in range(self.num_layers)]
