"""KDA (Kimi Delta Attention) kernels, layer and context-parallel exchanges."""
