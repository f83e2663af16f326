"""DSA ("indexed attention"): GLM's sparse-attention layer on megatron-core's MLA, its pooled
lightning indexer, and the kernels behind one contract (``kernels``). README.md beside this
module is the reference."""
