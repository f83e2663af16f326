"""``skyrl-kda``: the command line of the plugin."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

# Only light modules here: the warning filters must be in place before the commands import the
# package's config, megatron, fla, torch and Ray (see main).
from .console import error_lines, quiet_warnings
from .tables import format_table

if TYPE_CHECKING:
    from .config import MeshRecipe, Recipe
    from .recipes import LoadedRecipe
    from .train.run_folder import RunStart


def plan_lines(recipe: MeshRecipe, state_prepass: float | None = None,
               choices: Mapping[str, str] | None = None) -> list[str]:
    """The cost model's table of the three exchanges for a recipe, and the choice with its reason;
    a whole ``Recipe`` gets a first line with its model and mesh. ``choices``: the settings
    ``auto`` picked when the recipe was loaded (``recipes.LoadedRecipe.choices``)."""
    from .config import Recipe
    from .kda.cost import DEFAULT_CALIBRATION, Calibration, choose

    calibration = DEFAULT_CALIBRATION
    if state_prepass is not None:
        calibration = Calibration(state_prepass=state_prepass)
    _, reason, table = choose(recipe, calibration)
    p, k, c = recipe.parallel, recipe.kda, recipe.cluster
    spans = c.cp_spans_nodes(p.tp, p.cp)
    link = c.inter_node_per_gpu if spans else c.intra_node
    where = (f"{c.inter_node_kind} between nodes, per GPU while all {c.gpus_per_node} of a node "
             "cross" if spans else "NVLink inside one node")
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
    ]
    lines += format_table(
        ("exchange", "CP in GiB", "CP out GiB", "TP GiB", "comm ms", "compute ms", "total ms",
         "extra mem GiB", "exact"),
        [(e.name, f"{e.cp_in_bytes / 2**30:.3f}", f"{e.cp_out_bytes / 2**30:.3f}",
          f"{e.tp_bytes / 2**30:.3f}", f"{e.comm_s * 1e3:.1f}", f"{e.compute_s * 1e3:.1f}",
          f"{e.total_s * 1e3:.1f}", f"{e.extra_memory_bytes / 2**30:.2f}",
          "yes" if e.exact else "no") for e in table],
        align="<>>>>>>><")
    if k.cp_exchange == "auto" or "kda.cp_exchange" in (choices or {}):  # auto, maybe resolved
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


def build_parser() -> argparse.ArgumentParser:
    """The ``skyrl-kda`` parser; ``--debug`` is accepted before or after the subcommand."""
    from .recipes import DEFAULT_RECIPE

    debug_help = "on an error, show the full traceback instead of one line"
    parser = argparse.ArgumentParser(
        prog="skyrl-kda", description="GLM-5.3-Flash-shaped KDA models on Megatron and Ray: plan a "
        "recipe, train it, export it, and check the KDA layer's context-parallel exchanges.")
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # A subcommand's copy must not reset a --debug given before it: absent, it sets nothing.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[debug])

    demo = command(
        "demo", "check of the KDA layer's CP exchanges (not training): one layer of the tiny "
        "recipe on a CP mesh of Ray CPU ranks, each exchange against CP=1, and the bytes moved")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override the demo's recipe (glm53_flash_tiny at TP1 x CP2), e.g. "
                           "--set parallel.cp=4 --set parallel.tp=2 "
                           "--set parallel.sequence_parallel=true")
    demo.add_argument("--exchanges", default="a2a,allgather,state",
                      help="comma-separated exchanges to check (default: all)")
    command("bytes", "analytic CP bytes per exchange at GLM-5.3-Flash dims")
    command("recipes", "the registered recipes and what each is for")
    plan = command("plan", "cost model of the three CP exchanges for a recipe, what auto picks, "
                           "the per-GPU memory estimate and the step time")
    plan.add_argument("recipe", nargs="?", default="glm53_flash_1m", metavar="RECIPE",
                      help="registered recipe name (skyrl-kda recipes) or YAML path "
                           "(default: glm53_flash_1m)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override the recipe, e.g. "
                           "--set cluster.inter_node_kind=efa --set kda.allow_inexact=false; "
                           "with --set run.ray_address=auto (or ray://HEAD:10001) also a "
                           "placement dry run on that cluster: where each rank would run")
    plan.add_argument("--state-prepass", type=float, default=None, metavar="FACTOR",
                      help="extra kernel time of the state exchange relative to the same kernel "
                           "on its shard alone: the state kernel takes the shard's time x "
                           "(1 + FACTOR) (default: ours as measured, +0.125; 2.35 prices fla's own "
                           "cp_context state passing)")
    plan.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                      help="memory of one GPU for the per-GPU memory table "
                           "(default: H200 for run.device=gpu, unknown on CPU)")
    train = command("run", "train a recipe on Ray actors (metrics.jsonl, recipe.yaml, checkpoints)")
    train.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, metavar="RECIPE",
                       help="registered recipe name (skyrl-kda recipes) or YAML path "
                            f"(default: {DEFAULT_RECIPE}, which runs on a laptop CPU)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override the recipe, e.g. --set kda.cp_exchange=allgather")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in run.output_dir")
    train.add_argument("--overwrite", action="store_true",
                       help="run.output_dir holds a run: move it aside to "
                            "<output_dir>.replaced-<time> and start over (nothing is deleted)")
    train.add_argument("--override-schedule", action="store_true",
                       help="with --resume: apply changed train.steps, lr, min_lr, warmup_steps or "
                            "weight_decay from the checkpoint's step on (refused without it)")
    train.add_argument("--from-step", type=int, default=None, metavar="N",
                       help="with --resume: continue from checkpoints/step_N instead of the one "
                            "checkpoints/latest names (later saves move latest as usual)")
    export = command("export",
                     "a run's latest checkpoint as a Hugging Face glm5_next safetensors folder")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder")
    export.add_argument("--out", required=True, metavar="HF_DIR",
                        help="new folder for the safetensors, config.json and tokenizer files")
    export.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's recipe.yaml, e.g. another mesh: "
                             "--set run.num_workers=1 --set parallel.tp=1")
    export.add_argument("--from-step", type=int, default=None, metavar="N",
                        help="export checkpoints/step_N instead of the one checkpoints/latest "
                             "names")
    export.add_argument("--adapters", action="store_true",
                        help="a LoRA run: its adapters as a PEFT folder (adapter_model.safetensors, "
                             "adapter_config.json) instead of the merged weights")
    source = export.add_mutually_exclusive_group()
    source.add_argument("--source", default=None, metavar="HF_DIR",
                        help="checkpoint whose config.json, vision/MTP tensors and tokenizer are "
                             "copied through (default: the run's run.init_from_hf)")
    source.add_argument("--no-source", action="store_true",
                        help="copy nothing; config.json is a text-only config from the recipe")
    report = command("report", "PNG plots of a run's metrics.jsonl")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder")
    ckpt = command("checkpoint", "check a run's checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    verify = ckpt_sub.add_parser(
        "verify", parents=[debug], help="hash the latest checkpoint's files against its manifest",
        description="hash every file of RUN_DIR's latest checkpoint and compare it with the "
                    "manifest its save wrote (sizes and sha256)")
    verify.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a refused input or a failure prints ``error: ...`` lines to stderr and
    returns 2 (bad input) or 1 (failure while running), or raises it with ``--debug``."""
    quiet_warnings()  # before the commands import megatron, fla, torch and Ray
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug:
            raise
        lines, status = error_lines(err, args.command)
        # Ray's driver prints a dead worker's account to stdout (from a thread that its shutdown
        # joins, so all of it is written by now): flushed first, the error is the last line of a
        # console or log that takes both streams.
        sys.stdout.flush()
        print("\n".join(lines), file=sys.stderr)
        return status


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return _run(args)

    if args.command == "checkpoint":
        _note_live_run(args.run_dir)
        return _verify_checkpoint(args.run_dir)

    if args.command == "export":
        _note_live_run(args.run_dir)
        return _export(args)

    if args.command == "report":
        from .train.report import write_report

        _note_live_run(args.run_dir)
        for path in write_report(args.run_dir):
            print(path)
        return 0

    if args.command == "recipes":
        from .recipes import list_recipes

        print("\n".join(format_table(None, list_recipes().items(), align="<<")))
        return 0

    if args.command == "plan":
        loaded = load_recipe(args.recipe, args.overrides)
        recipe = loaded.recipe
        _check_ray_address(recipe)  # before the tables: the error is the only line
        lines = plan_lines(recipe, args.state_prepass, loaded.choices)
        _say_choices(loaded)  # after what may still fail: an error is the only line
        print("\n".join(lines))
        from .memory import GiB, memory_lines

        gpu = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GiB)
        print("\n".join(["", *memory_lines(recipe, gpu)]))
        from .steptime import step_time_lines

        print("\n".join(["", *step_time_lines(recipe)]))
        if recipe.run.ray_address is not None:
            print("\n".join(["", *placement_lines(recipe)]))
        return 0

    from .demo import byte_table, run_demo

    if args.command == "bytes":
        print("\n".join(byte_table()))
        return 0
    ok = run_demo(args.overrides, args.exchanges.split(","))
    return 0 if ok else 1


def placement_lines(recipe: Recipe) -> list[str]:
    """A placement dry run on the cluster at ``run.ray_address``: the run's placement group and
    rank actors are made, where each rank would run is read back (the rank map ``run`` prints),
    and all is released; no model, no torch.distributed."""
    from .workers.group import ActorGroup
    from .workers.lifetime import StartedRay
    from .workers.rank_map import build_rank_map, rank_map_lines

    ray_here = StartedRay(recipe.run)
    try:
        group = ActorGroup.for_recipe(recipe, connect=False)
        try:
            rank_map = build_rank_map(group.ranks, recipe)
        finally:
            group.shutdown()
    finally:
        ray_here.shutdown()
    return [f"placement dry run on {recipe.run.ray_address}: {recipe.run.num_workers} "
            f"{recipe.run.device.upper()} ranks", *rank_map_lines(rank_map)]


def load_recipe(name: str, overrides: list[str]) -> LoadedRecipe:
    """``recipes.load_recipe``, imported when a command needs it (a recipe file's YAML error
    arrives as a ``ValueError`` naming the file)."""
    from .recipes import load_recipe as load

    return load(name, overrides)


def _say_choices(loaded: LoadedRecipe) -> None:
    """What ``auto`` picked when the recipe was loaded, one line each on stderr (``plan`` and
    ``run``: made before logging is configured, so said here)."""
    for line in loaded.choice_lines():
        print(line, file=sys.stderr)


def check_run_inputs(recipe: Recipe, *, overwrite: bool = False,
                     override_schedule: bool = False, from_step: int | None = None) -> RunStart:
    """Refuse, before Ray starts, the inputs of a run that this machine can see are missing or
    wrong: a ``run.ray_address`` where nothing listens; on a local cluster (whose ranks read this
    machine's files) ``data.path`` and ``run.init_from_hf``; then the output folder (``train.run_folder.prepare``: a used one, the
    checkpoint ``--resume`` continues from and its schedule), last because ``--overwrite`` moves
    the old run aside. Settings megatron cannot build are refused first: the optimizer's
    settings are built as the ranks will build them (``train.optimizer.optimizer_config``, which
    refuses ``train.optimizer_offload_fraction``). Returns where the run starts."""
    from .train.optimizer import optimizer_config

    optimizer_config(recipe)
    _check_ray_address(recipe)
    if recipe.run.ray_address is None:
        if recipe.data.path is not None:
            from .train.data.sources import list_jsonl

            list_jsonl(recipe.data.path)
        hf = recipe.run.init_from_hf
        if hf is not None and not Path(hf).expanduser().is_dir():
            raise FileNotFoundError(f"run.init_from_hf={hf!r} is not a folder")
    from .train.run_folder import prepare

    return prepare(recipe, overwrite=overwrite, override_schedule=override_schedule,
                   from_step=from_step)


def _check_ray_address(recipe: Recipe) -> None:
    """A ``run.ray_address`` where nothing listens, refused in one line before anything starts
    (``workers.group.check_reachable``; ``ray.init`` would retry for minutes)."""
    if recipe.run.ray_address is not None:
        from .workers.group import check_reachable

        check_reachable(recipe.run.ray_address)


def _run(args: argparse.Namespace) -> int:
    """``skyrl-kda run``: exit 0 when done (or already finished), 1 when a rank failed,
    128+signal when interrupted."""
    from .train.run_lock import hold

    resume = ["run.resume=true"] if args.resume else []
    loaded = load_recipe(args.recipe, [*args.overrides, *resume])
    recipe = loaded.recipe
    # One run per folder (train.run_lock): the lock is taken here, before check_run_inputs looks
    # at the folder or --overwrite moves it, and held until train.run.run has shut Ray down.
    # train.run.run takes it itself for Python callers; here it finds it held and keeps it.
    with hold(recipe.run.output_dir, say=lambda line: print(line, file=sys.stderr)):
        return _run_holding_folder(args, loaded)


def _run_holding_folder(args: argparse.Namespace, loaded: LoadedRecipe) -> int:
    import logging

    recipe = loaded.recipe
    start = check_run_inputs(recipe, overwrite=args.overwrite,
                             override_schedule=args.override_schedule, from_step=args.from_step)
    for note in start.notes:
        print(note, file=sys.stderr)
    finished = start.finished_line(recipe)
    if finished is not None:
        print(finished, file=sys.stderr)
        return 0
    from .train.run import Interrupted, run, summary_line

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(recipe_line(recipe), file=sys.stderr)
    _say_choices(loaded)
    try:
        lines = run(recipe, start=start, choices=loaded.choices)
    except Interrupted as err:
        return _stopped(err)
    if lines:
        if recipe.data.path is not None:
            from .train.data.stats import skip_summary

            print(f"data: {skip_summary(lines[-1]['skipped_records'])}", file=sys.stderr)
        print(summary_line(lines, recipe.run.output_dir), file=sys.stderr)
    return 0


def _stopped(err) -> int:
    """The line of a run or export stopped by a signal (``train.stop.Interrupted``) and its exit
    status, 128 + the signal. Stopped inside ``ray.init`` (``exit_at_once``), the process ends
    here, past the interpreter's shutdown, which Ray's half-made core worker can crash."""
    import logging
    import os

    print(err, file=sys.stderr)
    if err.exit_at_once:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + err.signum)
    return 128 + err.signum


def _note_live_run(run_dir: str) -> None:
    """Readers take no lock; they say when a run is live in the folder they read."""
    from .train.run_lock import note_if_live

    note_if_live(run_dir)


def _verify_checkpoint(run_dir: str) -> int:
    """``skyrl-kda checkpoint verify``: exit 0 with one line when every file matches; a missing,
    empty or broken ``latest`` names the step folder that verifies (``LatestError``)."""
    from .train.checkpoint import checkpoints_dir, resume_checkpoint
    from .train.manifest import summary, verify

    path = resume_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"{checkpoints_dir(run_dir)} has no checkpoint to verify")
    print(summary(path, verify(path)))
    return 0


def _export(args: argparse.Namespace) -> int:
    """``skyrl-kda export``: exit 0 when written, 1 when a rank failed, 128+signal when
    interrupted."""
    import logging

    from .train.export import export
    from .train.stop import Interrupted

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        ckpt, step = export(args.run_dir, args.out, overrides=args.overrides, source=args.source,
                            use_source=not args.no_source, from_step=args.from_step,
                            adapters=args.adapters)
    except Interrupted as err:
        return _stopped(err)
    print(f"exported {ckpt} (step {step}) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
