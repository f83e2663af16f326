"""Pydantic configuration for the KDA layer and its parallel layout.

Every invalid combination is refused here, at config time, with a message that names the values
and the fix; nothing downstream falls back. This is the only module of the package that reads
environment variables (``SKYRL_KDA_CP_EXCHANGE``), and it does so only inside
``apply_env_overrides``, never at import. It imports no torch so that configs load anywhere.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

# Strict so that YAML `true` or "2" is not silently read as an int.
PositiveInt = Annotated[int, Field(strict=True, gt=0)]

CPExchange = Literal["a2a", "allgather", "state", "auto"]
"""How KDA layers exchange data across the CP group (DESIGN.md section 2); add new ones here.
``auto`` is resolved to one of the others by ``kda.cost.resolve_cp_exchange`` at model build."""

EXACT_EXCHANGES = ("a2a", "allgather")
"""Exchanges whose outputs and gradients equal CP=1 bitwise (up to fp32 summation order)."""

InterNodeKind = Literal["nvlink", "infiniband", "efa", "tcp"]
"""Named link presets for the hop between nodes (``nvlink``: a multi-node NVLink domain)."""

CP_EXCHANGE_ENV = "SKYRL_KDA_CP_EXCHANGE"
"""Environment variable (the seed pull request's) that overrides ``kda.cp_exchange``."""


class _Config(BaseModel):
    """Base for every config: unknown keys are errors, values never change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ParallelConfig(_Config):
    """Megatron parallel sizes for one model replica (data parallelism is what is left over)."""

    tp: PositiveInt = 1
    """Tensor-parallel size (ranks splitting heads and hidden columns)."""
    cp: PositiveInt = 1
    """Context-parallel size (ranks splitting each sequence, zigzag layout)."""
    ep: PositiveInt = 1
    """Expert-parallel size for the MoE layers."""
    etp: PositiveInt = 1
    """Expert tensor-parallel size (TP inside each expert)."""
    pp: PositiveInt = 1
    """Pipeline-parallel size; only 1 is supported."""
    sequence_parallel: bool = Field(default=False, strict=True)
    """Shard activations outside TP regions along the sequence over the TP group; needs tp > 1."""

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel needs tp > 1 (got tp=1): it shards over the TP group; "
                "set parallel.sequence_parallel=false or raise parallel.tp"
            )
        return self

    @model_validator(mode="after")
    def _no_pipeline_parallel(self) -> ParallelConfig:
        if self.pp != 1:
            raise ValueError(
                f"pp={self.pp}: pipeline parallelism is not supported yet; set parallel.pp=1"
            )
        return self


class KDAConfig(_Config):
    """The KDA linear-attention layer; defaults are GLM-5.3-Flash's."""

    cp_exchange: CPExchange = "a2a"
    """How the layer exchanges data across the CP group; SKYRL_KDA_CP_EXCHANGE overrides it."""
    kernel: Literal["auto", "fla", "torch"] = "auto"
    """Chunked-KDA implementation: auto = fla on CUDA, our pure-torch KDA on CPU."""
    num_heads: PositiveInt = 64
    """Number of KDA heads (q, k and v alike; no grouped values)."""
    head_dim: PositiveInt = 128
    """Per-head key and value width (K = V)."""
    conv_size: PositiveInt = 4
    """Kernel width of the depthwise causal short convolution on q, k, v (tokens)."""
    gate_lower_bound: float = -5.0
    """Safe forget-gate multiplier lb: g = lb * sigmoid(...), so each log-decay is in (lb, 0)."""
    gate_low_rank: PositiveInt = 128
    """Rank of the forget-gate projection f_b(f_a(x))."""
    output_gate_low_rank: PositiveInt = 128
    """Rank of the output-gate projection g_b(g_a(x))."""
    l2norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of the q/k L2 normalisation, x / sqrt(sum x^2 + eps)."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """Epsilon of the per-head gated RMSNorm on the output."""
    chunk_size: Literal[32, 64] = 64
    """Tokens per chunk of the chunked KDA (the sizes fla's kernels allow)."""
    kernel_segments: PositiveInt = 16
    """On the fla backend, each sequence (or CP piece) is cut into about this many segments of
    whole chunks whose sequential state passes run side by side, chained exactly through fp32
    state summaries (``kda/state_kernel.py``); 1 runs fla's ``chunk_kda`` on whole sequences.
    fla's state pass gives one thread block per head and value block, so a long sequence with a
    rank's few heads leaves most SMs idle. The torch backend (the CPU reference) runs a2a,
    allgather and CP=1 on whole sequences; the state exchange always chains its pieces."""
    cp_layout: Literal["zigzag", "contiguous"] = "zigzag"
    """How the model lays tokens over CP ranks: Megatron's load-balanced zigzag (what softmax
    attention layers need), or contiguous slices of the packed row."""
    allow_inexact: bool = Field(default=True, strict=True)
    """Let auto pick an exchange not bitwise equal to CP=1 (state); false also refuses state."""

    @model_validator(mode="after")
    def _state_needs_allow_inexact(self) -> KDAConfig:
        if self.cp_exchange == "state" and not self.allow_inexact:
            raise ValueError(
                "kda.cp_exchange=state is not bitwise equal to CP=1 (fp32 state chain) but "
                "kda.allow_inexact=false forbids that; use a2a, allgather or auto, or set "
                "kda.allow_inexact=true"
            )
        return self

    @field_validator("gate_lower_bound")
    @classmethod
    def _gate_lower_bound_in_range(cls, value: float) -> float:
        if not -5.0 <= value < 0.0:
            raise ValueError(
                f"gate_lower_bound={value} must be in [-5, 0): fla's safe gate requires it"
            )
        return value


NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]

LayerType = Literal["kda", "dsa"]
"""Token mixer of one trunk layer: KDA linear attention or DSA (MLA + lightning indexer)."""

MLPType = Literal["dense", "moe"]
"""Feed-forward block of one trunk layer."""


class MoEConfig(_Config):
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

    @model_validator(mode="after")
    def _top_k_fits_experts(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} must be <= model.moe.num_experts="
                f"{self.num_experts}: a token cannot pick more experts than there are"
            )
        return self


class DSAConfig(_Config):
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

    @model_validator(mode="after")
    def _topk_divisible_by_kpool(self) -> DSAConfig:
        if self.index_topk % self.index_kpool:
            raise ValueError(
                f"model.dsa.index_topk={self.index_topk} must be divisible by "
                f"model.dsa.index_kpool={self.index_kpool}: the indexer selects whole pooled blocks"
            )
        return self


class HyperConnectionConfig(_Config):
    """mHC (manifold-constrained hyper-connections) around every layer; defaults are GLM-5.3-Flash's."""

    num_streams: PositiveInt = 4
    """Parallel residual streams (hc_mult); the final collapse is their unweighted mean."""
    sinkhorn_iterations: PositiveInt = 20
    """Sinkhorn normalisation steps making the stream-mixing matrix doubly stochastic."""
    eps: float = Field(default=1e-6, gt=0)
    """Epsilon of the Sinkhorn normalisation (hc_eps)."""


class ModelConfig(_Config):
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


class DataConfig(_Config):
    """Shape of the training batches."""

    seq_len: PositiveInt = 8192
    """Tokens per sequence (for packed batches, per packed row)."""
    micro_batch_size: PositiveInt = 1
    """Sequences per micro-batch on each data-parallel rank."""
    path: str | None = None
    """A JSONL file or a directory of *.jsonl files (read in name order); None: synthetic data."""
    tokenizer_path: str | None = None
    """Local Hugging Face tokenizer directory; required when records carry "text"."""
    on_bad_record: Literal["skip", "stop"] = "stop"
    """What a bad record does: stop with file:line and reason, or skip it and count the reason."""
    shuffle_buffer: PositiveInt = 1024
    """Documents held by the seeded shuffle buffer (1: keep file order)."""
    append_eos: bool = Field(default=True, strict=True)
    """Append the tokenizer's EOS token to every "text" document (input_ids are taken as given)."""


class LinkConfig(_Config):
    """One kind of link as the cost model of ``auto`` sees it; the presets are defaults to override
    with the numbers of your own cluster (nccl-tests on it)."""

    bandwidth_gib_s: float
    """Per-GPU all-gather bandwidth: bytes each rank receives from the others per second (GiB/s)."""
    all_to_all_bandwidth_gib_s: float | None = None
    """Per-GPU all-to-all bandwidth, bytes received from other ranks per second (GiB/s); None: same."""
    latency_us: float
    """Fixed cost per collective (microseconds)."""

    @field_validator("bandwidth_gib_s", "all_to_all_bandwidth_gib_s")
    @classmethod
    def _bandwidth_positive(cls, value: float | None, info) -> float | None:
        if value is not None and not value > 0:
            raise ValueError(f"{info.field_name}={value} must be > 0 (GiB/s per GPU)")
        return value

    @field_validator("latency_us")
    @classmethod
    def _latency_not_negative(cls, value: float) -> float:
        if not value >= 0:
            raise ValueError(f"latency_us={value} must be >= 0 (microseconds per collective)")
        return value

    @property
    def a2a_bandwidth_gib_s(self) -> float:
        """The all-to-all bandwidth, falling back to the all-gather one."""
        if self.all_to_all_bandwidth_gib_s is None:
            return self.bandwidth_gib_s
        return self.all_to_all_bandwidth_gib_s


# Defaults, to override with measurements of the target cluster.
LINK_PRESETS: dict[str, dict[str, float]] = {
    # NVLink 4 (H200 NV18), measured with NCCL on two H200s (reference/environment.md), 512 MiB
    # per rank: all-gather 250 GiB/s; all-to-all 537 GiB/s algorithm bandwidth over the whole
    # per-rank buffer, of which half stays on the rank at 2 ranks, so 268 GiB/s received from the
    # peer (537 GiB/s across would exceed NV18's 450 GB/s per direction).
    "nvlink": {"bandwidth_gib_s": 250.0, "all_to_all_bandwidth_gib_s": 268.0, "latency_us": 10.0},
    # One 400 Gb/s NIC per GPU (8x ConnectX-7): 46.6 GiB/s line rate, about 45 achieved.
    "infiniband": {"bandwidth_gib_s": 45.0, "latency_us": 20.0},
    # AWS EFA on p5 (3200 Gb/s per 8 GPUs): about 40 GiB/s per GPU, higher latency than IB.
    "efa": {"bandwidth_gib_s": 40.0, "latency_us": 40.0},
    # Plain TCP sockets (NCCL's socket transport): a few GiB/s per GPU.
    "tcp": {"bandwidth_gib_s": 3.0, "latency_us": 100.0},
}
"""Link defaults by kind (GiB/s per GPU, microseconds); ``nvlink`` is also the intra-node default."""


class ClusterConfig(_Config):
    """The machines the mesh runs on, for the ``auto`` cost model only (nothing else reads it).

    Megatron orders ranks tp-cp-ep-dp with TP fastest, so a CP group spans ``tp * cp``
    consecutive ranks and crosses nodes iff ``tp * cp > gpus_per_node``.
    A partial ``intra_node`` / ``inter_node`` mapping overrides only the keys it names on top of
    the preset (``nvlink`` inside a node, ``inter_node_kind`` between nodes).
    """

    gpus_per_node: PositiveInt = 8
    """GPUs per node connected by NVLink (ranks per node)."""
    inter_node_kind: InterNodeKind = "infiniband"
    """Preset for the link between nodes; inter_node overrides its numbers."""
    intra_node: LinkConfig
    """Link between GPUs of one node (default: the NVLink preset)."""
    inter_node: LinkConfig
    """Link between nodes, per GPU (default: the inter_node_kind preset)."""

    @model_validator(mode="before")
    @classmethod
    def _fill_link_presets(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        kind = out.get("inter_node_kind", cls.model_fields["inter_node_kind"].default)
        if not isinstance(kind, str) or kind not in LINK_PRESETS:
            raise ValueError(
                f"cluster.inter_node_kind={kind!r} is not a link preset; expected one of "
                f"{', '.join(LINK_PRESETS)} (and override cluster.inter_node for other numbers)"
            )
        for field, preset in (("intra_node", "nvlink"), ("inter_node", kind)):
            value = out.get(field)
            if isinstance(value, LinkConfig):
                continue
            if value is None:
                out[field] = dict(LINK_PRESETS[preset])
            elif isinstance(value, Mapping):
                out[field] = {**LINK_PRESETS[preset], **value}
        return out

    def cp_spans_nodes(self, tp: int, cp: int) -> bool:
        """Whether a CP group (stride tp, size cp) holds ranks of more than one node."""
        return cp > 1 and tp * cp > self.gpus_per_node

    def tp_spans_nodes(self, tp: int) -> bool:
        """Whether a TP group (tp consecutive ranks) holds ranks of more than one node."""
        return tp > self.gpus_per_node


class LayerRecipe(_Config):
    """Everything needed to build and run one KDA layer on a mesh, with the cross-section checks."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model sizes."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel layout."""
    kda: KDAConfig = Field(default_factory=KDAConfig)
    """The KDA layer and its CP exchange."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Batch shape."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Nodes and links, read only by the cost model of kda.cp_exchange=auto."""

    @model_validator(mode="after")
    def _heads_divisible_by_tp(self) -> LayerRecipe:
        heads, tp = self.kda.num_heads, self.parallel.tp
        if heads % tp:
            raise ValueError(
                f"kda.num_heads={heads} must be divisible by tp={tp}: each TP rank owns whole heads"
            )
        return self

    @model_validator(mode="after")
    def _local_heads_divisible_by_cp(self) -> LayerRecipe:
        heads, tp, cp = self.kda.num_heads, self.parallel.tp, self.parallel.cp
        local_heads = heads // tp
        if self.kda.cp_exchange == "auto" and local_heads % cp and not self.kda.allow_inexact:
            raise ValueError(
                f"kda.cp_exchange=auto has no exchange to pick: local heads kda.num_heads/tp = "
                f"{heads}/{tp} = {local_heads} are not divisible by cp={cp}, which a2a and "
                "allgather need, and kda.allow_inexact=false forbids state; change tp or cp, or "
                "set kda.allow_inexact=true"
            )
        if self.kda.cp_exchange not in ("state", "auto") and local_heads % cp:
            raise ValueError(
                f"local heads kda.num_heads/tp = {heads}/{tp} = {local_heads} must be divisible "
                f"by cp={cp}: kda.cp_exchange={self.kda.cp_exchange} splits each TP rank's heads "
                "over the CP group (kda.cp_exchange=state keeps all heads on every rank)"
            )
        return self

    @model_validator(mode="after")
    def _allgather_needs_sequence_parallel(self) -> LayerRecipe:
        p = self.parallel
        if self.kda.cp_exchange == "allgather" and p.tp > 1 and not p.sequence_parallel:
            raise ValueError(
                f"kda.cp_exchange=allgather with tp={p.tp} needs sequence parallelism: it gathers "
                "the sequence-parallel shards of the hidden state over CP then TP, and without "
                "sequence parallelism there are none; set parallel.sequence_parallel=true, "
                "or use kda.cp_exchange=a2a"
            )
        return self

    @model_validator(mode="after")
    def _seq_len_fits_cp_layout(self) -> LayerRecipe:
        seq_len, cp = self.data.seq_len, self.parallel.cp
        # At cp=1 nothing is split, so any length works (tiny CPU tests use odd ones).
        if cp > 1 and self.kda.cp_layout == "contiguous" and seq_len % cp:
            raise ValueError(
                f"data.seq_len={seq_len} must be divisible by cp={cp}: the contiguous CP layout "
                "gives each rank an equal slice"
            )
        if cp > 1 and self.kda.cp_layout == "zigzag" and seq_len % (2 * cp):
            raise ValueError(
                f"data.seq_len={seq_len} must be divisible by 2*cp={2 * cp}: Megatron's "
                "load-balanced (zigzag) CP layout cuts each sequence into 2*cp chunks"
            )
        return self

    @model_validator(mode="after")
    def _cp_shard_fits_sequence_parallel(self) -> LayerRecipe:
        seq_len, p = self.data.seq_len, self.parallel
        if p.sequence_parallel and (seq_len // p.cp) % p.tp:
            raise ValueError(
                f"data.seq_len/cp = {seq_len}/{p.cp} = {seq_len // p.cp} tokens per CP rank must "
                f"be divisible by tp={p.tp} under sequence parallelism: each TP rank holds 1/tp "
                "of its CP rank's tokens"
            )
        return self


class TrainConfig(_Config):
    """The optimisation loop."""

    steps: PositiveInt = 10
    """Optimizer steps to run."""
    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate (Adam)."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled (AdamW) weight decay."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value (None: no clipping)."""
    seed: int = Field(default=1234, strict=True, ge=0)
    """Seed of parameter init and synthetic data; the same seed gives the same first loss."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in backward for the layers of ``recompute_layers`` (Megatron's
    recompute granularities): ``full`` reruns the whole layer and keeps only its input streams;
    ``selective`` reruns its attention block (norm + KDA or DSA: the largest activations per
    token) and keeps the FFN's; ``none`` keeps every activation."""
    recompute_layers: list[LayerType] = ["kda", "dsa"]
    """The layer types ``recompute`` applies to; layers of the other type keep their activations."""
    offload_activations: bool = Field(default=False, strict=True)
    """Keep the tensors saved for backward in host memory instead of the GPU (torch's
    ``save_on_cpu``, pinned): under full recompute the layer inputs, else every kept activation.
    Each is copied to the host in forward and back in backward."""
    log_every: PositiveInt = 1
    """Log metrics every this many steps."""
    warmup_steps: NonNegativeInt = 0
    """Steps of linear LR warmup from 0 to lr before the cosine decay (0: start at lr)."""
    save_interval: NonNegativeInt = 0
    """Save a checkpoint every this many steps (0: only at the end and on SIGTERM/Ctrl-C)."""
    save_at_end: bool = Field(default=True, strict=True)
    """Save a checkpoint after the last step (benchmarks turn it off: the slice's optimizer state
    alone is tens of GiB)."""

    @field_validator("recompute_layers")
    @classmethod
    def _layer_types_once(cls, value: list[str]) -> list[str]:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"train.recompute_layers={value} must name 'kda' and/or 'dsa', each once")
        return value

    def recompute_of(self, layer_type: str) -> str:
        """The recompute mode of layers of ``layer_type``."""
        return self.recompute if layer_type in self.recompute_layers else "none"

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must be <= train.lr={self.lr}")
        return self


class RunConfig(_Config):
    """Where and on what a run executes."""

    output_dir: str = "runs/default"
    """Folder for metrics.jsonl and the resolved recipe (relative to the working directory)."""
    device: Literal["cpu", "gpu"] = "cpu"
    """One rank per GPU (NCCL), or per CPU slot (gloo)."""
    num_workers: PositiveInt = 1
    """Total ranks (world size) = tp * cp * pp * dp; Ray starts one actor per rank."""
    ray_address: str | None = None
    """Ray cluster to join, e.g. "auto" or "ray://head:10001" (None: start a local cluster)."""
    resume: bool = Field(default=False, strict=True)
    """Continue from the latest checkpoint under output_dir/checkpoints (error if there is none)."""
    init_from_hf: str | None = None
    """Hugging Face glm5_next safetensors folder whose weights start the run (None: random init).
    Every rank reads it, so it must exist on every node when the run starts; with ``resume`` the
    checkpoint's weights win and this folder is only checked (export copies its config through)."""

    @field_validator("init_from_hf")
    @classmethod
    def _init_path_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("run.init_from_hf is empty: give a checkpoint folder, or leave it unset")
        return value


class Recipe(LayerRecipe):
    """A whole training job: the model, its mesh, data, optimisation and where it runs.

    Megatron's world-size rule: ``run.num_workers`` must be divisible by ``tp * cp * pp`` (the rest
    is data parallelism) and by ``ep * etp * pp`` (the expert mesh folds over the same ranks).
    """

    description: str = ""
    """One line saying what the recipe is for (``skyrl-kda recipes`` prints it)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation loop."""
    run: RunConfig = Field(default_factory=RunConfig)
    """Ranks, device and output folder."""

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the dense mesh: num_workers / (tp * cp * pp)."""
        p = self.parallel
        return self.run.num_workers // (p.tp * p.cp * p.pp)

    @model_validator(mode="after")
    def _world_size_fits_mesh(self) -> Recipe:
        p, world = self.parallel, self.run.num_workers
        dense, expert = p.tp * p.cp * p.pp, p.ep * p.etp * p.pp
        if world % dense:
            raise ValueError(
                f"run.num_workers={world} must be divisible by tp*cp*pp = {p.tp}*{p.cp}*{p.pp} = "
                f"{dense}: the ranks left over form the data-parallel replicas"
            )
        if world % expert:
            raise ValueError(
                f"run.num_workers={world} must be divisible by ep*etp*pp = {p.ep}*{p.etp}*{p.pp} "
                f"= {expert}: Megatron folds the expert mesh over the same ranks"
            )
        return self

    @model_validator(mode="after")
    def _experts_fit_mesh(self) -> Recipe:
        p, moe = self.parallel, self.model.moe
        if moe.num_experts % p.ep:
            raise ValueError(
                f"model.moe.num_experts={moe.num_experts} must be divisible by ep={p.ep}: each "
                "expert-parallel rank owns whole experts"
            )
        if moe.ffn_hidden_size % p.etp:
            raise ValueError(
                f"model.moe.ffn_hidden_size={moe.ffn_hidden_size} must be divisible by "
                f"etp={p.etp}: expert tensor parallelism splits each expert's columns"
            )
        if p.ep > 1 and p.tp > 1 and not p.sequence_parallel:
            raise ValueError(
                f"ep={p.ep} with tp={p.tp} needs parallel.sequence_parallel=true (Megatron's MoE "
                "token dispatch requires it)"
            )
        return self

    @model_validator(mode="after")
    def _dense_parts_divisible_by_tp(self) -> Recipe:
        m, tp = self.model, self.parallel.tp
        if m.dsa.num_heads % tp:
            raise ValueError(
                f"model.dsa.num_heads={m.dsa.num_heads} must be divisible by tp={tp}: each TP "
                "rank owns whole attention heads"
            )
        if m.dense_ffn_hidden_size % tp:
            raise ValueError(
                f"model.dense_ffn_hidden_size={m.dense_ffn_hidden_size} must be divisible by "
                f"tp={tp}: tensor parallelism splits the FFN columns"
            )
        if tp > 1 and "dsa" in m.layer_types() and not self.parallel.sequence_parallel:
            raise ValueError(
                f"DSA layers at tp={tp} need parallel.sequence_parallel=true: without it megatron "
                "sums the duplicated q_layernorm gradient over TP (model/dsa.py)"
            )
        return self

    @model_validator(mode="after")
    def _kernel_fits_device(self) -> Recipe:
        if self.run.device == "cpu" and self.kda.kernel == "fla":
            raise ValueError(
                "kda.kernel=fla needs run.device=gpu (fla's kernels are Triton on CUDA); "
                "use kda.kernel=torch or auto on CPU"
            )
        return self


def apply_env_overrides(raw: dict, environ: Mapping[str, str] | None = None) -> dict:
    """Return a copy of ``raw`` with ``SKYRL_KDA_CP_EXCHANGE`` applied to ``kda.cp_exchange``.

    The seed pull request selected the exchange with this variable; it keeps working, but it is
    read here only, explicitly, and logged, so the config stays the single source of truth.
    An empty value counts as unset. ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    out = copy.deepcopy(raw)
    value = env.get(CP_EXCHANGE_ENV)
    if not value:
        return out
    allowed = get_args(CPExchange)
    if value not in allowed:
        raise ValueError(
            f"{CP_EXCHANGE_ENV}={value!r} is not a KDA CP exchange; "
            f"allowed values: {', '.join(allowed)}"
        )
    kda = out.get("kda")
    if kda is None:
        kda = out["kda"] = {}
    if not isinstance(kda, dict):
        raise ValueError(f"kda must be a mapping to apply {CP_EXCHANGE_ENV}, got {kda!r}")
    default = KDAConfig.model_fields["cp_exchange"].default
    configured = kda.get("cp_exchange", f"{default} (default)")
    logger.warning(
        "%s=%s overrides kda.cp_exchange (config value: %s)", CP_EXCHANGE_ENV, value, configured
    )
    kda["cp_exchange"] = value
    return out


def load_layer_recipe(raw: dict, environ: Mapping[str, str] | None = None) -> LayerRecipe:
    """Validate ``raw`` after environment overrides, so an override is checked like any value."""
    return LayerRecipe.model_validate(apply_env_overrides(raw, environ))


def load_recipe_dict(raw: dict, environ: Mapping[str, str] | None = None) -> Recipe:
    """Validate a whole recipe ``raw`` after environment overrides (``recipes.load_recipe`` reads
    the files and applies ``--set`` overrides first)."""
    return Recipe.model_validate(apply_env_overrides(raw, environ))


def parse_overrides(pairs: list[str]) -> dict:
    """Turn ``["kda.cp_exchange=allgather", "parallel.tp=2"]`` into a nested dict.

    Values go through ``yaml.safe_load`` so ints, bools and lists keep their types; later pairs
    win over earlier ones for the same key. Unknown keys are left for the models to refuse.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"override {pair!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"override {pair!r}: value is not valid YAML ({err})") from err
        node = out
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                prefix = ".".join(parts[: i + 1])
                raise ValueError(f"override {pair!r}: {prefix} was already set to a value")
        node[parts[-1]] = value
    return out


def merge(base: dict, overrides: dict) -> dict:
    """Deep-merge ``overrides`` into a copy of ``base``: mappings merge, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
