"""What the head-parallel exchanges share: whole sequences for 1/cp of the local heads per CP rank,
and one all-to-all of the output back to sequence shards."""

from __future__ import annotations

import torch
from megatron.core.ssm.gated_delta_net.common import tensor_a2a_hp2cp
from megatron.core.tensor_parallel.mappings import all_to_all

from ...distributed.cp_layout import BatchIndexMaps
from .base import CPExchange
from .ledger import counted, nbytes
from .shape import ExchangeMesh, ExchangeShape


class HeadParallelExchange(CPExchange):
    """Whole sequences, 1/cp of the TP-local heads per CP rank, all-to-all back."""

    splits_heads = True
    exact = True  # the same kernel on the same rows and heads; only data movement differs

    @classmethod
    def refusal(cls, mesh: ExchangeMesh) -> str | None:
        if mesh.local_heads % mesh.cp:
            return (f"local heads kda.num_heads/tp = {mesh.num_heads}/{mesh.tp} = {mesh.local_heads} "
                    f"must be divisible by cp={mesh.cp}: {cls.name} splits each TP rank's heads over "
                    "the CP group (kda.cp_exchange=state keeps all heads on every rank)")
        return None

    @classmethod
    def output_bytes(cls, s: ExchangeShape) -> int:
        """The gated-norm output's all-to-all back to sequence shards (per rank, one pass)."""
        return s.rows_bytes(s.tokens // s.cp, s.num_heads * s.head_dim // s.tp) * (s.cp - 1) // s.cp

    def heads(self, num_local_heads: int) -> slice:
        """This CP rank's slice of the TP-local heads, run on the whole sequence."""
        per_rank = num_local_heads // self.cp
        return slice(self.cp_rank * per_rank, (self.cp_rank + 1) * per_rank)

    def _a2a(self, x: torch.Tensor, to_heads: bool) -> torch.Tensor:
        """to_heads: ``x`` [cp * S, b, w] holds rank j's share in rows [j*S, (j+1)*S), and the
        result holds every rank's share for this rank, rows CP-rank major. Else the reverse
        (megatron's hp2cp): [T, b, w] rows CP-rank major -> [T/cp, b, cp*w]."""
        payload = nbytes(x) * (self.cp - 1) // self.cp
        if to_heads:
            out = all_to_all(self.groups.cp, x)
        else:
            out = tensor_a2a_hp2cp(x, 0, -1, self.groups.cp, redo_attention_load_balancing=False)
        return counted(out, self.ledger, "cp", payload)

    def to_sequence(self, o_heads: torch.Tensor, layout: BatchIndexMaps) -> torch.Tensor:
        """[T, b, heads_slice*V] in natural order -> [T/cp, b, local_heads*V] on this CP rank's rows."""
        if self.cp == 1:
            return o_heads
        o_rank_major = layout.from_rank_major.undo(o_heads)
        return self._a2a(o_rank_major, to_heads=False)
