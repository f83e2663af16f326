"""``model.dsa.kernel=latent`` (GPU): the ``fused`` kernel's indexer and absorbed layout with our
TileLang sparse-MLA kernels (``latent_sparse_mla``), built for GLM's 512-wide NoPE latent: no
padding to 576 channels, every head of a query in one thread block."""

from __future__ import annotations

from ..latent_sparse_mla import BACKWARD_ADDS_DKV, LATENT_WIDTH, latent_dsa_kernels
from .fused import FusedKernel


class LatentKernel(FusedKernel):
    name = "latent"
    load_kernels = staticmethod(latent_dsa_kernels)
    width, value_width = LATENT_WIDTH, LATENT_WIDTH
    backward_adds_dkv = BACKWARD_ADDS_DKV

