"""``skyrl-kda``: the command line of the plugin."""

from __future__ import annotations

import argparse
import sys

from .config import LayerRecipe, Recipe, parse_overrides
from .demo import byte_table, run_demo

def plan_lines(recipe: LayerRecipe, state_prepass: float | None = None) -> list[str]:
    """The cost model's table of the three exchanges for a recipe, and the choice with its reason;
    a whole ``Recipe`` gets a first line with its model and mesh."""
    from .kda.cost import DEFAULT_CALIBRATION, Calibration, choose

    calibration = DEFAULT_CALIBRATION
    if state_prepass is not None:
        calibration = Calibration(state_prepass=state_prepass)
    _, reason, table = choose(recipe, calibration)
    p, k, c = recipe.parallel, recipe.kda, recipe.cluster
    spans = c.cp_spans_nodes(p.tp, p.cp)
    link = c.inter_node if spans else c.intra_node
    where = f"{c.inter_node_kind} between nodes" if spans else "NVLink inside one node"
    lines = [recipe_line(recipe)] if isinstance(recipe, Recipe) else []
    lines += [
        f"KDA layer: {k.num_heads} heads x {k.head_dim}, hidden {recipe.model.hidden_size}, "
        f"TP{p.tp} x CP{p.cp}{' +SP' if p.sequence_parallel else ''}, "
        f"T={recipe.data.seq_len} x {recipe.data.micro_batch_size}, bf16 activations",
        f"CP group: ranks {p.tp} apart over {p.tp * p.cp} consecutive ranks, {c.gpus_per_node} GPUs "
        f"per node -> {where} ({link.bandwidth_gib_s:g} GiB/s all-gather, "
        f"{link.a2a_bandwidth_gib_s:g} GiB/s all-to-all, {link.latency_us:g} us); "
        f"state pre-pass {calibration.state_prepass:+.2f}x",
        "per rank per KDA layer: bytes one forward pass (backward: the mirror, plus the row gathers again), "
        "time forward+backward",
        f"{'exchange':<10}{'CP in GiB':>10}{'CP out GiB':>11}{'TP GiB':>8}{'comm ms':>9}"
        f"{'compute ms':>11}{'total ms':>10}{'extra mem GiB':>14}  exact",
    ]
    for e in table:
        lines.append(
            f"{e.name:<10}{e.cp_in_bytes / 2**30:>10.3f}{e.cp_out_bytes / 2**30:>11.3f}"
            f"{e.tp_bytes / 2**30:>8.3f}{e.comm_s * 1e3:>9.1f}{e.compute_s * 1e3:>11.1f}"
            f"{e.total_s * 1e3:>10.1f}{e.extra_memory_bytes / 2**30:>14.2f}  "
            f"{'yes' if e.exact else 'no'}")
    if k.cp_exchange == "auto":
        lines.append(f"choice: {reason}")
    else:
        lines.append(f"choice: {k.cp_exchange} (configured); auto would pick {reason}")
    return lines


def recipe_line(recipe: Recipe) -> str:
    """One line: the model's layers and the mesh of a whole recipe."""
    m, p = recipe.model, recipe.parallel
    kinds = m.layer_types()
    return (
        f"model: {m.num_layers} layers ({kinds.count('kda')} KDA, {kinds.count('dsa')} DSA; "
        f"{m.num_dense_layers} dense FFN, {m.moe.num_experts} experts top-{m.moe.top_k}), "
        f"hidden {m.hidden_size}, vocab {m.vocab_size}; {recipe.run.num_workers} "
        f"{recipe.run.device.upper()} ranks = TP{p.tp} x CP{p.cp} x DP{recipe.data_parallel_size}"
        f", EP{p.ep} x ETP{p.etp}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skyrl-kda", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="KDA layer on a CP mesh of Ray CPU ranks: each exchange vs CP=1, and bytes moved")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override the tiny layer recipe, e.g. --set parallel.cp=4 "
                           "--set parallel.tp=2 --set parallel.sequence_parallel=true")
    demo.add_argument("--exchanges", default="a2a,allgather,state",
                      help="comma-separated exchanges to check (default: all)")
    sub.add_parser("bytes", help="analytic CP bytes per exchange at GLM-5.3-Flash dims")
    sub.add_parser("recipes", help="the registered recipes and what each is for")
    plan = sub.add_parser(
        "plan", help="cost model of the three CP exchanges for a recipe, and what auto picks")
    plan.add_argument("recipe", nargs="?", default="glm53_flash_1m", metavar="RECIPE",
                      help="registered recipe name (skyrl-kda recipes) or YAML path "
                           "(default: glm53_flash_1m)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override the recipe, e.g. "
                           "--set cluster.inter_node_kind=efa --set kda.allow_inexact=false")
    plan.add_argument("--state-prepass", type=float, default=None, metavar="FACTOR",
                      help="extra kernel time of state over its shard alone "
                           "(default: fla's measured 1.45; ours measured -0.10)")
    plan.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                      help="memory of one GPU for the per-GPU memory table "
                           "(default: H200 for run.device=gpu, unknown on CPU)")
    train = sub.add_parser(
        "run", help="train a recipe on Ray actors (metrics.jsonl, recipe.yaml, checkpoints)")
    train.add_argument("recipe", metavar="RECIPE",
                       help="registered recipe name (skyrl-kda recipes) or YAML path")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override the recipe, e.g. --set kda.cp_exchange=allgather")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in run.output_dir")
    export = sub.add_parser(
        "export", help="a run's latest checkpoint as a Hugging Face glm5_next safetensors folder")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder")
    export.add_argument("--out", required=True, metavar="HF_DIR",
                        help="new folder for the safetensors, config.json and tokenizer files")
    export.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's recipe.yaml, e.g. another mesh: "
                             "--set run.num_workers=1 --set parallel.tp=1")
    source = export.add_mutually_exclusive_group()
    source.add_argument("--source", default=None, metavar="HF_DIR",
                        help="checkpoint whose config.json, vision/MTP tensors and tokenizer are "
                             "copied through (default: the run's run.init_from_hf)")
    source.add_argument("--no-source", action="store_true",
                        help="copy nothing; config.json is a text-only config from the recipe")
    report = sub.add_parser("report", help="PNG plots of a run's metrics.jsonl")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder")
    args = parser.parse_args(argv)

    if args.command == "run":
        return _run(args.recipe, args.overrides, args.resume)

    if args.command == "export":
        return _export(args)

    if args.command == "report":
        from .train.report import write_report

        for path in write_report(args.run_dir):
            print(path)
        return 0

    if args.command == "recipes":
        from .recipes import list_recipes

        recipes = list_recipes()
        width = max(map(len, recipes), default=0)
        print("\n".join(f"{name:<{width}}  {text}" for name, text in recipes.items()))
        return 0

    if args.command == "plan":
        from .recipes import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        print("\n".join(plan_lines(recipe, args.state_prepass)))
        from .memory import GiB, memory_lines

        gpu = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GiB)
        print("\n".join(["", *memory_lines(recipe, gpu)]))
        return 0

    if args.command == "bytes":
        print("\n".join(byte_table()))
        return 0
    ok = run_demo(parse_overrides(args.overrides), args.exchanges.split(","))
    return 0 if ok else 1


def _run(name: str, overrides: list[str], resume: bool) -> int:
    """``skyrl-kda run``: exit 0 when done, 1 when a rank failed, 128+signal when interrupted."""
    import logging

    from .recipes import load_recipe
    from .train.run import Interrupted, run
    from .workers.group import WorkerError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    recipe = load_recipe(name, [*overrides, *(["run.resume=true"] if resume else [])])
    print(recipe_line(recipe), file=sys.stderr)
    try:
        lines = run(recipe)
    except Interrupted as err:
        print(err, file=sys.stderr)
        return 128 + err.signum
    except WorkerError as err:
        print(f"run failed: {err}", file=sys.stderr)
        return 1
    if lines:
        print(f"{len(lines)} steps, loss {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f}; "
              f"{recipe.run.output_dir}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    """``skyrl-kda export``: exit 0 when written, 1 when a rank failed."""
    import logging

    from .train.export import export
    from .workers.group import WorkerError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        ckpt, step = export(args.run_dir, args.out, overrides=args.overrides, source=args.source,
                            use_source=not args.no_source)
    except WorkerError as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 1
    print(f"exported {ckpt} (step {step}) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
