"""Each part of a recipe's step on one GPU: the whole training step, and every layer type on its
own (mHC, attention, MLP/MoE, embedding, head + loss, optimizer, host-offload copies), for the
time model of ``skyrl-kda plan`` (``skyrl_megatron_kda/steptime``).

One process, one rank (torch.distributed over NCCL with a world of one), the trainer
``skyrl-kda run`` puts in each Ray actor (``train.trainer.RankTrainer``) built from the recipe
with its levers; Ray itself is left out (its wheel does not fit what a device call carries, and
it only hosts the trainer). Then:

* ``step``: ``--steps`` training steps after one warm-up step, the trainer's own step time
  (median), with the gradient reduction + optimizer step timed inside it;
* ``parts``: each decoder layer's pieces called on random inputs, as the step runs them under
  the layer's recompute setting (``full``: a forward without grad, then a forward with grad and
  its backward; ``none``: forward and backward): both mHC modules of the layer (maps, Sinkhorn,
  projection, expand), the attention block (its norm + KDA or DSA; DSA keeps its selection for
  the recompute as the step does), the MLP block (norm + dense MLP or MoE); then the embedding
  and the head with the loss (the recipe's chunked loss or the whole logits) forward+backward;
  and the host-offload copies (a layer input, device -> pinned host -> device).

``--rows PART=N`` feeds a part N rows instead of the recipe's: a rank's share of a large recipe
on one GPU is a small recipe whose layers have the rank's widths (heads, experts, FFN columns)
fed the rank's rows (docs/step_time.md gives the share recipes of the 1M recipe).

``--parts moe`` times the first MoE layer's MLP block only (pre-MLP norm + the MoE layer, whose
token dispatcher is ``model.moe.dispatcher``): its forward without grad (full recompute's first
pass), its forward with grad and its backward each on their own, and their sum as the step runs
them; ``--compare-moe A.json B.json`` prints B's times over A's (two dispatchers, same card).

Usage (CUDA):  python3 bench/rank_share.py --set data.seq_len=32768 --steps 2 --json out.json
               python3 bench/rank_share.py --steps 0 --parts moe --rows moe=131072 --json moe.json
               python3 bench/rank_share.py --recipe glm53_flash_tiny --cpu   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

_T0 = time.time()

# CUDA's allocator as the trainer's Ray actors run it (workers/group.ALLOCATOR_CONF; that module
# imports Ray, which the GPU machine lacks): with fixed segments the full-width slice at 131,072
# tokens runs out of memory in backward (bench/results/h200_step_time_slices/). Read at the first
# CUDA allocation, so setting it here is in time.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

SLICE_ONE_GPU = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.etp=1",
                 "parallel.sequence_parallel=false", "run.num_workers=1", "train.save_at_end=false"]
"""What makes any recipe one rank on one device."""


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="glm53_flash_slice")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=2, help="timed training steps (0: parts only)")
    p.add_argument("--iters", type=int, default=2, help="timed calls of each part (after one warm-up)")
    p.add_argument("--rows", action="append", default=[], metavar="PART=N",
                   help="rows fed to a part (mhc, mlp, dense, moe, attention, head)")
    p.add_argument("--layers", default=None, help="layer indices to time (default: one of each kind)")
    p.add_argument("--no-parts", action="store_true",
                   help="time the training steps only (a comparison of whole steps)")
    p.add_argument("--parts", choices=("all", "moe"), default="all",
                   help="all: every part of one layer of each kind; moe: the MoE block only, "
                        "forward and backward timed apart")
    p.add_argument("--compare-moe", nargs=2, default=None, metavar=("BASE.json", "OTHER.json"),
                   help="no run: OTHER's MoE block times over BASE's (two --parts moe runs)")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo (a smoke run)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class Clock:
    """Wall seconds of a call with the device drained before and after it."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, iters: int) -> dict:
        fn()  # warm-up (autotuning, TileLang compiles, allocator growth)
        self.sync()
        times, peak = [], 0.0
        for _ in range(max(1, iters)):
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
            if self.cuda:
                peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
        return {"s": statistics.median(times), "peak_gib_above": peak}


def as_recompute_step(run, recompute: str):
    """``run(grad)`` returns the outputs to differentiate; the step's pattern for that part."""
    def step():
        if recompute == "full":
            with torch.no_grad():
                run(False)
        outs = run(True)
        outs = [o for o in outs if o is not None and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) * 1e-3 for o in outs])
    return step


def leaf(shape, device, dtype, grad=True):
    return (torch.randn(shape, device=device, dtype=torch.float32) * 0.5).to(dtype).requires_grad_(grad)


def layer_terms(recipe, index: int) -> dict[str, dict[str, float]]:
    """What ``skyrl-kda plan`` says of each part of layer ``index`` at the recipe's own rows: the
    step-time model's seconds (this layer's share of its part) and the memory plan's
    kept-activation term (the measured peak of a part adds its backward's working set). A DSA
    kernel without measured rates (torch, the CPU path) has no model seconds: ``model_s`` is
    None and ``model_not_priced`` says why."""
    from skyrl_megatron_kda.memory.blocks import mhc_activation_bytes
    from skyrl_megatron_kda.memory.layers import attention_activation_bytes, mlp_activation_bytes
    from skyrl_megatron_kda.steptime import model as stm

    m = recipe.model
    kind = m.layer_types()[index]
    unpriced = stm.unpriced_dsa_kernel(recipe) if kind == "dsa" else None
    if unpriced is None:
        attention = {"kda": stm.kda_part, "dsa": stm.dsa_part}[kind](recipe)
        modelled = {"model_s": attention.compute_s / attention.layers}
    else:
        modelled = {"model_s": None, "model_not_priced": unpriced}
    mlp = {"dense": stm.dense_part, "moe": stm.moe_part}[m.mlp_types()[index]](recipe)
    return {
        "attention_part": {**modelled,
                           "plan_kept_gib": attention_activation_bytes(recipe, index) / 2**30},
        "mlp_part": {"model_s": mlp.compute_s / mlp.layers,
                     "plan_kept_gib": mlp_activation_bytes(recipe, index) / 2**30},
        "mhc": {"model_s": stm.mhc_part(recipe).compute_s / m.num_layers,
                "plan_kept_gib": mhc_activation_bytes(recipe) / 2**30},
    }


def layer_parts(trainer, index: int, rows: dict, clock: Clock, iters: int, packed, s_local: int) -> dict:
    model = trainer.model.module
    layer = model.layers[index]
    recipe = trainer.recipe
    D, N = recipe.model.hidden_size, recipe.model.hyper_connections.num_streams
    dev = next(model.parameters()).device
    dtype = torch.bfloat16 if recipe.model.params_dtype == "bfloat16" else torch.float32
    out = {"layer": index, "attention": layer.layer_type, "mlp": layer.mlp_type,
           "recompute": layer.recompute}

    n_hc = rows.get("mhc", s_local)
    streams = leaf((n_hc, 1, N, D), dev, dtype)
    block = leaf((n_hc, 1, D), dev, dtype)

    def mhc(grad):
        with torch.set_grad_enabled(grad):
            x, post, comb = layer.attn_hc(streams)
            return [x, layer.attn_hc.expand(block, streams, post, comb)]
    # Both mHC modules of the layer (attn_hc, ffn_hc) have the same shapes: one timed, twice.
    t = clock.time(as_recompute_step(mhc, layer.recompute), iters)
    out["mhc"] = {"rows": n_hc, "s": 2 * t["s"], "peak_gib_above": t["peak_gib_above"]}

    x_att = leaf((s_local, 1, D), dev, dtype)
    kept = layer.kept_selection()

    def attention(grad):
        with torch.set_grad_enabled(grad):
            return [layer._attention(x_att, packed, kept)]
    t = clock.time(as_recompute_step(attention, layer.recompute), iters)
    out["attention_part"] = {"rows": s_local, **t}

    n_mlp = rows.get(layer.mlp_type, rows.get("mlp", s_local))
    x_mlp = leaf((n_mlp, 1, D), dev, dtype)

    def mlp(grad):
        with torch.set_grad_enabled(grad):
            o, bias = layer.mlp(layer.pre_mlp_layernorm(x_mlp))
            return [o if bias is None else o + bias]
    t = clock.time(as_recompute_step(mlp, layer.recompute), iters)
    out["mlp_part"] = {"rows": n_mlp, **t}
    # The plan's numbers for the parts that ran at the recipe's own rows (not --rows-fed ones).
    for part, terms in layer_terms(recipe, index).items():
        if out[part]["rows"] == s_local:
            out[part].update(terms)
    return out


def head_part(trainer, rows: dict, clock: Clock, iters: int, s_local: int) -> dict:
    from skyrl_megatron_kda.model import head

    model = trainer.model.module
    recipe = trainer.recipe
    dev = next(model.parameters()).device
    dtype = torch.bfloat16 if recipe.model.params_dtype == "bfloat16" else torch.float32
    n = rows.get("head", s_local)
    hidden = leaf((n, 1, recipe.model.hidden_size), dev, dtype)
    labels = torch.randint(0, recipe.model.vocab_size, (n, 1), device=dev)
    tp_group = trainer.pgs.tp

    def run():
        h = model.final_norm(hidden)
        if model.loss_chunk_tokens is not None:
            logp, _ = head.chunked_logprobs(h, model._vocab_weight(), labels, chunk=model.loss_chunk_tokens,
                                            tp_group=tp_group, sequence_parallel=False)
        else:
            logits, _ = model.output_layer(h, weight=model._output_weight())
            logp, _ = head.logprobs_from_logits(logits, labels, tp_group=tp_group)
        (-logp.float()).sum().backward()
    return {"rows": n, "chunk": model.loss_chunk_tokens, **clock.time(run, iters)}


def embedding_part(trainer, clock: Clock, iters: int, tokens) -> dict:
    model = trainer.model.module

    def run():
        e = model.embedding(tokens)
        (e.float() * 1e-3).sum().backward()
    return {"rows": int(tokens.numel()), **clock.time(run, iters)}


def offload_part(trainer, rows: dict, clock: Clock, iters: int, s_local: int) -> dict:
    """A layer input (the tensor full recompute keeps) to pinned host memory and back, as
    ``model/host_offload.py`` copies it; GiB/s each way."""
    recipe = trainer.recipe
    if not clock.cuda:
        return {}
    nbytes = rows.get("offload", s_local) * recipe.model.hyper_connections.num_streams * recipe.model.hidden_size * 2
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    d2h = clock.time(lambda: host.copy_(x), iters)
    h2d = clock.time(lambda: x.copy_(host), iters)
    return {"bytes": nbytes, "d2h_gib_s": nbytes / 2**30 / d2h["s"], "h2d_gib_s": nbytes / 2**30 / h2d["s"],
            "d2h_s": d2h["s"], "h2d_s": h2d["s"]}


def timed_steps(trainer, steps: int, clock: Clock) -> dict:
    """The trainer's steps, with its gradient reduction and optimizer step timed inside."""
    spent = {"finalize_s": [], "optimizer_s": []}

    def timed(name, fn):
        def call(*a, **kw):
            clock.sync()
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            clock.sync()
            spent[name].append(time.perf_counter() - t0)
            return result
        return call
    trainer.finalize_grads = timed("finalize_s", trainer.finalize_grads)
    trainer.optimizer_step = timed("optimizer_s", trainer.optimizer_step)
    lines = [trainer.train_step() for _ in range(steps + 1)]
    timed_lines = lines[1:]
    return {
        "step_s": statistics.median(line["step_time_s"] for line in timed_lines),
        "step_s_all": [line["step_time_s"] for line in lines],
        "tokens": lines[-1]["tokens"],
        "tokens_per_s": lines[-1]["tokens"] / statistics.median(line["step_time_s"] for line in timed_lines),
        "finalize_s": statistics.median(spent["finalize_s"][1:]),
        "optimizer_s": statistics.median(spent["optimizer_s"][1:]),
        "peak_gib": None if not clock.cuda else torch.cuda.max_memory_allocated() / 2**30,
        "losses": [line["loss"] for line in lines],
    }


def parts_sum(recipe, result: dict) -> float:
    """The step from its parts: each layer as the timed layer of its (attention, MLP) kind, the
    embedding, the head with the loss, the gradient reduction and the optimizer step (host-offload
    copies not added: they run inside the timed layers' forward and backward only in the step)."""
    timed = {(x["attention"], x["mlp"]): x for x in result["layers"]}
    total = 0.0
    for kind in zip(recipe.model.layer_types(), recipe.model.mlp_types()):
        if kind not in timed:
            raise ValueError(f"no timed layer of kind {kind}: pass --layers with one of each")
        x = timed[kind]
        total += x["mhc"]["s"] + x["attention_part"]["s"] + x["mlp_part"]["s"]
    step = result["step"]
    return total + result["embedding"]["s"] + result["head"]["s"] + step["finalize_s"] + step["optimizer_s"]


def default_layers(recipe) -> list[int]:
    """One layer of each (attention, MLP) kind, the first of each."""
    seen, out = set(), []
    for i, kind in enumerate(zip(recipe.model.layer_types(), recipe.model.mlp_types())):
        if kind not in seen:
            seen.add(kind)
            out.append(i)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.compare_moe:
        return compare_moe(*args.compare_moe, args.json)
    from skyrl_megatron_kda.memory import estimate_memory
    from skyrl_megatron_kda.recipes import load_recipe
    from skyrl_megatron_kda.train.trainer import RankTrainer

    cuda = not args.cpu
    out_dir = tempfile.mkdtemp(prefix="rank_share_")
    overrides = [*SLICE_ONE_GPU, f"run.output_dir={out_dir}", f"train.steps={max(args.steps + 1, 1)}",
                 f"run.device={'gpu' if cuda else 'cpu'}", *args.overrides]
    loaded = load_recipe(args.recipe, overrides)
    recipe = loaded.recipe
    rows = {k: int(v) for k, v in (r.split("=") for r in args.rows)}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    else:  # megatron asks for the CUDA device in places; a CPU rank answers with the CPU
        from skyrl_megatron_kda.distributed.cpu import redirect_cuda_device_queries
        redirect_cuda_device_queries()
    clock = Clock(cuda)
    log(f"{args.recipe} {' '.join(args.overrides)}: building the trainer")
    trainer = RankTrainer(recipe)
    result = {"recipe": args.recipe, "overrides": args.overrides, "rows": rows,
              "seq_len": recipe.data.seq_len, "plan_gib": estimate_memory(recipe).total / 2**30,
              "choices": dict(loaded.choices)}
    if args.steps > 0:
        log(f"training {args.steps} timed steps after one warm-up")
        result["step"] = timed_steps(trainer, args.steps, clock)
        log(json.dumps(result["step"]))
    if args.no_parts:
        pass
    elif args.parts == "moe":
        result["moe_block"] = moe_block_part(trainer, rows, clock, args.iters)
        log(json.dumps(result["moe_block"]))
    else:
        time_parts(trainer, recipe, args, rows, clock, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    trainer.close()
    dist.destroy_process_group()
    return result


def time_parts(trainer, recipe, args, rows: dict, clock: Clock, result: dict) -> None:
    """Each layer kind's parts, the embedding, the head and the offload copies, into ``result``."""
    row = trainer.loader.next_row()
    shard = trainer.shard(row)
    tokens, _, packed = trainer.model_inputs(shard)
    s_local = tokens.shape[1]
    trainer.model.zero_grad_buffer()
    indices = ([int(i) for i in args.layers.split(",")] if args.layers else default_layers(recipe))
    result["layers"] = []
    for i in indices:
        part = layer_parts(trainer, i, rows, clock, args.iters, packed, s_local)
        log(json.dumps(part))
        result["layers"].append(part)
        trainer.model.zero_grad_buffer()
    result["embedding"] = embedding_part(trainer, clock, args.iters, tokens)
    result["head"] = head_part(trainer, rows, clock, args.iters, s_local)
    result["offload"] = offload_part(trainer, rows, clock, args.iters, s_local)
    if args.steps > 0 and not rows:
        result["parts_sum_s"] = parts_sum(recipe, result)
    log(json.dumps({k: result[k] for k in ("embedding", "head", "offload")}))


def moe_block_part(trainer, rows: dict, clock: Clock, iters: int) -> dict:
    """The first MoE layer's MLP block (pre-MLP norm + MoE layer) on ``rows["moe"]`` rows (the
    recipe's rows without it): the median over ``iters`` calls (after one warm-up) of a forward
    without grad, a forward with grad and its backward, each drained and timed on its own, and of
    their sum in the layer's recompute pattern (``full``: all three; else the last two)."""
    model = trainer.model.module
    recipe = trainer.recipe
    index = recipe.model.mlp_types().index("moe")
    layer = model.layers[index]
    dev = next(model.parameters()).device
    dtype = torch.bfloat16 if recipe.model.params_dtype == "bfloat16" else torch.float32
    n = rows.get("moe", rows.get("mlp", recipe.data.seq_len))
    x = leaf((n, 1, recipe.model.hidden_size), dev, dtype)
    grad_out = torch.full((n, 1, recipe.model.hidden_size), 1e-3, device=dev, dtype=dtype)

    def block():
        o, bias = layer.mlp(layer.pre_mlp_layernorm(x))
        return o if bias is None else o + bias

    spent = {"forward_no_grad_s": [], "forward_s": [], "backward_s": [], "step_s": []}
    peak = 0.0
    for i in range(max(1, iters) + 1):
        if clock.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        clock.sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            block()
        clock.sync()
        t1 = time.perf_counter()
        out = block()
        clock.sync()
        t2 = time.perf_counter()
        out.backward(grad_out)
        clock.sync()
        t3 = time.perf_counter()
        del out
        x.grad = None
        trainer.model.zero_grad_buffer()
        if i == 0:  # warm-up: allocator growth, kernel selection
            continue
        spent["forward_no_grad_s"].append(t1 - t0)
        spent["forward_s"].append(t2 - t1)
        spent["backward_s"].append(t3 - t2)
        spent["step_s"].append((t3 - t0) if layer.recompute == "full" else (t3 - t1))
        if clock.cuda:
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
    moe = recipe.model.moe
    with torch.no_grad():  # how evenly the random router spreads the rows over the experts
        _, routing_map = layer.mlp.router(layer.pre_mlp_layernorm(x))
        per_expert = routing_map.sum(0)
    return {"layer": index, "dispatcher": moe.dispatcher, "rows": n, "routed_pairs": n * moe.top_k,
            "experts": moe.num_experts, "top_k": moe.top_k, "expert_ffn": moe.ffn_hidden_size,
            "chunk_tokens": recipe.train.moe_chunk_tokens, "recompute": layer.recompute,
            "rows_per_expert_min_max": [int(per_expert.min()), int(per_expert.max())],
            **{k: statistics.median(v) for k, v in spent.items()},
            "all_s": spent, "peak_gib_above": peak if clock.cuda else None}


def compare_moe(base_path: str, other_path: str, json_path: str | None) -> dict:
    """OTHER's MoE block seconds over BASE's, part by part (two ``--parts moe`` runs)."""
    runs = []
    for path in (base_path, other_path):
        with open(path) as f:
            runs.append(json.load(f)["moe_block"])
    base, other = runs
    parts = ("forward_no_grad_s", "forward_s", "backward_s", "step_s")
    result = {"base": base["dispatcher"], "other": other["dispatcher"], "rows": base["rows"],
              base["dispatcher"]: {k: base[k] for k in parts},
              other["dispatcher"]: {k: other[k] for k in parts},
              "ratio": {k: other[k] / base[k] for k in parts}}
    if (base["rows"], base["experts"]) != (other["rows"], other["experts"]):
        raise ValueError(f"{base_path} and {other_path} ran different shares: {base} {other}")
    print(f"MoE block, {base['rows']} rows, {base['experts']} experts x {base['expert_ffn']} "
          f"columns, top-{base['top_k']}, chunks of {base['chunk_tokens']} rows")
    print(f"{'part':18s} {base['dispatcher']:>10s} {other['dispatcher']:>10s} {'ratio':>7s}")
    for k in parts:
        print(f"{k:18s} {base[k]:10.4f} {other[k]:10.4f} {other[k] / base[k]:7.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
