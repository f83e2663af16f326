"""Whether FlashMLA's forward can run here (``model.dsa.latent.attention_forward=flashmla``): CUDA and
vLLM's FlashMLA build; the GPU tests that need it skip with this reason otherwise."""

import pytest
import torch


def _has_flashmla() -> bool:
    from skyrl_megatron_kda.dsa.ops.flashmla_forward import sparse_prefill

    try:
        sparse_prefill()
    except RuntimeError:
        return False
    return True


needs_flashmla = pytest.mark.skipif(
    not torch.cuda.is_available() or not _has_flashmla(),
    reason="FlashMLA's forward needs CUDA and vLLM's FlashMLA build")
