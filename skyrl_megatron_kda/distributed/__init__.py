"""Model-agnostic distributed building blocks: the CP token layout, tensor-parallel sharding of
full tensors, and running megatron-core on CPU ranks."""
