"""The tiny recipe's model built on a spawned rank's mesh, and its token batch."""

from __future__ import annotations

import torch


def build_on_mesh(recipe):
    """``recipe``'s model on this rank, megatron's parallel state initialised from
    ``recipe.parallel``, weights from seed 0 (the same full weights at every mesh)."""
    from megatron.core import parallel_state

    from skyrl_megatron_kda.model.glm import build_model

    p = recipe.parallel
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp)
    torch.manual_seed(0)
    return build_model(recipe, use_cpu=True)


def token_ids(recipe) -> torch.Tensor:
    """One packed row of ``data.seq_len`` random token ids [1, T], the same on every rank."""
    return torch.randint(0, recipe.model.vocab_size, (1, recipe.data.seq_len),
                         generator=torch.Generator().manual_seed(1))


def token_loss(model, ids: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """The fine-tune loss [b, s] as the trainer takes it: the model's head log-probs, negated."""
    logp, _ = model.token_logprobs(ids, labels, **kwargs)
    return -logp
