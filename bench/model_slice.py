"""Train the GLM-5.3-Flash slice on GPUs through Ray actors: tokens/s, and peak memory against
``skyrl-kda plan``'s estimate.

Each run is the ``glm53_flash_slice`` recipe (full-width layers, MoE scaled to 16 experts) with
``model.num_layers`` and ``data.seq_len`` set per run, trained for a few steps by ``train.run``
exactly as ``skyrl-kda run`` does (Ray actor per GPU, megatron DDP + distributed optimizer, fla
kernels). Tokens/s is the median of the steps after the first (which autotunes); the peak is
torch's allocator peak on the busiest rank. A run that fails (out of memory) is reported, not fatal.

Usage (on a CUDA machine with Ray):
  python bench/model_slice.py --runs 4:256,3:16384,3:32768 --json slice.json
  python bench/model_slice.py --runs 3:65536 --cp 2 --exchanges a2a,allgather,state
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


LEVERS = {
    "offload": "train.offload_activations=true",
    "loss": "train.loss_chunk_tokens=8192",
    "bf16grads": "train.grad_reduce_in_fp32=false",
    "headgroups": "kda.kernel_head_group=16",
    "moechunks": "train.moe_chunk_tokens=8192",
    "lora": "train.lora.rank=64",
    "dsatorch": "model.dsa.kernel=torch",  # for a device call that carries Ray but not TileLang
}
"""The memory levers a run spec can turn on, by name."""


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="4:256,3:16384,3:32768",
                   help="comma-separated LAYERS:SEQ_LEN[:RECOMPUTE[:LEVER...]] (4 = KDA x3 + DSA, "
                        "3 = KDA only; RECOMPUTE full (the recipe's), selective or none; LEVER: "
                        + ", ".join(f"{k} ({v})" for k, v in LEVERS.items()) + ")")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (= GPUs used)")
    p.add_argument("--exchanges", default="a2a", help="KDA CP exchanges to run (comma-separated)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("--memory-report", default=None, metavar="DIR",
                   help="write each run's first-step memory report (run.memory_report) under DIR")
    return p.parse_args()


def slice_recipe(layers: int, seq_len: int, cp: int, exchange: str, steps: int, output_dir: str,
                 recompute: str = "full", levers: tuple[str, ...] = (), memory_report: bool = False):
    from skyrl_megatron_kda.recipes import load_recipe

    return load_recipe("glm53_flash_slice", [
        f"model.num_layers={layers}", f"data.seq_len={seq_len}", f"parallel.cp={cp}",
        f"run.num_workers={cp}", f"kda.cp_exchange={exchange}", f"train.steps={steps}",
        "train.save_at_end=false", f"run.output_dir={output_dir}", f"train.recompute={recompute}",
        f"run.memory_report={str(memory_report).lower()}", *(LEVERS[name] for name in levers),
    ]).recipe


@contextlib.contextmanager
def _output_dir(keep_under: str | None, name: str):
    """The run's folder: kept under ``keep_under`` (its memory reports), else a temporary one."""
    if keep_under is None:
        with tempfile.TemporaryDirectory() as out:
            yield out
    else:
        yield os.path.join(keep_under, name)


def measure(recipe) -> dict:
    from skyrl_megatron_kda.memory import estimate_memory
    from skyrl_megatron_kda.train.run import run

    estimate = estimate_memory(recipe).total / 2**30
    try:
        lines = run(recipe, progress=None)
    except Exception as exc:  # noqa: BLE001 - an out-of-memory run is a result of this benchmark
        return {"estimate_gib": estimate, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    timed = lines[1:] or lines
    return {
        "estimate_gib": estimate,
        "peak_gib": max(line["peak_gib"] for line in lines),
        "tokens_per_s": statistics.median(line["tokens_per_s"] for line in timed),
        "step_time_s": statistics.median(line["step_time_s"] for line in timed),
        "losses": [line["loss"] for line in lines],
        "cp_bytes": lines[-1]["cp_bytes"],
    }


def main() -> None:
    args = parse_args()
    results = []
    for spec in args.runs.split(","):
        layers, seq_len, *rest = spec.split(":")
        recompute, levers = (rest[0], tuple(rest[1:])) if rest else ("full", ())
        unknown = set(levers) - set(LEVERS)
        if unknown:
            raise SystemExit(f"--runs {spec}: unknown lever(s) {sorted(unknown)}; known: {sorted(LEVERS)}")
        layers, seq_len = int(layers), int(seq_len)
        for exchange in args.exchanges.split(","):
            name = f"{layers}x{seq_len}_cp{args.cp}_{exchange}_{recompute}" + "".join(f"_{n}" for n in levers)
            with _output_dir(args.memory_report, name) as out:
                recipe = slice_recipe(layers, seq_len, args.cp, exchange, args.steps, out, recompute, levers,
                                      memory_report=args.memory_report is not None)
                log(f"{layers} layers, T={seq_len}, CP{args.cp} {exchange}, recompute {recompute}"
                    f"{''.join('+' + name for name in levers)}: training {args.steps} steps")
                row = {"layers": layers, "seq_len": seq_len, "cp": args.cp, "exchange": exchange,
                       "recompute": recompute, "levers": list(levers), **measure(recipe)}
            log(json.dumps(row))
            results.append(row)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)
    report(results)


def report(results: list[dict]) -> None:
    print("\nGLM-5.3-Flash slice, bf16, fwd+bwd+optimizer step; peak = torch allocator, busiest rank")
    print(f"{'layers':>6}{'T':>9}{'CP':>4}{'exchange':>11}{'recompute + levers':>28}{'tok/s':>10}{'s/step':>8}{'peak GiB':>10}"
          f"{'plan GiB':>10}{'plan/peak':>10}")
    for r in results:
        mode = r.get("recompute", "full") + "".join("+" + name for name in r.get("levers", ()))
        head = f"{r['layers']:>6}{r['seq_len']:>9}{r['cp']:>4}{r['exchange']:>11}{mode:>28}"
        if "error" in r:
            print(f"{head}  failed: {r['error']}  (plan {r['estimate_gib']:.1f} GiB)")
            continue
        print(f"{head}{r['tokens_per_s']:>10,.0f}{r['step_time_s']:>8.2f}{r['peak_gib']:>10.1f}"
              f"{r['estimate_gib']:>10.1f}{r['estimate_gib'] / r['peak_gib']:>10.2f}")


if __name__ == "__main__":
    main()
