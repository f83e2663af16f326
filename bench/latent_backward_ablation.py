"""Where our sparse-MLA backward's time goes at the 1M recipe's share, and what other ways of
adding its latent gradient cost.

Each row is one build of a backward program, timed on the same inputs in one call:

* ``as it is``: ``ops.latent.backward.backward_program`` (the latent gradient staged through
  shared memory in 8-row parts and added with 16-byte fp32 atomics);
* ``without its latent-gradient atomics``: the same program with each ``T.atomic_addx4`` made a
  no-op while it is built (a timing ablation: its dkv is wrong);
* ``memory only``: the kernel's memory traffic without its products: the same pipelined gathers
  of the selected latent rows and the same staged atomics, each alone and both together; the
  adds alone also as plain stores of the same bytes and as bulk reduces (``memory_program``;
  the gathered rows stand in for the gradient);
* ``adds from registers``: the previous key block's gradient added straight from the MMA
  registers (8-byte atomics, half the rows after the score products are issued asynchronously
  and half after dq's), so the adds drain while the tensor cores work (``registers_program``);
* ``bulk reduces``: each staged row handed to the TMA unit as one 2 KB ``cp.reduce.async.bulk``
  add, the rows of a part issued together by one thread each, a staging buffer waited for only
  before it is written again (``bulk_program``).

The real kernels' dq and dkv are compared with ``as it is`` (relative norm; the atomics' order
differs, so dkv differs in the last bits). Inputs as in ``bench/latent_sparse_mla.py``: 65,536
queries x 64 heads over 1,048,576 keys of 512 channels, 2,051 pool-shaped indices each; the
log-sum-exp from our forward. Each time is the median of ``--iters`` calls after a warm-up.

``--shared-pools 0,0.5,0.9`` times the rows again on selections with locality: that fraction of
each query's 512 pools is common to its 1,024 neighbouring queries (``pool_shaped_indices``'s
``shared``), so the adds of queries in flight together land on fewer latent rows. The default,
0, is the random selections above.

Usage (CUDA + tilelang):  python3 bench/latent_backward_ablation.py [--iters 3] [--rows NAME,...]
                          [--shared-pools 0,0.5,0.9]
"""

# No `from __future__ import annotations`: TileLang reads the programs' annotations as objects.

import argparse
import json
from contextlib import contextmanager

import torch
from kda_layer import timed  # bench/ is on sys.path when run as a script
from latent_sparse_mla import HEADS, R, SCALE, pool_shaped_indices

from skyrl_megatron_kda.dsa.ops.latent import common, interface
from skyrl_megatron_kda.dsa.ops.latent.backward import BACKWARD_KEY_BLOCK, backward_program

BK = BACKWARD_KEY_BLOCK
BULK_ADD = r"""
__device__ __forceinline__ void bulk_add_f32(float* smem, float* gmem, int bytes) {
  unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(gmem), "r"(src), "r"(bytes) : "memory");
}
"""
"""One thread's bulk add of ``bytes`` of fp32 from shared to global memory (sm_90's TMA unit)."""


@contextmanager
def atomics_left_out():
    """``T.atomic_addx4`` as a no-op statement while a program is built."""
    import tilelang.language as T

    real = T.atomic_addx4
    T.atomic_addx4 = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        T.atomic_addx4 = real


def _signature(T, topk: int):
    """The backward program's query count and tensors (as ``backward_program`` takes
    them)."""
    S, Tk = T.dynamic("S"), T.dynamic("Tk")
    return S, dict(Q=T.Tensor([S, HEADS, R], "bfloat16"), KV=T.Tensor([Tk, R], "bfloat16"),
                dO=T.Tensor([S, HEADS, R], "bfloat16"), Indices=T.Tensor([S, topk], "int32"),
                Lse=T.Tensor([S, HEADS], "float32"), Delta=T.Tensor([S, HEADS], "float32"),
                dQ=T.Tensor([S, HEADS, R], "bfloat16"), dKV=T.Tensor([Tk, R], "float32"))


def _macros(T):
    """The pieces the programs below share, as TileLang macros (inlined where they are called)."""

    @T.macro
    def operands():
        """Shared memory for a query's heads, their output gradient, a key block of latent rows,
        and the block's probabilities and dS."""
        return (T.alloc_shared([HEADS, R], "bfloat16"), T.alloc_shared([HEADS, R], "bfloat16"),
                T.alloc_shared([BK, R], "bfloat16"), T.alloc_shared([HEADS, BK], "bfloat16"),
                T.alloc_shared([HEADS, BK], "bfloat16"))

    @T.macro
    def accumulators():
        """Registers for a key block's valid keys, its scores and their gradient, and the
        query's dq and the block's latent gradient."""
        return (T.alloc_fragment([BK], "bool"), T.alloc_fragment([HEADS, BK], "float32"),
                T.alloc_fragment([HEADS, BK], "float32"), T.alloc_fragment([HEADS, R], "float32"),
                T.alloc_fragment([BK, R], "float32"))

    @T.macro
    def load_query(Q, dO, Lse, Delta, s, q_s, do_s, lse_s, delta_s):
        T.copy(Q[s, :, :], q_s)
        T.copy(dO[s, :, :], do_s)
        for h in T.Parallel(HEADS):
            lse_s[h] = Lse[s, h] * common.LOG2E
            delta_s[h] = Delta[s, h]

    @T.macro
    def gather_block(KV, Indices, s, kb, valid, kv_s, acc_p):
        for k in T.Parallel(BK):
            valid[k] = Indices[s, kb * BK + k] >= 0
        for k, d in T.Parallel(BK, R):
            kv_s[k, d] = KV[T.max(Indices[s, kb * BK + k], 0), d]
        for h, k in T.Parallel(HEADS, BK):
            acc_p[h, k] = T.if_then_else(valid[k], 0, -T.infinity("float32"))

    @T.macro
    def gradients(p_s, ds_s, lse_s, delta_s, acc_p, acc_dp, log2_scale, scale):
        """One key block's probabilities and dS from its (waited for) score products."""
        for h, k in T.Parallel(HEADS, BK):
            acc_p[h, k] = T.exp2(acc_p[h, k] * log2_scale - lse_s[h])
        T.copy(acc_p, p_s)
        for h, k in T.Parallel(HEADS, BK):
            acc_dp[h, k] = acc_p[h, k] * (acc_dp[h, k] - delta_s[h]) * scale
        T.copy(acc_dp, ds_s)

    @T.macro
    def bulk_adds(dKV, Indices, s, kb, tx, acc, dkv_s, store_split, part, buffers):
        """A key block's rows of ``acc`` added to dKV by bulk reduces, staged ``part`` rows at
        a time in ``buffers`` alternating buffers."""
        for r in T.serial(store_split):
            if tx < part:  # this buffer's previous rows have been read
                T.tma_store_wait(buffers - 1, read=True)
            T.sync_threads()
            row0 = (r % buffers) * part
            for k, d in T.Parallel(BK, R):
                if k >= r * part and k < (r + 1) * part:
                    dkv_s[row0 + k - r * part, d] = acc[k, d]
            T.fence_proxy_async()  # the staged rows visible to the TMA unit
            T.sync_threads()
            if tx < part:
                key = Indices[s, kb * BK + r * part + tx]
                if key >= 0:
                    T.call_extern("handle", "bulk_add_f32",
                                  T.access_ptr(dkv_s[row0 + tx, 0], "r", R),
                                  T.access_ptr(dKV[key, 0], "w", R), R * 4)
                T.tma_store_arrive()

    return operands, accumulators, load_query, gather_block, gradients, bulk_adds


def memory_program(topk: int, gathers: bool = True, adds: str | None = "atomics",
                   store_split: int = 4, buffers: int = 1):
    """The kernel's gathers and its writes into dKV without its products; ``adds``:
    ``atomics`` (the kernel's staged 16-byte atomics), ``bulk`` (one bulk reduce per staged row,
    ``buffers`` staging buffers), ``stores`` (plain 16-byte stores: the same bytes, no adds) or
    None."""
    _, T = common.load_tilelang()
    steps, part = topk // BK, BK // store_split
    S, t = _signature(T, topk)
    *_, bulk_adds = _macros(T)

    @T.prim_func
    def memory_only(Q: t["Q"], KV: t["KV"], dO: t["dO"], Indices: t["Indices"], Lse: t["Lse"],
                    Delta: t["Delta"], dQ: t["dQ"], dKV: t["dKV"]):
        with T.Kernel(S, threads=common.threads_for(HEADS)) as s:
            T.import_source(BULK_ADD)
            tx = T.get_thread_binding()
            kv_s = T.alloc_shared([BK, R], "bfloat16")
            dkv_s = T.alloc_shared([buffers * part, R], "float32")
            acc = T.alloc_fragment([BK, R], "float32")
            T.clear(acc)
            for kb in T.Pipelined(steps, num_stages=2):
                if gathers:
                    for k, d in T.Parallel(BK, R):
                        kv_s[k, d] = KV[T.max(Indices[s, kb * BK + k], 0), d]
                    for k, d in T.Parallel(BK, R):
                        acc[k, d] += kv_s[k, d]
                else:
                    for k, d in T.Parallel(BK, R):
                        acc[k, d] += 1.0
                if adds == "bulk":
                    bulk_adds(dKV, Indices, s, kb, tx, acc, dkv_s, store_split, part, buffers)
                elif adds is not None:
                    for r in T.serial(store_split):
                        for k, d in T.Parallel(BK, R):
                            if k >= r * part and k < (r + 1) * part:
                                dkv_s[k - r * part, d] = acc[k, d]
                        for k, d4 in T.Parallel(part, R // 4):
                            if Indices[s, kb * BK + r * part + k] >= 0:
                                if adds == "atomics":
                                    T.atomic_addx4(
                                        dKV[Indices[s, kb * BK + r * part + k], d4 * 4],
                                        dkv_s[k, d4 * 4])
                                else:
                                    for i in T.vectorized(4):
                                        dKV[Indices[s, kb * BK + r * part + k], d4 * 4 + i] = (
                                            dkv_s[k, d4 * 4 + i])
            if adds == "bulk" and tx < part:
                T.tma_store_wait(0, read=True)
            for k, d in T.Parallel(BK, R):  # keeps the gathers' results live
                dQ[s, k, d] = acc[k, d]

    return memory_only


def registers_program(topk: int, scale: float):
    """The previous block's latent gradient added from the MMA registers under the next block's
    products."""
    _, T = common.load_tilelang()
    steps, half = topk // BK, BK // 2
    log2_scale = scale * common.LOG2E
    S, t = _signature(T, topk)
    FullCol = T.GemmWarpPolicy.FullCol
    operands, accumulators, load_query, gather_block, gradients, bulk_adds = _macros(T)

    @T.prim_func
    def adds_from_registers(Q: t["Q"], KV: t["KV"], dO: t["dO"], Indices: t["Indices"],
                            Lse: t["Lse"], Delta: t["Delta"], dQ: t["dQ"], dKV: t["dKV"]):
        with T.Kernel(S, threads=common.threads_for(HEADS)) as s:
            q_s, do_s, kv_s, p_s, ds_s = operands()
            lse_s = T.alloc_shared([HEADS], "float32")
            delta_s = T.alloc_shared([HEADS], "float32")
            valid, acc_p, acc_dp, acc_dq, acc_dkv = accumulators()
            load_query(Q, dO, Lse, Delta, s, q_s, do_s, lse_s, delta_s)
            T.clear(acc_dq)
            T.clear(acc_dkv)
            for kb in T.Pipelined(steps, num_stages=2):
                gather_block(KV, Indices, s, kb, valid, kv_s, acc_p)
                T.wgmma_gemm(q_s, kv_s, acc_p, transpose_B=True, policy=FullCol)
                T.wgmma_gemm(do_s, kv_s, acc_dp, transpose_B=True, policy=FullCol,
                             clear_accum=True)
                prev = T.max(kb - 1, 0) * BK
                for k, d in T.Parallel(half, R):
                    if kb > 0 and Indices[s, prev + k] >= 0:
                        T.atomic_add(dKV[Indices[s, prev + k], d], acc_dkv[k, d])
                T.wait_wgmma(0)
                gradients(p_s, ds_s, lse_s, delta_s, acc_p, acc_dp, log2_scale, scale)
                T.wgmma_gemm(ds_s, kv_s, acc_dq, policy=FullCol)
                for k, d in T.Parallel(half, R):
                    if kb > 0 and Indices[s, prev + half + k] >= 0:
                        T.atomic_add(dKV[Indices[s, prev + half + k], d], acc_dkv[half + k, d])
                T.wait_wgmma(0)
                T.gemm(ds_s, q_s, acc_dkv, transpose_A=True, policy=FullCol, clear_accum=True)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=FullCol)
            for k, d in T.Parallel(BK, R):
                if Indices[s, (steps - 1) * BK + k] >= 0:
                    T.atomic_add(dKV[Indices[s, (steps - 1) * BK + k], d], acc_dkv[k, d])
            T.copy(acc_dq, dQ[s, :, :])

    return adds_from_registers


def bulk_program(topk: int, scale: float, store_split: int, buffers: int):
    """The kernel with each staged row added by one bulk reduce; ``buffers`` staging buffers of
    BK / store_split rows."""
    _, T = common.load_tilelang()
    steps, part = topk // BK, BK // store_split
    log2_scale = scale * common.LOG2E
    S, t = _signature(T, topk)
    FullCol = T.GemmWarpPolicy.FullCol
    operands, accumulators, load_query, gather_block, gradients, bulk_adds = _macros(T)

    @T.prim_func
    def bulk_reduces(Q: t["Q"], KV: t["KV"], dO: t["dO"], Indices: t["Indices"], Lse: t["Lse"],
                     Delta: t["Delta"], dQ: t["dQ"], dKV: t["dKV"]):
        with T.Kernel(S, threads=common.threads_for(HEADS)) as s:
            T.import_source(BULK_ADD)
            tx = T.get_thread_binding()
            q_s, do_s, kv_s, p_s, ds_s = operands()
            dkv_s = T.alloc_shared([buffers * part, R], "float32")
            lse_s = T.alloc_shared([HEADS], "float32")
            delta_s = T.alloc_shared([HEADS], "float32")
            valid, acc_p, acc_dp, acc_dq, acc_dkv = accumulators()
            load_query(Q, dO, Lse, Delta, s, q_s, do_s, lse_s, delta_s)
            T.clear(acc_dq)
            for kb in T.Pipelined(steps, num_stages=2):
                gather_block(KV, Indices, s, kb, valid, kv_s, acc_p)
                T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=FullCol)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, policy=FullCol, clear_accum=True)
                gradients(p_s, ds_s, lse_s, delta_s, acc_p, acc_dp, log2_scale, scale)
                T.gemm(ds_s, kv_s, acc_dq, policy=FullCol)
                T.gemm(ds_s, q_s, acc_dkv, transpose_A=True, policy=FullCol, clear_accum=True)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=FullCol)
                bulk_adds(dKV, Indices, s, kb, tx, acc_dkv, dkv_s, store_split, part, buffers)
            if tx < part:
                T.tma_store_wait(0, read=True)
            T.copy(acc_dq, dQ[s, :, :])

    return bulk_reduces


def programs(topk: int) -> dict:
    """Row name -> (builds the program, whether its gradients are real)."""
    kernel = lambda: backward_program(HEADS, R, topk, SCALE)  # noqa: E731

    def without_atomics():
        with atomics_left_out():
            return kernel()

    return {
        "as it is": (kernel, True),
        "without its latent-gradient atomics": (without_atomics, False),
        "memory only: gathers and adds": (lambda: memory_program(topk), False),
        "memory only: gathers": (lambda: memory_program(topk, adds=None), False),
        "memory only: adds": (lambda: memory_program(topk, gathers=False), False),
        "memory only: plain stores of the adds' bytes": (
            lambda: memory_program(topk, gathers=False, adds="stores"), False),
        "memory only: adds as bulk reduces, 4 buffers of 8 rows": (
            lambda: memory_program(topk, gathers=False, adds="bulk", buffers=4), False),
        "adds from registers under the next block's products": (
            lambda: registers_program(topk, SCALE), True),
        "bulk reduces, 1 buffer of 8 rows": (lambda: bulk_program(topk, SCALE, 4, 1), True),
        "bulk reduces, 2 buffers of 4 rows": (lambda: bulk_program(topk, SCALE, 8, 2), True),
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def fractions(text: str) -> list[float]:
    """``--shared-pools``: a comma list of fractions in [0, 1]."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of fractions in [0, 1], got {text!r}")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=65536)
    p.add_argument("--keys", type=int, default=1 << 20)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    p.add_argument("--shared-pools", type=fractions, default=[0.0],
                   help="comma list: fractions of each query's pools common to its block of "
                        "1,024 neighbours (default 0: random selections)")
    a = p.parse_args()
    names = list(programs(BK))  # the names only: nothing is built yet
    unknown = [name for name in a.rows.split(",") if a.rows and name not in names]
    if unknown:
        p.error(f"unknown rows {unknown}; the rows are {names}")
    import tilelang

    dev = torch.device("cuda")
    kernels = {}
    for shared in a.shared_pools:
        gen = torch.Generator(device=dev).manual_seed(0)
        idx = pool_shaped_indices(torch.arange(a.keys - a.queries, a.keys, device=dev), gen,
                                  shared=shared)
        q = (torch.randn(a.queries, HEADS, R, generator=gen, device=dev) * 0.05).bfloat16()
        kv = torch.randn(a.keys, R, generator=gen, device=dev).bfloat16()
        grad = (torch.randn(a.queries, HEADS, R, generator=gen, device=dev) * 0.01).bfloat16()
        out, lse = interface.latent_forward(q, kv, idx, SCALE)
        delta = (out.float() * grad.float()).sum(-1)
        keys = common.pad_keys(idx.to(torch.int32), BK).contiguous()
        del idx, out
        rows = programs(keys.shape[1])
        chosen = a.rows.split(",") if a.rows else list(rows)
        if "as it is" not in chosen:
            chosen.insert(0, "as it is")  # the reference of the others' gradients
        reference = None
        for name in chosen:
            build, real = rows[name]
            if name not in kernels:
                kernels[name] = tilelang.compile(build(), out_idx=[-2])
            kernel = kernels[name]
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=dev)
            dq = kernel(q, kv, grad, keys, lse, delta, dkv)
            row = {"backward": name, "shared_pools": shared}
            if name == "as it is":
                reference = dq, dkv.clone()
            elif real:
                row.update(rel_dq=rel(dq, reference[0]), rel_dkv=rel(dkv, reference[1]))
            row["ms"] = timed(lambda: kernel(q, kv, grad, keys, lse, delta, dkv), 0, a.iters)[0]
            print(json.dumps(row), flush=True)
        del q, kv, grad, lse, delta, keys, dkv, dq, reference


if __name__ == "__main__":
    main()
