"""Where the fused indexer's time goes at the 1M recipe's rank share: ``torch.profiler`` over one
pass of ``dsa_rank_share.py``'s indexer (65,536 queries, 64 blocks of 1,024 over 262,144 pools)
after a warm-up pass, per score precision, the CUDA kernels sorted by their total time. The sum
of the kernels' times against the pass's wall time (``dsa_rank_share.py``'s indexer stage) is
the time the GPU waits for the host.

Usage (CUDA + tilelang):  python3 bench/indexer_profile.py
"""

from __future__ import annotations

import torch
from dsa_rank_share import indexer, make_inputs  # bench/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile

from skyrl_megatron_kda.dsa.latent_sparse_mla import latent_dsa_kernels

KEYS, BLOCK = 1 << 20, 1024


def main() -> None:
    x = make_inputs(KEYS, "sequence", torch.device("cuda"))
    for precision in ("bf16", "fp8"):
        kernels = latent_dsa_kernels(indexer_scores=precision)
        with torch.no_grad():
            indexer(x, KEYS, "latent", BLOCK, kernels)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                indexer(x, KEYS, "latent", BLOCK, kernels)
                torch.cuda.synchronize()
        print("==", precision)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=60))


if __name__ == "__main__":
    main()
