"""Our sparse-MLA programs for GLM's latent (``model.dsa.kernel=latent``), one module per phase."""
