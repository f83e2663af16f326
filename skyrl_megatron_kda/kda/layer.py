"""Kimi Delta Attention (GLM-5.3-Flash's linear-attention layer) on megatron-core primitives.

Usable as the ``self_attention`` of a megatron ``TransformerLayer`` spec (``kda_layer_spec``):
same call signature, returns ``(output, bias)``. TP shards heads (column-parallel q/k/v/f_b/g_b/b,
row-parallel o_proj), SP shards rows, and the CP exchange decides which rows and heads this rank
computes; the layer math below never branches on the exchange.

The projections use the column-parallel linears' weights directly (on a head slice) rather than
their ``forward``: every projection shares one row gather (``rows.py``, gathered again in backward
as megatron's SP linears do), and the ``allgather`` exchange projects only a ``1/cp`` head slice of
the weights. The low-rank f_a/g_a and the per-head norm weight are duplicated across TP; each
TP rank only sees its own heads' share of their gradient, so they enter the graph through
Megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, TP all-reduce of the
gradient), which makes their gradients complete on every rank with or without SP.

Under LoRA (lora/adapter.py) the projection reads ``adapted_weight`` of each linear (its head slice
of ``W + (alpha/r) B A``) and ``adapted_raw_weight`` of f_a/g_a, which LoRA knows by their HF
names ``f_a_proj``/``g_a_proj`` (``LORA_WEIGHTS``); without adapters these are the weights
themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import KDAConfig
from . import exchanges
from .exchanges import CommLedger, ExchangeGroups, ExchangeMesh, KernelArgs
from .kernel import gated_rms_norm, resolve_backend
from ..distributed.cp_layout import batch_index_maps
from ..distributed.tensor_parallel import shard_of
from ..lora.adapter import adapted_raw_weight, adapted_weight
from .rows import RowGather, project_rows


@dataclass
class KDASubmodules:
    """Linear layer classes of the KDA layer (column-parallel in, row-parallel out)."""

    q_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    k_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    v_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    f_b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    g_b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    b_proj: Union[ModuleSpec, type] = ColumnParallelLinear
    o_proj: Union[ModuleSpec, type] = RowParallelLinear


def kda_layer_spec(kda_config: KDAConfig, cp_layout: str) -> ModuleSpec:
    """ModuleSpec for a TransformerLayer's ``self_attention`` slot; ``cp_layout`` is the CP
    token layout of the batch (``parallel.cp_layout``)."""
    return ModuleSpec(
        module=KimiDeltaAttention, params={"kda": kda_config, "cp_layout": cp_layout},
        submodules=KDASubmodules()
    )


def _tp_attrs(param: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    return param


class KimiDeltaAttention(MegatronModule):
    """KDA with TP/SP via megatron-core parallel linears and a pluggable CP exchange."""

    # The raw weights that play linears for LoRA, by the linear's (HF's) name.
    LORA_WEIGHTS = {"f_a_proj": "f_a_weight", "g_a_proj": "g_a_weight"}

    def __init__(
        self,
        config: TransformerConfig,
        submodules: KDASubmodules,
        layer_number: int | None = None,
        *,
        kda: KDAConfig,
        cp_layout: str,
        pg_collection: ProcessGroupCollection,
        ledger: CommLedger | None = None,
        cp_comm_type: str | None = None,
        pp_layer_offset: int | None = None,
        name: str | None = None,
    ):
        # TransformerLayer passes cp_comm_type (softmax attention's CP scheme; KDA's CP is the
        # exchange in ``kda.cp_exchange``), pp_layer_offset and name; KDA needs none of them.
        super().__init__(config)
        self.kda_config = kda
        self.cp_layout = cp_layout
        self.layer_number = layer_number
        self.tp_group, self.cp_group = pg_collection.tp, pg_collection.cp
        tp, cp = self.tp_group.size(), self.cp_group.size()
        if kda.num_heads % tp:
            raise ValueError(f"num_heads={kda.num_heads} must be divisible by tp={tp}")
        self.num_local_heads = kda.num_heads // tp
        self.head_dim = kda.head_dim
        self.sp_size = tp if config.sequence_parallel else 1
        exchange = exchanges.get(kda.cp_exchange)  # refuses an unresolved auto
        why = exchange.refusal(ExchangeMesh(tp=tp, cp=cp, sequence_parallel=config.sequence_parallel,
                                            num_heads=kda.num_heads, allow_inexact=kda.allow_inexact))
        if why is not None:
            raise ValueError(f"kda.cp_exchange={kda.cp_exchange} cannot run on this mesh: {why}")
        self.exchange = exchange(ExchangeGroups(self.tp_group, self.cp_group, config.sequence_parallel),
                                 ledger)

        hidden, width = config.hidden_size, kda.num_heads * kda.head_dim
        device = torch.device("cpu") if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())
        self.backend = resolve_backend(kda.kernel, device)
        self.kernel_args = KernelArgs(backend=self.backend, lower_bound=kda.gate_lower_bound,
                                      l2norm_eps=kda.l2norm_eps, chunk_size=kda.chunk_size,
                                      segments=kda.kernel_segments)

        def column(spec, in_size, out_size, name):
            return build_module(
                spec, in_size, out_size, config=config, init_method=config.init_method,
                bias=False, gather_output=False, skip_bias_add=True, is_expert=False,
                tp_group=self.tp_group, name=name,
            )

        self.q_proj = column(submodules.q_proj, hidden, width, "q_proj")
        self.k_proj = column(submodules.k_proj, hidden, width, "k_proj")
        self.v_proj = column(submodules.v_proj, hidden, width, "v_proj")
        self.f_b_proj = column(submodules.f_b_proj, kda.gate_low_rank, width, "f_b_proj")
        self.g_b_proj = column(submodules.g_b_proj, kda.output_gate_low_rank, width, "g_b_proj")
        self.b_proj = column(submodules.b_proj, hidden, kda.num_heads, "b_proj")
        self.o_proj = build_module(
            submodules.o_proj, width, hidden, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_group=self.tp_group, name="o_proj",
        )

        local_width = self.num_local_heads * self.head_dim
        dtype = config.params_dtype
        # Duplicated across TP (see the module docstring for how their gradients stay complete).
        self.f_a_weight = torch.nn.Parameter(torch.empty(kda.gate_low_rank, hidden, device=device, dtype=dtype))
        self.g_a_weight = torch.nn.Parameter(torch.empty(kda.output_gate_low_rank, hidden, device=device, dtype=dtype))
        self.o_norm_weight = torch.nn.Parameter(torch.ones(self.head_dim, device=device, dtype=dtype))
        # Head-major depthwise conv taps for q, k, v of the local heads: [3, H_loc*K, W].
        self.conv_weight = _tp_attrs(torch.nn.Parameter(
            torch.empty(3, local_width, kda.conv_size, device=device, dtype=dtype)), dim=1)
        # Gate parameters stay fp32 (fla's kernel requires it).
        self.A_log = _tp_attrs(torch.nn.Parameter(
            torch.empty(self.num_local_heads, device=device, dtype=torch.float32)), dim=0)
        self.dt_bias = _tp_attrs(torch.nn.Parameter(
            torch.empty(local_width, device=device, dtype=torch.float32)), dim=0)
        if config.perform_initialization:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the non-linear parameters from full-size tensors, then take this TP rank's
        slice, so the model is the same for any TP size given the seed."""
        tp_rank, tp = self.tp_group.rank(), self.tp_group.size()
        kda_cfg = self.kda_config
        self.config.init_method(self.f_a_weight)
        self.config.init_method(self.g_a_weight)
        full_conv = torch.empty(3, kda_cfg.num_heads * self.head_dim, kda_cfg.conv_size)
        torch.nn.init.uniform_(full_conv, -1 / math.sqrt(kda_cfg.conv_size), 1 / math.sqrt(kda_cfg.conv_size))
        full_a_log = torch.empty(kda_cfg.num_heads).uniform_(1, 16).log()
        full_dt_bias = torch.empty(kda_cfg.num_heads * self.head_dim).uniform_(-1.0, 1.0)
        for param, full in ((self.conv_weight, full_conv), (self.A_log, full_a_log), (self.dt_bias, full_dt_bias)):
            param.copy_(shard_of(full, param, tp_rank, tp))

    def _dup(self, param: torch.Tensor) -> torch.Tensor:
        """A TP-duplicated parameter whose gradient is summed over TP in backward."""
        if self.tp_group.size() == 1:
            return param
        return copy_to_tensor_model_parallel_region(param, group=self.tp_group)

    def project(self, shard: torch.Tensor, rows: RowGather | None, heads: slice) -> list[torch.Tensor]:
        """[q, k, v, f, g, beta] of ``heads`` (TP-local indices) for the rows [s, b, D] that
        ``rows`` gathers from ``shard`` (``exchanges.Projection``). q, k and v are each their own
        GEMM's output, contiguous, so the conv reads them as they are and hands its gradients
        back without a concatenation (fla's conv is slower on the strided column views of one
        q|k|v GEMM: ``bench/conv_layouts.py``, docs/benchmarks.md); beta rides in the low-rank
        GEMM."""
        hk = slice(heads.start * self.head_dim, heads.stop * self.head_dim)
        cfg = self.kda_config
        low_rank = torch.cat([adapted_raw_weight(self, "f_a_proj"),
                              adapted_raw_weight(self, "g_a_proj")])
        q, k, v, low = project_rows(
            shard, rows,
            (adapted_weight(self.q_proj, hk),), (adapted_weight(self.k_proj, hk),),
            (adapted_weight(self.v_proj, hk),),
            (self._dup(low_rank), adapted_weight(self.b_proj, heads)),
        )
        f_low, g_low, beta = low.split([cfg.gate_low_rank, cfg.output_gate_low_rank, heads.stop - heads.start], -1)
        f = F.linear(f_low, adapted_weight(self.f_b_proj, hk))
        g = F.linear(g_low, adapted_weight(self.g_b_proj, hk))
        return [q, k, v, f, g, beta]

    def _recurrence_in_head_groups(self, q, k, v, f, b, A_log, dt_bias, layout) -> torch.Tensor:
        """The exchange's recurrence over ``kda.kernel_head_group`` heads at a time ([b, T, H, K]
        tensors; ``b`` [b, T, H]): each group is its own autograd node, so the kernel backward of
        one group has returned, and freed its working set, before the next one runs."""
        nh, K = q.shape[2], self.head_dim
        size = self.kda_config.kernel_head_group or nh
        if size >= nh:
            return self.exchange.recurrence(q, k, v, f, b, A_log, dt_bias, layout, self.kernel_args)
        outs = []
        for start in range(0, nh, size):
            h = slice(start, min(start + size, nh))
            hk = slice(h.start * K, h.stop * K)
            outs.append(self.exchange.recurrence(
                q[:, :, h], k[:, :, h], v[:, :, h], f[:, :, h], b[..., h], A_log[h], dt_bias[hk],
                layout, self.kernel_args))
        return torch.cat(outs, dim=2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        inference_context=None,
        packed_seq_params: PackedSeqParams | None = None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        sequence_len_offset=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [s, b, D] (this rank's CP/SP shard) -> (output [s, b, D], None).

        KDA is causal by construction and has no positional embedding: the attention mask and
        the rotary tensors that TransformerLayer passes to every layer are not used. An attention
        bias or a decode offset would change the result, so they are refused.
        """
        if inference_context is not None or sequence_len_offset is not None:
            raise NotImplementedError("KimiDeltaAttention has no inference (decode) path yet")
        if attention_bias is not None:
            raise ValueError("KimiDeltaAttention takes no attention bias")
        layout = batch_index_maps(hidden_states, packed_seq_params, self.cp_group.size(),
                                  self.tp_group.size(), self.config.sequence_parallel,
                                  self.cp_layout)
        computed = self.exchange.to_compute_layout(hidden_states, layout, self.project,
                                                   self.num_local_heads)
        heads = computed.heads
        nh, K = heads.stop - heads.start, self.head_dim
        hk = slice(heads.start * K, heads.stop * K)
        q, k, v, f, g, b = (s.transpose(0, 1) for s in computed.sections)  # [b, T, w]: the kernels' layout
        batch, seq_len = q.shape[:2]
        q, k, v = (t.reshape(batch, seq_len, nh, K)
                   for t in self.exchange.conv([q, k, v], self.conv_weight[:, hk], layout, self.kernel_args))
        o = self._recurrence_in_head_groups(q, k, v, f.reshape(batch, seq_len, nh, K), b,
                                            self.A_log[heads], self.dt_bias[hk], layout)
        o = gated_rms_norm(o, g.reshape(batch, seq_len, nh, K), self._dup(self.o_norm_weight),
                           self.kda_config.norm_eps, backend=self.backend)
        o = o.reshape(batch, seq_len, nh * K).transpose(0, 1)
        out, bias = self.o_proj(self.exchange.to_sequence(o, layout))
        return out, bias
