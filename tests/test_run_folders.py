"""What ``skyrl-kda run`` does with a used output folder and a damaged or changed checkpoint, as a
user runs it (the CLI driving Ray CPU actors; ``tests/support/cli_runs``). The refusals that
need no training are in ``test_cli.py``.

What a folder holds and how the CLI treats it depends neither on the mesh nor on who started Ray,
so the runs here are one rank (``cli_runs.ONE_RANK``) and join one Ray cluster the module starts
(``run.ray_address``, as on a cluster started by ``ray start``); the manifest of a TP2 x CP2 run
(every rank's shard, the mesh that saved it) is checked on the shared 4-rank reference run, which
starts its own Ray. One short run is shared: 3 steps that save only after step 2 (``latest`` =
step 2, so a resume with the same settings has a step left to train); each test works on its own
copy."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from skyrl_megatron_kda.train import manifest
from tests.conftest import local_cluster
from tests.support import cli_runs

STEPS = 3
SAVED_AT = 2


@pytest.fixture(scope="module")
def ray_address():
    with local_cluster(head_cpus=2) as cluster:
        yield cluster.address


@pytest.fixture(scope="module")
def steps(ray_address):
    """``steps(n)``: the command line's settings of a run of n steps on the module's cluster."""
    return lambda n: [*cli_runs.ONE_RANK, "--set", f"run.ray_address={ray_address}",
                      "--set", f"train.steps={n}"]


@pytest.fixture(scope="module")
def saved_run(steps):
    out = cli_runs.ROOT / "run_folders"
    rc, err = cli_runs.finish(cli_runs.start(out, *steps(STEPS), "--set", "train.save_at_end=false",
                                             "--set", f"train.save_interval={SAVED_AT}"))
    assert rc == 0, err[-3000:]
    return out


@pytest.fixture
def out(saved_run, tmp_path):
    """This test's copy of the saved run."""
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    return out


def _shard(out):
    return out / "checkpoints" / f"step_{SAVED_AT:08d}" / "__0_0.distcp"


def test_manifest_of_a_tp2_cp2_run_lists_every_ranks_shard_and_the_mesh():
    out, rc, err = cli_runs.reference_run()
    assert rc == 0, err[-3000:]
    record = manifest.verify(out / "checkpoints" / f"step_{cli_runs.STEPS:08d}")
    assert record["step"] == cli_runs.STEPS
    assert record["mesh"] == {"world": 4, "tp": 2, "cp": 2, "ep": 2, "etp": 1}
    assert sorted(f for f in record["files"] if f.endswith(".distcp")) == [
        f"__{rank}_0.distcp" for rank in range(4)]


def test_saved_checkpoint_verifies_and_resume_trains_the_last_step(out, steps):
    record = manifest.verify(_shard(out).parent)
    assert record["step"] == SAVED_AT and record["schedule"]["train.steps"] == STEPS
    assert "__0_0.distcp" in record["files"] and record["mesh"]["world"] == 1
    rc, err = cli_runs.finish(cli_runs.start(out, *steps(STEPS), "--resume"))
    assert rc == 0, err[-3000:]
    assert [m["step"] for m in cli_runs.metrics(out)] == [1, 2, 3]


def test_resume_from_a_shard_with_4kib_flipped_is_refused_naming_the_file(out, steps):
    size = _shard(out).stat().st_size
    cli_runs.flip_4kib(_shard(out))
    assert _shard(out).stat().st_size == size
    rc, err = cli_runs.finish(cli_runs.start(out, *steps(STEPS), "--resume"))
    assert rc != 0
    assert f"checkpoint {_shard(out).parent}: __0_0.distcp has changed since the save" in err, \
        err[-3000:]
    assert len(cli_runs.metrics(out)) == STEPS, "the corrupted checkpoint was trained on"


def test_truncated_shard_is_named(out, steps):
    data = _shard(out).read_bytes()
    _shard(out).write_bytes(data[:len(data) // 2])
    rc, err = cli_runs.finish(cli_runs.start(out, *steps(STEPS), "--resume"))
    assert rc != 0
    assert f"__0_0.distcp is {len(data) // 2} bytes, the manifest says {len(data)}" in err, \
        err[-3000:]
    assert "CheckpointException" not in err


def test_overwrite_moves_the_old_run_aside_and_says_so(out, steps, tmp_path):
    rc, err = cli_runs.finish(cli_runs.start(out, *steps(1), "--overwrite"))
    assert rc == 0, err[-3000:]
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(moved) == 1
    assert f"--overwrite: moved the previous run in {out} to {moved[0]}" in err
    assert [m["step"] for m in cli_runs.metrics(moved[0])] == [1, 2, 3]
    assert [m["step"] for m in cli_runs.metrics(out)] == [1]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"
    assert not (out / "checkpoints" / f"step_{SAVED_AT:08d}").exists()


def test_override_schedule_applies_the_new_steps_then_the_run_is_finished(out, steps):
    before = cli_runs.metrics(out)
    rc, err = cli_runs.finish(cli_runs.start(out, *steps(5), "--resume", "--override-schedule"))
    assert rc == 0, err[-3000:]
    assert f"--override-schedule: from step {SAVED_AT} on, train.steps {STEPS} -> 5" in err
    after = cli_runs.metrics(out)
    assert [m["step"] for m in after] == [1, 2, 3, 4, 5]
    assert after[:SAVED_AT] == before[:SAVED_AT]
    # Cosine decay to 0 at train.steps (step k runs at k - 1 steps done): step 3 of the saved
    # 3-step schedule ran at 0.25 x peak, in the 5-step one it runs at 0.5 (1 + cos(2 pi / 5)).
    peak = after[0]["lr"]
    assert abs(before[2]["lr"] - 0.25 * peak) < 1e-12
    assert abs(after[2]["lr"] - 0.5 * (1 + math.cos(2 * math.pi / 5)) * peak) < 1e-12
    assert json.loads((out / "checkpoints" / "step_00000005" / manifest.MANIFEST).read_text())[
        "schedule"]["train.steps"] == 5
    rc, err = cli_runs.finish(cli_runs.start(out, *steps(5), "--resume"), timeout=120)
    assert rc == 0 and f"{out} is finished: step_00000005 is at step 5 of train.steps=5" in err
