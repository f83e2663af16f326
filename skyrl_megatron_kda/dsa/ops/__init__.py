"""DSA's GPU programs (TileLang and Triton) and the contract they fill (``contract.SparseMLAOps``).

``latent/``: our sparse-MLA programs for GLM's 512-wide latent, by phase (``common``,
``forward``, ``backward``, and ``interface``, which pads, picks the defaults and launches them);
``fused.py``: megatron-core's TileLang programs in the same contract; ``flashmla_forward.py``:
FlashMLA's sparse forward; ``row_dots.py`` and ``ordered_row_sums.py``: the backward's Triton
helpers; ``index_scores.py`` and ``threshold_topk.py``: the indexer's Triton scores and exact
top-k. The strategies that choose among them are ``dsa/kernels/``.
"""
