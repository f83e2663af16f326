"""What the exchanges' rules and byte models read: the mesh and one KDA layer's dims, torch-free.

Both are built from a recipe by duck typing (``recipe.parallel``, ``recipe.kda``, ...), so nothing
here imports the config (``recipe_rules`` asks the exchanges' rules of a recipe).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExchangeMesh:
    """The values an exchange's ``refusal`` rule may read."""

    tp: int
    cp: int
    sequence_parallel: bool
    num_heads: int  # KDA heads of the whole model (before TP)
    allow_inexact: bool  # whether an exchange not bitwise equal to CP=1 may run

    @classmethod
    def of(cls, recipe) -> ExchangeMesh:
        """The mesh of a recipe (anything with ``parallel`` and ``kda`` sections)."""
        p, kda = recipe.parallel, recipe.kda
        return cls(tp=p.tp, cp=p.cp, sequence_parallel=p.sequence_parallel,
                   num_heads=kda.num_heads, allow_inexact=kda.allow_inexact)

    @property
    def local_heads(self) -> int:
        """Heads on each TP rank."""
        return self.num_heads // self.tp


@dataclass(frozen=True)
class ExchangeShape:
    """What the byte model needs: one KDA layer's dims and the mesh, per micro-batch."""

    tokens: int  # T: tokens per batch row over the whole CP group (packed THD: all sequences)
    batch: int
    hidden: int
    num_heads: int  # heads of the whole model (before TP)
    head_dim: int
    tp: int
    cp: int
    sequence_parallel: bool
    element_size: int = 2  # bytes per activation element (bf16)
    sequences: int = 1  # sequences per batch row (packed THD)
    conv_size: int = 4
    layout: str = "zigzag"  # CP layout of the tokens: a key of ``distributed.cp_layout.LAYOUTS``

    @classmethod
    def of(cls, recipe, *, tokens: int | None = None, batch: int | None = None,
           element_size: int = 2, sequences: int = 1) -> ExchangeShape:
        """The byte model's view of a recipe: by default one micro-batch of ``data.seq_len``
        tokens, bf16 activations."""
        p, kda = recipe.parallel, recipe.kda
        return cls(
            tokens=recipe.data.seq_len if tokens is None else tokens,
            batch=recipe.data.micro_batch_size if batch is None else batch,
            hidden=recipe.model.hidden_size, num_heads=kda.num_heads, head_dim=kda.head_dim,
            tp=p.tp, cp=p.cp, sequence_parallel=p.sequence_parallel, element_size=element_size,
            sequences=sequences, conv_size=kda.conv_size, layout=p.cp_layout,
        )

    @property
    def projected_width(self) -> int:
        """q, k, v, f, g (full width each) and beta of all heads."""
        return 5 * self.num_heads * self.head_dim + self.num_heads

    def rows_bytes(self, rows: int, width: int) -> int:
        return rows * self.batch * width * self.element_size


def whole_vectors(width: int, element_size: int) -> int:
    """``width`` columns rounded up to whole 16-byte vectors: torch reorders rows (index_select)
    with its vectorised gather only when a row is a multiple of 16 bytes, and with a generic
    kernel several times slower otherwise."""
    return width + (-width) % max(1, 16 // element_size)
