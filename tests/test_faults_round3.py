"""Issue 58's `skyrl-kda` fault cases: each ends with one `error:` line naming the setting or
path and the fix, a non-zero exit, before Ray where the cause is knowable then, nothing lost.

Each test says in its docstring what the code before did with the same input. No test here
starts Ray: the driver-side functions are called directly (`no_ray` fails a test that would
start it), and the one real save runs on spawned gloo ranks."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.config import parse_overrides
from skyrl_megatron_kda.recipes import load_recipe
from skyrl_megatron_kda.train import checkpoint_failures, export
from skyrl_megatron_kda.train.checkpoint_failures import CheckpointFailed, explained_failures
from tests.support.ranks import run_ranks
from tests.test_cli import (  # noqa: F401
    TINY,
    fake_checkpoint,
    fake_run,
    no_env_override,
    no_ray,
    refused,
    run_in,
    tiny_yaml,
)
from tests.test_run_lock import fake_train, live_run, snapshot  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


# --- 1. a live run's folder is never moved, overwritten or written into ---------------------


@pytest.mark.parametrize("target, extra", [("parent", ["--overwrite"]), ("parent", []),
                                           ("inside", [])])
def test_no_run_moves_or_writes_into_a_folder_around_or_inside_a_live_run(
        capsys, tmp_path, no_ray, target, extra):
    """Before: `--overwrite` into `x` while a run trained in `x/run` moved `x` aside with the
    live run inside (the run went on writing half into the moved folder); a run into `x` or
    into `x/run/sub` started beside it."""
    parent = tmp_path / "x"
    live = parent / "run"
    fake_run(live)
    out = parent if target == "parent" else live / "sub"
    with live_run(live) as pid:
        before = snapshot(parent)
        line = refused(capsys, run_in(out, *extra))
        assert snapshot(parent) == before  # nothing moved, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no x.replaced-*
    assert f"(pid {pid} on host {socket.gethostname()}, since " in line
    if target == "parent":
        assert line.startswith(f"error: {parent} holds {live}, in use by a live run ")
        assert line.endswith("a run may not write into, overwrite or move a folder holding a "
                             "live run's; wait for it or use another run.output_dir")
    else:
        assert line.startswith(f"error: {out} is inside {live}, in use by a live run ")
        assert line.endswith("use a run.output_dir outside it")


def test_a_finished_run_below_does_not_block_the_parent(tmp_path, fake_train):  # noqa: F811
    """The control: a lock file left below by a run that ended is no live run."""
    from skyrl_megatron_kda.train import run_lock

    fake_run(tmp_path / "x" / "run")
    run_lock.acquire(tmp_path / "x" / "run").release()
    assert (tmp_path / "x" / "run" / run_lock.LOCK_FILE).is_file()  # left, emptied
    assert cli.main(run_in(tmp_path / "x")) == 0
    assert len(fake_train) == 1


# --- 2. a key given twice in a YAML file ---------------------------------------------------


@pytest.mark.parametrize("text, named", [
    ("train:\n  lr: 3.0e-3\n  steps: 4\n  lr: 1.0e+3\n", "train.lr is given twice (lines 2 and 4)"),
    ("train:\n  lr: 3.0e-3\nrun:\n  device: cpu\ntrain:\n  steps: 4\n",
     "train is given twice (lines 1 and 5)"),
    ("model:\n  moe:\n    top_k: 2\n    top_k: 1\n", "model.moe.top_k is given twice (lines 3 and 4)"),
])
def test_a_key_given_twice_in_a_recipe_file_is_refused_naming_it(capsys, tmp_path, no_ray,
                                                                  text, named):
    """Before: PyYAML kept the last value silently (`lr: 1.0e+3` ran at 1000; a second
    `train:` replaced the first whole)."""
    path = tiny_yaml(tmp_path, text)
    line = refused(capsys, ["plan", str(path)])
    assert line == (f"error: recipe file {path}: {named}; YAML would keep the last silently: "
                    "remove one")


def test_a_key_given_twice_in_an_override_value_is_refused():
    """Before: `--set 'train={lr: 1, lr: 2}'` set lr=2."""
    with pytest.raises(ValueError, match=r"^override 'train=\{lr: 1, lr: 2\}': train\.lr is given "
                                         r"twice; YAML would keep the last silently"):
        parse_overrides(["train={lr: 1, lr: 2}"])
    assert parse_overrides(["train={lr: 1, steps: 2}"]) == {"train": {"lr": 1, "steps": 2}}


# --- 3. run.ray_address where nothing listens ----------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_ray_address_where_nothing_listens_is_refused_before_ray(capsys, tmp_path, no_ray,
                                                                   command):
    """Before: `plan` printed its tables and `run` went on to `ray.init`, which only logged
    connection warnings for about 10 minutes (here `no_ray` would fail it with exit 1)."""
    address = f"127.0.0.1:{_closed_port()}"
    argv = [command, TINY, "--set", f"run.ray_address={address}"]
    if command == "run":
        argv += ["--set", f"run.output_dir={tmp_path / 'run'}"]
    line = refused(capsys, argv)
    assert line == (f"error: run.ray_address={address}: nothing listens at {address} (Connection "
                    "refused); start the cluster there (ray start --head) or set run.ray_address "
                    "to its head's address (HOST:6379, ray://HOST:10001 or auto)")
    assert not (tmp_path / "run").exists()


def test_a_listening_ray_address_passes_the_check():
    from skyrl_megatron_kda.workers.group import check_reachable

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_reachable(f"127.0.0.1:{port}")
        check_reachable(f"ray://127.0.0.1:{port}")
    check_reachable(None)
    check_reachable("auto")


# --- 4 and 7. metrics.jsonl on a resume -----------------------------------------------------


def MetricsLog(path: Path, resume_step: int):  # noqa: N802 - imported when a test runs
    from skyrl_megatron_kda.train.outputs import MetricsLog as log

    return log(path, resume_step)


def _lines(path: Path) -> list[int]:
    return [json.loads(t)["step"] for t in path.read_text().splitlines() if t.strip()]


def test_from_step_cuts_no_metrics_line_until_its_first_save_lands(tmp_path):
    """Before: `--resume --from-step 2` cut metrics.jsonl to 2 lines when it started, so a run
    stopped before its first save left `latest` at step 4 and the lines of steps 3-4 gone."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in range(1, 5)))
    before = path.read_bytes()
    log = MetricsLog(path, 2)
    assert path.read_bytes() == before
    log.write({"step": 3, "loss": 4.0})
    assert path.read_bytes() == before  # stopped here: the file is as the run found it
    log.saved()
    assert _lines(path) == [1, 2, 3]
    log.write({"step": 4, "loss": 3.0})
    assert _lines(path) == [1, 2, 3, 4]
    assert json.loads(path.read_text().splitlines()[-1])["loss"] == 3.0


def test_a_resume_with_nothing_past_its_step_appends_at_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # the last line cut by a kill
    log = MetricsLog(path, 2)
    assert _lines(path) == [1, 2]  # the cut line dropped
    log.write({"step": 3})
    assert _lines(path) == [1, 2, 3]
    fresh = MetricsLog(tmp_path / "new.jsonl", 0)
    fresh.write({"step": 1})
    fresh.finished()
    assert _lines(tmp_path / "new.jsonl") == [1]


def test_a_resume_whose_last_metrics_line_is_cut_says_it_drops_it_before_ray(
        capsys, tmp_path, fake_train):  # noqa: F811
    """Before: the cut line was found after Ray started and the checkpoint loaded, and the
    resume failed there (`metrics.jsonl:3: not a JSON line`)."""
    out = tmp_path / "run"
    fake_run(out)
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "lo')
    assert cli.main(run_in(out, "--resume")) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"--resume: {metrics}:3 was cut short when the run was killed (not a JSON "
                      "line): dropped")
    assert len(fake_train) == 1  # the run went on


def test_a_resume_with_a_bad_metrics_line_before_the_last_is_refused_before_ray(
        capsys, tmp_path, no_ray):
    out = tmp_path / "run"
    fake_run(out)
    metrics = out / "metrics.jsonl"
    metrics.write_text('{"step": 1, "lo\n{"step": 2, "loss": 5.0}\n')
    line = refused(capsys, run_in(out, "--resume"))
    assert line.startswith(f"error: {metrics}:1: not a JSON line (")


# --- 5. a full disk during a save -----------------------------------------------------------


@pytest.mark.parametrize("full", [True, False])
def test_torchs_writer_failing_on_a_full_disk_says_no_space_left_on_device(tmp_path, monkeypatch,
                                                                           full):
    """Before: megatron's common state (torch.save's zip writer) failing on a full disk read
    `[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`, nothing else.
    /dev/full fails the write the same way; `free_bytes` says whether the disk is full."""
    monkeypatch.setattr(checkpoint_failures, "free_bytes", lambda path: 0 if full else 2**40)
    with pytest.raises(CheckpointFailed) as caught:
        with explained_failures("saving", tmp_path / "step_00000003"):
            torch.save({"w": torch.zeros(1000)}, "/dev/full")
    line = str(caught.value)
    assert line.startswith(f"saving checkpoint {tmp_path / 'step_00000003'} failed on rank 0: ")
    assert "unexpected pos" in line
    assert ("[Errno 28] No space left on device (torch's writer: " in line) == full


def _free_space_on_rank(rank: int, world: int) -> dict:
    """A real megatron save of two ranks' shards; then the same request with the free space
    made 1 byte short of what ``written_bytes`` counts: refused on every rank, nothing written."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from skyrl_megatron_kda.distributed.cpu import cuda_names_cpu

    local = torch.full((4096, 16), float(rank))
    request = {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world), replica_id=0),
               "b": ShardedTensor.from_rank_offsets("b", torch.ones(512), replica_id=rank)}
    base = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(base, src=0)
    good, full = Path(base[0]) / "checkpoints" / "step_1", Path(base[0]) / "checkpoints" / "step_2"
    need = torch.tensor([float(checkpoint_failures.written_bytes(request))], dtype=torch.float64)
    dist.all_reduce(need)
    real_free = checkpoint_failures.free_bytes
    result = {"base": base[0], "need": need.item()}
    checkpoint_failures.check_free_space(request, good, "step 1", "no checkpoint yet", 0,
                                         torch.device("cpu"))
    if rank == 0:
        good.mkdir(parents=True)
    dist.barrier()
    with cuda_names_cpu(True):
        dist_checkpointing.save(request, str(good))
    checkpoint_failures.free_bytes = lambda path: int(need.item()) - 1
    try:
        checkpoint_failures.check_free_space(request, full, "step 2", "latest stays at step_1",
                                             0, torch.device("cpu"))
    except OSError as err:
        result["error"], result["errno"] = str(err), err.errno
    finally:
        checkpoint_failures.free_bytes = real_free
    result["written"] = full.exists()
    return result


def test_a_save_larger_than_the_free_space_is_refused_before_writing():
    """Before: the save started and failed midway, in whichever layer's words. The check counts
    what megatron writes (each shard once, from its main replica: the replicated `b` once), and
    the bytes torch's writer puts around each."""
    results = run_ranks(2, _free_space_on_rank)
    base = Path(results[0]["base"])
    written = sum(f.stat().st_size for f in (base / "checkpoints" / "step_1").iterdir())
    need = results[0]["need"]
    assert need == (4096 * 16 * 2 + 512) * 4 + 3 * checkpoint_failures.ITEM_BYTES
    assert abs(need - written) < 0.05 * written, (need, written)
    for r in results:
        assert r["errno"] == errno.ENOSPC and not r["written"]
        assert r["error"] == (f"step 2: the checkpoint needs {need / 2**20:.1f} MiB, "
                              f"{base / 'checkpoints'} has {(need - 1) / 2**20:.1f} MiB free: "
                              "[Errno 28] No space left on device; not saved (latest stays at "
                              "step_1): free space there or set run.output_dir on a larger disk")
    for path in sorted(base.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    base.rmdir()


# --- 6. train.on_nonfinite=skip on the console ----------------------------------------------


class _Group:
    """``ActorGroup`` stand-in: each call of the step gives the next scripted metrics."""

    def __init__(self, lines: list[dict]):
        self.lines = iter(lines)

    def call_held(self, fn, *args):
        return [next(self.lines)]


def _step(step: int, skipped: bool) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "grad_norm": float("nan") if skipped else 1.0,
            "lr": 1e-3, "update_skipped": skipped, "tokens": 256, "loss_tokens": 250,
            "exchange": "a2a", "skipped_records": {}, "step_time_s": 0.5, "cp_bytes": 0,
            "peak_gib": None}


def test_a_skipped_update_is_said_on_the_console_and_in_the_last_line(tmp_path, caplog):
    """Before: the skip was a warning of rank 0, which reaches Ray's worker log only, and the
    run's last line was `3 steps, loss 4.9000 -> 4.7000; RUN_DIR`, without "skipped"."""
    import io

    from skyrl_megatron_kda.train import run as train_run
    from skyrl_megatron_kda.train.run import summary_line
    from skyrl_megatron_kda.train.stop import StopSignals

    recipe = load_recipe(TINY, ["train.steps=3", "train.save_interval=0",
                                "train.save_at_end=false", "train.on_nonfinite=skip"],
                         environ={}).recipe
    group = _Group([_step(1, False), _step(2, True), _step(3, False)])
    console = io.StringIO()
    caplog.set_level("WARNING", logger=train_run.__name__)
    lines = train_run._train_loop(recipe, group, tmp_path, 0, console, StopSignals(),
                                  MetricsLog(tmp_path / "metrics.jsonl", 0))
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert said == ["step 2: loss 4.8, gradient norm nan: not finite; update skipped "
                    "(train.on_nonfinite=skip; 1 in a row, the run stops at "
                    "train.max_skipped_steps=3)"]
    assert console.getvalue().count("\n") == 2  # the progress line ended before the warning
    assert summary_line(lines, "runs/x") == ("3 steps, loss 4.9000 -> 4.7000; 1 update skipped "
                                             "(not finite, step 2); runs/x")
    assert summary_line(lines[:1], "runs/x") == "1 steps, loss 4.9000 -> 4.9000; runs/x"


# --- 7. late or wrong refusals --------------------------------------------------------------


def test_a_seed_above_int64_is_refused_when_the_recipe_loads(capsys, no_ray):
    """Before: accepted, then a rank failed after Ray started (`Overflow when unpacking long
    long`, no setting named)."""
    line = refused(capsys, ["run", TINY, "--set", f"train.seed={2**64}"])
    assert "train.seed: Input should be less than or equal to 9223372036854775807" in line
    with pytest.raises(ValidationError):
        load_recipe(TINY, [f"train.seed={2**63}"], environ={})
    assert load_recipe(TINY, [f"train.seed={2**63 - 1}"], environ={}).recipe.train.seed == 2**63 - 1


def test_latest_naming_another_runs_checkpoint_is_refused(capsys, tmp_path, no_ray):
    """Before: `latest` naming a relative path up into another run's checkpoints was followed:
    `checkpoint verify` said ok about the other run's checkpoint, and `--resume` and `export`
    loaded it."""
    fake_run(tmp_path / "other")
    fake_run(tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    elsewhere = "/".join(("..", "..", "other", "checkpoints", "step_00000002"))
    latest.write_text(elsewhere)
    line = refused(capsys, ["checkpoint", "verify", str(tmp_path / "run")])
    assert line == (f"error: {latest} names '{elsewhere}', which is not "
                    "a step_N folder beside it; step_00000002 verifies: continue with skyrl-kda "
                    "run RECIPE --resume --from-step 2")
    assert "which is not a step_N folder" in refused(capsys, run_in(tmp_path / "run", "--resume"))


def test_export_with_latest_missing_names_the_step_and_from_step(capsys, tmp_path, no_ray):
    """Before: `export` said "has no checkpoint to export" beside an intact step folder."""
    fake_run(tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    latest.unlink()
    line = refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert line == (f"error: {latest} is missing; step_00000002 verifies: export it with skyrl-kda "
                    "export RUN_DIR --out HF_DIR --from-step 2")
    assert export.export_checkpoint(tmp_path / "run", 2).name == "step_00000002"
    line = refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"),
                            "--from-step", "3"])
    assert line == f"error: --from-step 3: {tmp_path / 'run' / 'checkpoints' / 'step_00000003'} " \
                   "does not exist"


def test_export_out_below_a_file_or_on_a_read_only_mount_is_refused_before_ray(
        capsys, tmp_path, no_ray, monkeypatch):
    """Before: both passed the driver's check (only a non-empty folder was refused); rank 0
    failed after Ray started."""
    fake_run(tmp_path / "run")
    (tmp_path / "file").write_text("x")
    line = refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "file" / "hf")])
    assert line == (f"error: --out {tmp_path / 'file' / 'hf'}: {tmp_path / 'file'} is a file, so no "
                    "folder can be made below it: export into a new folder elsewhere")
    # A read-only mount, as the kernel reports it (mounting one needs privileges tests lack).
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access, real_statvfs = os.access, os.statvfs

    class ReadOnly:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro
                        else real_access(p, mode))
    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly(real_statvfs(p)) if Path(p) == ro
                        else real_statvfs(p))
    line = refused(capsys, ["export", str(tmp_path / "run"), "--out", str(ro / "hf")])
    assert line == (f"error: --out {ro / 'hf'}: {ro} cannot be written (its filesystem is "
                    "read-only): export to a writable folder")


_EXPORT_UNDER_SIGTERM = textwrap.dedent("""
    import os, signal, sys, time
    from skyrl_megatron_kda import cli
    from skyrl_megatron_kda.train import run as train_run
    from skyrl_megatron_kda.workers.group import ActorGroup

    class Ray:
        def shutdown(self):
            print("ray shut down", file=sys.stderr)

    class Group:
        def run(self, *args):
            os.makedirs(sys.argv[2], exist_ok=True)
            open(os.path.join(sys.argv[2], "model-00001-of-00002.safetensors"), "w").close()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)

        def shutdown(self):
            print("ranks ended", file=sys.stderr)

    train_run.start_ray = lambda recipe, stop: Ray()
    ActorGroup.for_recipe = classmethod(lambda cls, recipe: Group())
    sys.exit(cli.main(["export", sys.argv[1], "--out", sys.argv[2], "--no-source"]))
""")


def test_sigterm_during_export_ends_cleanly_with_one_line(tmp_path):
    """Before: `export` installed no handler: SIGTERM went to Ray's C++ handler (a stack dump
    and SIGABRT) or, here without Ray, killed the process (exit -15), leaving the half-written
    folder. Now the ranks and Ray end, the partial folder is removed, exit 143, one line."""
    fake_run(tmp_path / "run")
    out = tmp_path / "hf"
    env = {k: v for k, v in os.environ.items() if k != "SKYRL_KDA_CP_EXCHANGE"}
    proc = subprocess.run([sys.executable, "-c", _EXPORT_UNDER_SIGTERM, str(tmp_path / "run"),
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**env, "TORCHDYNAMO_DISABLE": "1"})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    err = proc.stderr.splitlines()
    assert "ranks ended" in err and "ray shut down" in err and "Traceback" not in proc.stderr
    assert err[-1] == (f"stopped by SIGTERM during the export of {tmp_path / 'run' / 'checkpoints'}"
                       f"/step_00000002; nothing kept in {out}")
    assert not out.exists()


_SIGTERM_ONCE_RAY_IS_UP = textwrap.dedent("""
    import os, signal, sys, time
    from skyrl_megatron_kda.recipes import load_recipe
    from skyrl_megatron_kda.workers.lifetime import StartedRay

    one_rank = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1",
                "parallel.sequence_parallel=false", "run.num_workers=1"]
    ray_here = StartedRay(load_recipe("glm53_flash_tiny", one_rank).recipe.run)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # before a command installs its own handler
        time.sleep(60)
    except SystemExit:
        print("SystemExit", file=sys.stderr, flush=True)
    finally:
        ray_here.shutdown()
""")


def test_sigterm_between_ray_init_and_the_commands_handler_reaches_python():
    """Before: `ray.init` installed Ray's C++ failure-signal handler in the driver, which answers
    a SIGTERM arriving before `run` or `export` install their handler with `*** SIGTERM
    received ...`, a stack dump and SIGABRT (seen as exit 134 of `export`). Now Ray's Python
    handler gets it (SystemExit, which `train.run.start_ray` turns into one line)."""
    env = {k: v for k, v in os.environ.items() if k != "SKYRL_KDA_CP_EXCHANGE"}
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_ONCE_RAY_IS_UP], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**env, "TORCHDYNAMO_DISABLE": "1"})
    assert proc.returncode == 0 and "SystemExit" in proc.stderr, proc.stderr
    assert "SIGTERM received" not in proc.stderr


def test_a_stop_inside_ray_init_ends_the_process_past_its_shutdown(capsys, tmp_path,
                                                                    monkeypatch):
    """Before: after `stopped by SIGTERM while Ray was starting`, the interpreter's own shutdown
    could crash in Ray's half-made core worker (exit 139, seen on `export`). Now the command
    ends the process at once (`os._exit`) with 128 + the signal."""
    import skyrl_megatron_kda.train.run as train_run
    from skyrl_megatron_kda.train.stop import Interrupted

    def stopped_in_ray_init(recipe, **kwargs):
        raise Interrupted(signal.SIGTERM, "stopped by SIGTERM while Ray was starting (Ray ended "
                          "its processes); nothing saved", exit_at_once=True)

    def exit_now(status):
        raise SystemExit(f"os._exit({status})")

    monkeypatch.setattr(train_run, "run", stopped_in_ray_init)
    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(SystemExit, match=r"^os\._exit\(143\)$"):
        cli.main(run_in(tmp_path / "run"))
    assert capsys.readouterr().err.splitlines()[-1] == (
        "stopped by SIGTERM while Ray was starting (Ray ended its processes); nothing saved")


def test_a_fifo_as_data_path_is_refused_saying_what_it_is(capsys, tmp_path, no_ray):
    """Before: "data.path='...' does not exist", of a FIFO that exists."""
    fifo = tmp_path / "corpus.jsonl"
    os.mkfifo(fifo)
    line = refused(capsys, ["run", TINY, "--set", f"data.path={fifo}",
                            "--set", f"run.output_dir={tmp_path / 'out'}"])
    assert line == (f"error: data.path='{fifo}' is a named pipe (FIFO), not a file: data.path "
                    "must be a .jsonl file or a folder of them (the reader seeks in it to resume)")
