"""Benchmark one GLM-5.3-Flash KDA layer on GPU: kernel floor, CP1 layer, CP2 exchanges.

Reports ratios measured in one run (never a lone absolute time):
- layer / floor, where floor = fla ``chunk_kda`` alone at the rank's head share + the rank's
  projection GEMM FLOPs at 790 TFLOP/s (the H200's measured bf16 GEMM ceiling);
- CP1 / CP2 time per exchange (real NCCL run when 2 GPUs are visible);
- peak memory per rank vs CP1.

Usage (on a CUDA machine):  python bench/kda_layer.py --tokens 262144 --json out.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from skyrl_megatron_kda.kda.calibration import GEMM_FLOP_PER_S
_T0 = time.time()


def log(msg: str) -> None:
    """Progress line with elapsed seconds (the first calls spend minutes in Triton autotuning)."""
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=262144, help="sequence length T (one sequence)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8, help="KDA heads on the rank (8 = GLM's TP8 share)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--low-rank", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--exchanges", default="a2a,allgather,state")
    p.add_argument("--segments", type=int, default=16, help="segments of the state-passing kernel")
    p.add_argument("--skip-layer", action="store_true", help="kernel-level rows only (no layers)")
    p.add_argument("--skip-recurrence", action="store_true",
                   help="no CP2 recurrence-alone rows (state exchange, fla cp_context)")
    p.add_argument("--emulate-cp2", action="store_true",
                   help="with one GPU: run each CP2 rank's work on it in turn, no data crossing GPUs "
                        "(torch's fake process group, which still copies the local shard into every "
                        "slot of an all-gather); the report adds the cost model's comm time")
    p.add_argument("--json", default=None, help="write all measurements here")
    p.add_argument("--profile", action="store_true",
                   help="only profile the CP1 layer and print the top CUDA kernels")
    p.add_argument("--profile-cp2", action="store_true",
                   help="also print the top CUDA kernels of each CP2 exchange on each rank")
    p.add_argument("--profile-dir", default=None,
                   help="write each profile's whole per-kernel table here (profile_<label>.txt), "
                        "and the torch ops of one step with their input shapes (ops_<label>.txt), "
                        "instead of printing its top rows")
    p.add_argument("--stack-dump-after", type=float, default=900, help="seconds; print stacks if still running")
    return p.parse_args()


def _recipe(args, exchange: str, cp: int, segments: int):
    from skyrl_megatron_kda.config import MeshRecipe

    return MeshRecipe(
        model={"hidden_size": args.hidden, "params_dtype": "bfloat16"},
        parallel={"tp": 1, "cp": cp},
        kda={"cp_exchange": exchange, "kernel": "fla", "num_heads": args.heads, "kernel_segments": segments,
             "head_dim": args.head_dim, "gate_low_rank": args.low_rank,
             "output_gate_low_rank": args.low_rank},
        data={"seq_len": args.tokens},
    )


def projection_flops(args, exchange: str, cp: int) -> float:
    """Forward+backward GEMM FLOPs of one rank: the cost model's count (one definition)."""
    from skyrl_megatron_kda.kda.cost import projection_flops as flops
    from skyrl_megatron_kda.kda.exchanges import ExchangeShape

    shape = ExchangeShape.of(_recipe(args, exchange, cp, args.segments))
    return flops(exchange, shape, (args.low_rank, args.low_rank))


def timed(fn, warmup: int, iters: int) -> tuple[float, float]:
    """Median milliseconds of ``fn`` and peak GiB allocated during the timed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def attempt(label: str, build, args):
    """``timed(build())`` or None when the shape does not fit or the path fails: one failed row
    is logged and the rest of the (expensive) device run goes on."""
    try:
        return timed(build(), args.warmup, args.iters)
    except Exception as exc:  # noqa: BLE001 - reported, never hidden
        log(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return None
    finally:
        torch.cuda.empty_cache()


def kernel_fwd_bwd(args, heads: int, tokens: int):
    from skyrl_megatron_kda.kda.kernel import kda

    leaves, do = _kda_leaves(args, heads, tokens)
    return _backward_step(lambda *t: kda(*t, lower_bound=-5.0, backend="fla")[0], leaves, do)


def _kda_leaves(args, heads: int, tokens: int):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g).requires_grad_()

    K = args.head_dim
    q, k, v, f = (leaf(1, tokens, heads, K) for _ in range(4))
    b = leaf(1, tokens, heads)
    a_log = torch.rand(heads, device=dev).mul(15).add(1).log().requires_grad_()
    dt_bias = leaf(heads * K, dtype=torch.float32)
    do = torch.randn(1, tokens, heads, K, device=dev, dtype=torch.bfloat16, generator=g)
    return (q, k, v, f, b, a_log, dt_bias), do


def _backward_step(run, leaves, do):
    def step():
        run(*leaves).backward(do)
        for t in leaves:
            t.grad = None

    return step


def segmented_fwd_bwd(args, heads: int, tokens: int):
    """One whole sequence through the state-passing kernel cut into segments (no CP)."""
    from skyrl_megatron_kda.kda.state_kernel import IsolatedPieces, state_passing_kda

    leaves, do = _kda_leaves(args, heads, tokens)
    cu = torch.tensor([0, tokens], device="cuda")
    return _backward_step(lambda *t: state_passing_kda(*t, piece_cu=cu, link=IsolatedPieces(), lower_bound=-5.0,
                                                       backend="fla", segments=args.segments), leaves, do)


def state_recurrence_fwd_bwd(args, tp_group, cp_group):
    """This CP rank's KDA recurrence under the state exchange (its shard, all heads), real NCCL."""
    from skyrl_megatron_kda.kda.exchanges import CommLedger, ExchangeGroups, KernelArgs, StateExchange
    from skyrl_megatron_kda.distributed.cp_layout import BatchIndexMaps

    cp = cp_group.size()
    exchange = StateExchange(ExchangeGroups(tp=tp_group, cp=cp_group, sequence_parallel=False), CommLedger())
    layout = BatchIndexMaps.build(torch.tensor([0, args.tokens], device="cuda"), cp, 1, packed=False)
    leaves, do = _kda_leaves(args, args.heads, args.tokens // cp)
    kernel = KernelArgs(backend="fla", lower_bound=-5.0, l2norm_eps=1e-6, chunk_size=64,
                        segments=args.segments)
    return _backward_step(lambda *t: exchange.recurrence(*t, layout, kernel), leaves, do)


def cp_context_fwd_bwd(args, cp_group):
    """The baseline: fla 0.6.0's own CP state passing (``chunk_kda(cp_context=...)``) on this
    rank's contiguous shard, with the same in-kernel gate, L2 norm and beta as ours."""
    from fla.ops.cp import build_cp_context
    from fla.ops.kda import chunk_kda

    context = build_cp_context(torch.tensor([0, args.tokens], device="cuda", dtype=torch.long), group=cp_group)
    leaves, do = _kda_leaves(args, args.heads, args.tokens // cp_group.size())

    def run(q, k, v, f, b, a_log, dt_bias):
        return chunk_kda(q, k, v, f, b, A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=-5.0, cu_seqlens=context.cu_seqlens, cp_context=context)[0]

    return _backward_step(run, leaves, do)


def layer_fwd_bwd(args, exchange: str, tp_group, cp_group, segments: int | None = None):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from skyrl_megatron_kda.kda.exchanges import CommLedger
    from skyrl_megatron_kda.kda.layer import KDASubmodules, KimiDeltaAttention
    from skyrl_megatron_kda.distributed.cp_layout import zigzag_positions
    from skyrl_megatron_kda.megatron_config import transformer_config

    cp = cp_group.size()
    recipe = _recipe(args, exchange, cp, args.segments if segments is None else segments)
    torch.manual_seed(0)
    ledger = CommLedger()
    layer = KimiDeltaAttention(
        transformer_config(recipe, use_cpu=False, initialize=False), KDASubmodules(),
        layer_number=1, kda=recipe.kda, cp_layout=recipe.parallel.cp_layout,
        pg_collection=ProcessGroupCollection(tp=tp_group, cp=cp_group),
        ledger=ledger,
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        layer.A_log.uniform_(0, 2.7)
        layer.o_norm_weight.fill_(1.0)
    rows = zigzag_positions(torch.tensor([0, args.tokens], device="cuda"), cp)[cp_group.rank()]
    x = torch.randn(rows.numel(), 1, args.hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)

    def step():
        out, _ = layer(x)
        out.backward(dy)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    return step, ledger


def _keep_ledger(step_and_ledger, ledgers: list):
    step, ledger = step_and_ledger
    ledgers.append(ledger)
    return step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cp2_rank(rank: int, port: int, args, queue, emulated: bool = False) -> None:
    """One CP2 rank. ``emulated``: on GPU 0 with torch's fake process group, whose collectives
    do nothing: the rank's own work (kernels, GEMMs, copies) at its real shapes, no traffic."""
    faulthandler.dump_traceback_later(args.stack_dump_after, exit=False)
    if emulated:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.cuda.set_device(0)
        dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    single = [dist.new_group([r]) for r in range(2)][rank]
    cp_group = dist.new_group([0, 1])
    out = {}
    if "state" in args.exchanges.split(",") and not args.skip_recurrence:
        ms, gib = timed(state_recurrence_fwd_bwd(args, single, cp_group), args.warmup, args.iters)
        log(f"rank {rank} CP2 state recurrence alone: {ms:.1f} ms, {gib:.1f} GiB")
        out["state_recurrence"] = {"ms": ms, "peak_gib": gib}
        torch.cuda.empty_cache()
        # fla's cp_context needs real collectives to index its shards (not run when emulated).
        got = None if emulated else attempt(f"rank {rank} CP2 fla cp_context recurrence",
                                            lambda: cp_context_fwd_bwd(args, cp_group), args)
        if got:
            log(f"rank {rank} CP2 fla cp_context recurrence: {got[0]:.1f} ms, {got[1]:.1f} GiB")
            out["cp_context"] = {"ms": got[0], "peak_gib": got[1]}
    for exchange in ([] if args.skip_layer else args.exchanges.split(",")):
        ledgers = []
        got = attempt(f"rank {rank} CP2 {exchange}",
                      lambda: _keep_ledger(layer_fwd_bwd(args, exchange, single, cp_group), ledgers), args)
        if got:
            log(f"rank {rank} CP2 {exchange}: {got[0]:.1f} ms, {got[1]:.1f} GiB")
            calls = args.warmup + args.iters
            out[exchange] = {"ms": got[0], "peak_gib": got[1],
                             "cp_bytes_fwd_per_step": ledgers[0].received("cp", "fwd") // calls}
            if args.profile_cp2:
                profile_step(args, f"CP2 {exchange}, rank {rank}",
                             layer_fwd_bwd(args, exchange, single, cp_group)[0])
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    faulthandler.dump_traceback_later(args.stack_dump_after, exit=False)
    port = _free_port()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    single = dist.new_group([0])
    if args.profile:
        profile_cp1(args, single)
        dist.destroy_process_group()
        return
    # The output paths stay out of the record: they name folders of the machine that ran it.
    results = {"args": {**vars(args), "json": None, "profile_dir": None}, "gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}

    # The floors: all heads on the whole sequence (CP1), half the heads on it (the head-parallel
    # CP2 share) and, for state, all heads on half the sequence (the local shard).
    shapes = [(args.heads, args.tokens), (args.heads // 2, args.tokens)]
    if "state" in args.exchanges.split(","):
        shapes.append((args.heads, args.tokens // 2))
    for heads, tokens in shapes:
        ms, gib = timed(kernel_fwd_bwd(args, heads, tokens), args.warmup, args.iters)
        results[_kernel_key(heads, tokens, args)] = {"ms": ms, "peak_gib": gib}
        log(f"kernel alone, {heads} heads, T={tokens}: {ms:.1f} ms, {gib:.1f} GiB")
        torch.cuda.empty_cache()
    for heads, tokens in shapes:
        ms, gib = timed(segmented_fwd_bwd(args, heads, tokens), args.warmup, args.iters)
        results["segmented_" + _kernel_key(heads, tokens, args)] = {"ms": ms, "peak_gib": gib}
        log(f"state-passing kernel, {args.segments} segments, {heads} heads, T={tokens}: {ms:.1f} ms")
        torch.cuda.empty_cache()
    if not args.skip_layer:
        got = attempt("layer CP1", lambda: layer_fwd_bwd(args, "a2a", single, single)[0], args)
        if got:
            results["layer_cp1"] = {"ms": got[0], "peak_gib": got[1]}
            log(f"layer CP1: {got[0]:.1f} ms, {got[1]:.1f} GiB")
        if args.segments > 1:
            got = attempt("layer CP1, whole-sequence kernel",
                          lambda: layer_fwd_bwd(args, "a2a", single, single, segments=1)[0], args)
            if got:
                results["layer_cp1_whole"] = {"ms": got[0], "peak_gib": got[1]}
                log(f"layer CP1, whole-sequence kernel (kernel_segments=1): {got[0]:.1f} ms, {got[1]:.1f} GiB")
    dist.destroy_process_group()

    results["cp2_emulated"] = torch.cuda.device_count() < 2
    if torch.cuda.device_count() >= 2 or args.emulate_cp2:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        cp2_port = _free_port()
        procs = [ctx.Process(target=_cp2_rank, args=(r, cp2_port, args, queue, results["cp2_emulated"]))
                 for r in range(2)]
        per_rank = {}
        if results["cp2_emulated"]:  # one rank after the other on the one GPU
            for p in procs:
                p.start()
                per_rank.update([queue.get()])
                p.join()
        else:
            for p in procs:
                p.start()
            per_rank = dict(queue.get() for _ in procs)
            for p in procs:
                p.join()
        if "state_recurrence" in per_rank[0]:
            results["state_recurrence_cp2"] = {"ms": max(per_rank[r]["state_recurrence"]["ms"] for r in per_rank)}
            if all("cp_context" in per_rank[r] for r in per_rank):
                results["cp_context_cp2"] = {"ms": max(per_rank[r]["cp_context"]["ms"] for r in per_rank)}
        for exchange in ([] if args.skip_layer else args.exchanges.split(",")):
            if not all(exchange in per_rank[r] for r in per_rank):
                continue
            results[f"layer_cp2_{exchange}"] = {
                "ms": max(per_rank[r][exchange]["ms"] for r in per_rank),
                "peak_gib": max(per_rank[r][exchange]["peak_gib"] for r in per_rank),
                "cp_bytes_fwd": per_rank[0][exchange]["cp_bytes_fwd_per_step"],
            }
    report(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def profile_cp1(args, group) -> None:
    """Where the CP1 layer's fwd+bwd time goes, by CUDA kernel (after the warm-up steps)."""
    profile_step(args, "CP1", layer_fwd_bwd(args, "a2a", group, group)[0])


def profile_step(args, label: str, step) -> None:
    """CUDA kernels of ``step`` over ``args.iters`` calls, after the warm-up steps: the top rows
    printed, or every row written under ``args.profile_dir`` (the cost model's calibration reads
    whole tables: a cut table leaves time out)."""
    ms, _ = timed(step, args.warmup, 1)
    log(f"layer {label}: {ms:.1f} ms; profiling {args.iters} steps")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    if args.profile_dir is None:
        print(averages.table(sort_by="cuda_time_total", row_limit=100, max_name_column_width=60))
        return
    name = re.sub(r"[^0-9A-Za-z]+", "_", label).strip("_").lower()
    path = os.path.join(args.profile_dir, f"profile_{name}_T{args.tokens}.txt")
    os.makedirs(args.profile_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# {label}, T={args.tokens}, {args.heads} heads, {args.iters} profiled steps "
                f"after {args.warmup} warm-up and one timed; layer {ms:.1f} ms per step\n")
        f.write(averages.table(sort_by="cuda_time_total", row_limit=-1, max_name_column_width=60))
    log(f"wrote {path}")
    write_op_table(args, label, name, step)


def write_op_table(args, label: str, name: str, step) -> None:
    """The torch ops of one ``step`` by their own CUDA time, with their input shapes: which op
    launched a copy, which the kernel table cannot tell. A separate pass, so that the kernel
    table holds CUDA kernels alone."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    path = os.path.join(args.profile_dir, f"ops_{name}_T{args.tokens}.txt")
    with open(path, "w") as f:
        f.write(f"# {label}, T={args.tokens}: aten ops of one step by their own CUDA time (us), with input shapes\n")
        for e in ops[:60]:
            f.write(f"{e.self_device_time_total:10.0f} {e.count:4d}  {e.key:28s} {e.input_shapes}\n")
    log(f"wrote {path}")


def _kernel_key(heads: int, tokens: int, args) -> str:
    return f"kernel_{heads}h" if tokens == args.tokens else f"kernel_{heads}h_T{tokens}"


def _model(args, exchange: str, cp: int):
    """The cost model's estimate (``kda/cost.py``) for this shape inside one node (NVLink)."""
    from skyrl_megatron_kda.config import ClusterConfig
    from skyrl_megatron_kda.kda.cost import estimate
    from skyrl_megatron_kda.kda.exchanges import ExchangeShape

    shape = ExchangeShape.of(_recipe(args, exchange, cp, args.segments))
    return estimate(exchange, shape, False, ClusterConfig(), gate_ranks=(args.low_rank, args.low_rank))


def model_ms(args, exchange: str, cp: int) -> float:
    """The model's forward+backward milliseconds (its floor of the layer)."""
    return _model(args, exchange, cp).total_s * 1e3


def model_comm_ms(args, exchange: str) -> float:
    """The model's CP communication milliseconds of one CP2 rank, fwd+bwd (added to emulated rows)."""
    return _model(args, exchange, 2).cp_comm_s * 1e3


def report_kernels(args, results) -> None:
    """The recurrence alone: fla chunk_kda, the segmented state-passing kernel, CP2 state per rank."""
    T, H = args.tokens, args.heads
    whole = results[_kernel_key(H, T, args)]["ms"]
    local = results.get(_kernel_key(H, T // 2, args), {}).get("ms")
    print(f"\nKDA recurrence fwd+bwd, {H} heads x {args.head_dim}, bf16")
    print(f"{'run':<44}{'ms':>9}{'vs chunk_kda T':>16}{'vs local floor':>16}")
    rows = [(f"fla chunk_kda, T={T} (one GPU)", whole),
            (f"ours segmented ({args.segments}), T={T} (one GPU)", results.get("segmented_" + _kernel_key(H, T, args), {}).get("ms"))]
    if local is not None:
        rows += [(f"fla chunk_kda, T={T // 2} (local-shard floor)", local),
                 (f"ours segmented ({args.segments}), T={T // 2}",
                  results.get("segmented_" + _kernel_key(H, T // 2, args), {}).get("ms")),
                 ("CP2 state exchange recurrence, per rank", results.get("state_recurrence_cp2", {}).get("ms")),
                 ("CP2 fla cp_context recurrence, per rank", results.get("cp_context_cp2", {}).get("ms"))]
    for name, ms in rows:
        if ms is None:
            continue
        vs_local = f"{ms / local:>16.2f}" if local else f"{'':>16}"
        print(f"{name:<44}{ms:>9.1f}{ms / whole:>16.2f}{vs_local}")


def report(args, results) -> None:
    report_kernels(args, results)
    if "layer_cp1" not in results:
        return
    cp1 = results["layer_cp1"]
    floor1 = results[_kernel_key(args.heads, args.tokens, args)]["ms"] + projection_flops(args, "a2a", 1) / GEMM_FLOP_PER_S * 1e3
    rows = [("CP1 layer", cp1["ms"], floor1, 1.0, cp1["peak_gib"], model_ms(args, "a2a", 1))]
    if "layer_cp1_whole" in results:
        whole = results["layer_cp1_whole"]
        rows.append(("CP1, 1 segment", whole["ms"], floor1, cp1["ms"] / whole["ms"], whole["peak_gib"],
                     model_ms(args, "a2a", 1)))
    emulated = results.get("cp2_emulated", False)
    for exchange in args.exchanges.split(","):
        r = results.get(f"layer_cp2_{exchange}")
        if r is None:
            continue
        heads, tokens = (args.heads, args.tokens // 2) if exchange == "state" else (args.heads // 2, args.tokens)
        floor = results[_kernel_key(heads, tokens, args)]["ms"] + projection_flops(args, exchange, 2) / GEMM_FLOP_PER_S * 1e3
        comm = model_comm_ms(args, exchange) if emulated else 0.0
        rows.append((f"CP2 {exchange}", r["ms"] + comm, floor, cp1["ms"] / (r["ms"] + comm), r["peak_gib"],
                     model_ms(args, exchange, 2)))
        r["comm_ms_modeled"] = comm
    print(f"\nKDA layer fwd+bwd, T={args.tokens}, {args.heads} heads x {args.head_dim}, hidden {args.hidden}, bf16")
    if emulated:
        print("CP2 rows: one rank's work measured on one GPU (fake process group: no data crosses GPUs) "
              "+ the cost model's NVLink comm time for that exchange")
    print(f"{'run':<16}{'ms':>9}{'floor ms':>10}{'x floor':>9}{'speedup vs CP1':>16}{'peak GiB':>10}"
          f"{'mem vs CP1':>11}{'model ms':>10}")
    for name, ms, floor, speedup, gib, predicted in rows:
        print(f"{name:<16}{ms:>9.1f}{floor:>10.1f}{ms / floor:>9.2f}{speedup:>16.2f}{gib:>10.1f}"
              f"{gib / cp1['peak_gib']:>11.2f}{predicted:>10.1f}")
    cp2 = [row for row in rows if row[0].startswith("CP2")]
    if len(cp2) > 1:
        measured = [row[0] for row in sorted(cp2, key=lambda row: row[1])]
        predicted = [row[0] for row in sorted(cp2, key=lambda row: row[5])]
        verdict = "same" if measured == predicted else "DIFFERENT"
        print(f"ranking, fastest first: measured {measured}; cost model {predicted} ({verdict})")
    elif torch.cuda.device_count() < 2:
        print("(CP2 rows need 2 GPUs, or --emulate-cp2 on one)")


if __name__ == "__main__":
    main()
