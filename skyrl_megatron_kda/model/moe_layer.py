"""megatron-core's MoELayer with two memory fixes of ours: the dispatcher forgets its routing
state after each forward, and ``train.moe_chunk_tokens`` runs the experts over token chunks.

**Dispatcher state.** megatron-core 0.19.2's token dispatchers keep the last forward's routing
tensors as attributes (the allgather dispatcher: ``local_probs``, ``local_map``,
``reversed_local_input_permutation_mapping``) until the layer's next forward. Under full recompute
the rebuilt forward's ``local_probs`` carries autograd history back to the checkpoint's detached
input streams, and that leaf holds its ``.grad``: after the layer's backward, each MoE layer keeps
two [s, N, D] stream tensors alive (2 x 2 GiB per layer at the 1M recipe) until the next step,
so the backward of layer i holds those of every later layer. Backward needs none of these
attributes (autograd saved what it needs), so ``GLMMoELayer`` drops every tensor the dispatcher
set during the forward as soon as the forward returns.

**Token chunks** (``chunk_tokens`` > 0). megatron-core has no token chunking for MoE: its
``recompute_modules=["moe"]`` (``moe_layer_recompute``) reruns the whole layer, so the rebuilt
[tokens x ffn] expert activations still scale with the sequence, and ``moe_act`` needs grouped
GEMM. Here the shared expert and the router run once on all rows (a dense MLP and [s, E]
scores: small next to the routed experts' per-assignment tensors; the router's expert-bias
token counter must see each token once); then, for each chunk of ``chunk_tokens`` rows of the
rank's residual stream, dispatch, routed experts and combine run inside a reentrant checkpoint:
forward keeps only each chunk's inputs (views of the layer input, of the dense routing
probabilities and of the routing map), backward rebuilds one chunk at a time. Every rank of the
dispatcher's TP x EP group runs as many chunks as the rank with the most rows (one all-reduce
of the count per forward; a rank past its rows dispatches an empty chunk), so their collectives
pair up where rows per rank differ (the all-to-all dispatcher under SkyRL's variable-length
micro-batches). The arithmetic per token is megatron's and the MoE
input's gradient sums its parts in megatron's order; only the routed experts' weight gradients
are summed chunk by chunk (fp32 rounding; bitwise with one chunk).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch.utils.checkpoint import checkpoint


class GLMMoELayer(MoELayer):
    """MoELayer (same parameters, same state dict) that releases its dispatcher's routing state
    after each forward and, with ``chunk_tokens`` > 0, runs the experts over token chunks."""

    def __init__(self, *args, chunk_tokens: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 0 (0: no chunks)")
        self.chunk_tokens = chunk_tokens
        if chunk_tokens:
            _check_chunkable(self)
        # Tensors the dispatcher holds from construction (index constants of some dispatchers):
        # everything else it holds after a forward is that forward's routing state.
        self._dispatcher_constants = frozenset(
            name for name, value in vars(self.token_dispatcher).items() if isinstance(value, torch.Tensor))

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        """hidden_states [s, b, D] -> (output [s, b, D], None), as ``MoELayer.forward``."""
        if not self.chunk_tokens:
            out = super().forward(hidden_states, intermediate_tensors, padding_mask)
        else:
            if intermediate_tensors is not None or padding_mask is not None:
                raise ValueError("moe chunk_tokens runs the whole layer: intermediate_tensors and "
                                 "padding_mask are not supported")
            out = self._chunked_forward(hidden_states), None
        self._release_dispatch_state()
        return out

    def _chunked_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # megatron's order: shared expert, router, routed experts, then routed + shared. The
        # shared expert and the router stay whole, so the MoE input's gradient sums its three
        # parts in megatron's order.
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states)  # [s*b, E] each
        s, b = hidden_states.shape[:2]
        outputs = []
        for start in range(0, self._chunk_count(s, hidden_states.device) * self.chunk_tokens,
                           self.chunk_tokens):
            start, stop = min(start, s), min(start + self.chunk_tokens, s)
            # [s, b, D] rows start:stop are the flattened tokens start*b : stop*b.
            args = (hidden_states[start:stop], probs[start * b:stop * b], routing_map[start * b:stop * b])
            if torch.is_grad_enabled():
                outputs.append(checkpoint(self._routed_experts_on_chunk, *args, use_reentrant=True))
            else:
                outputs.append(self._routed_experts_on_chunk(*args))
        output = torch.cat(outputs)
        return output if shared_expert_output is None else output + shared_expert_output

    def _chunk_count(self, rows: int, device: torch.device) -> int:
        """Chunks this forward runs: enough for this rank's ``rows``, and as many as every other
        rank of the dispatcher's group runs, so that their collectives pair up (the all-to-all
        dispatcher serves ranks that hold different row counts: SkyRL's micro-batches are
        packed to their own lengths; a rank past its rows dispatches an empty chunk)."""
        count = torch.tensor([-(-rows // self.chunk_tokens)], device=device)
        group = self.token_dispatcher.tp_ep_group
        if group is not None and group.size() > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        return int(count)

    def _routed_experts_on_chunk(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                                 routing_map: torch.Tensor) -> torch.Tensor:
        """MoELayer's dispatch, routed experts and combine on one chunk of rows [n, b, D]."""
        hidden, probs = self.preprocess(_GradientCopied.apply(hidden_states), probs, routing_map)
        hidden, probs = self.dispatch(hidden, probs)
        output, _ = self.routed_experts_compute(hidden, probs)
        output = self.token_dispatcher.combine_postprocess(self.combine(output))
        # The rebuilt chunk's routing state would otherwise hold its graph past its backward.
        self._release_dispatch_state()
        return output

    def _release_dispatch_state(self) -> None:
        dispatcher = self.token_dispatcher
        for name, value in list(vars(dispatcher).items()):
            if isinstance(value, torch.Tensor) and name not in self._dispatcher_constants:
                setattr(dispatcher, name, None)


class _GradientCopied(torch.autograd.Function):
    """Identity whose backward copies the gradient out of megatron's global all-gather buffer.

    Under TP or EP the allgather dispatcher's backward reduce-scatters the tokens' gradient into
    megatron's global memory buffer ("mpu"), which the next all-gather into it overwrites (the
    next chunk's recompute, the shared expert's SP all-gather in its backward). In megatron's
    whole layer the router's gradient is added to it before (a new tensor); in a chunk the
    checkpoint's detached input would take the buffer itself as its ``.grad``, and what the
    chunk returns would change under it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


def _check_chunkable(layer: MoELayer) -> None:
    """Refuse the MoELayer features the chunked forward does not reproduce."""
    c = layer.config
    reasons = []
    if c.moe_latent_size:
        reasons.append("moe_latent_size (latent projections)")
    if c.moe_shared_expert_overlap:
        reasons.append("moe_shared_expert_overlap")
    if layer.moe_layer_recompute:
        reasons.append("recompute_modules 'moe' (megatron's whole-layer MoE recompute)")
    if c.overlap_dispatch_backward_with_experts_wgrad:
        reasons.append("overlap_dispatch_backward_with_experts_wgrad")
    if c.moe_expert_capacity_factor is not None:
        reasons.append("moe_expert_capacity_factor (capacity is per call: chunks would change it)")
    if c.transformer_impl == "inference_optimized":
        reasons.append("transformer_impl=inference_optimized")
    if reasons:
        raise ValueError("MoE token chunks cannot run with " + ", ".join(reasons))
