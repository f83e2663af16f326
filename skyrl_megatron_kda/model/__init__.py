"""Model pieces of GLM-5.3-Flash that are neither KDA nor stock megatron-core."""
