"""Training end to end: `skyrl-kda run` over 4 Ray CPU actors (loss falls, metrics, recipe,
progress, report; a dead actor is named), and CP1 == CP2 losses for every KDA exchange."""

import json
import math
import random
import re
import signal
import struct

import pytest
import yaml

from skyrl_megatron_kda.config import Recipe
from skyrl_megatron_kda.train.outputs import AUTO_CHOICES
from skyrl_megatron_kda.train.report import PLOTS, write_report
from tests.support import cli_runs
from tests.support.mesh_runs import EXCHANGES, STEPS, mesh_runs
from tests.support.watched_run import WatchedRun

METRIC_KEYS = {"step", "loss", "grad_norm", "tokens", "step_time_s", "exchange", "cp_bytes"}


def test_tiny_recipe_trains_on_ray_actors():
    out, rc, err = cli_runs.reference_run()
    assert rc == 0, err[-3000:]
    lines = cli_runs.metrics(out)
    assert [m["step"] for m in lines] == list(range(1, cli_runs.STEPS + 1))
    for m in lines:
        assert METRIC_KEYS <= set(m), m
        assert m["exchange"] == "a2a" and m["tokens"] == 256 and m["cp_bytes"] > 0
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["step_time_s"] > 0
    losses = [m["loss"] for m in lines]
    # Each step here lowers the loss by ~0.05 (16-token alphabet, lr 1e-3); step noise is smaller.
    assert losses[-1] < losses[0] - 0.1, f"loss did not fall: {losses}"
    recipe = Recipe.model_validate(yaml.safe_load((out / "recipe.yaml").read_text()))
    assert recipe.parallel.tp == 2 and recipe.parallel.cp == 2 and recipe.run.num_workers == 4
    # The tiny recipe leaves the DSA kernel to auto: its reason beside recipe.yaml and on stderr.
    choices = yaml.safe_load((out / AUTO_CHOICES).read_text())
    assert list(choices) == ["model.dsa.kernel"]
    assert choices["model.dsa.kernel"].startswith("torch: ")
    assert f"model.dsa.kernel=auto -> {choices['model.dsa.kernel']}" in err
    assert "tok/s" in err and "ETA" in err and f"step {cli_runs.STEPS}/{cli_runs.STEPS}" in err
    assert (out / "checkpoints" / "latest").read_text() == f"step_{cli_runs.STEPS:08d}"


def test_report_draws_pngs():
    out, rc, _ = cli_runs.reference_run()
    assert rc == 0
    paths = write_report(out)
    assert sorted(p.name for p in paths) == sorted(PLOTS)
    for path in paths:
        head = path.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n", path
        width, height = struct.unpack(">II", head[16:24])
        assert width > 100 and height > 100


def test_report_refuses_a_folder_without_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no steps yet"):
        write_report(tmp_path)


def test_dead_actor_ends_the_run_naming_the_rank():
    """The error line is the last line even where stdout shares the pipe: Ray's driver writes
    its own account of the dead worker to stdout."""
    out = cli_runs.ROOT / "dead_actor"
    run = WatchedRun(out, with_stdout=True)
    run.wait_for_text("step 1/")
    actors = run.rank_actors()
    assert len(actors) == 4, [a.cmdline() for a in actors]
    actors[1].send_signal(signal.SIGKILL)
    rc, err = run.finish(timeout=120)
    assert rc == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"error: rank [0-3] died: .*\(run failed, \w+\)", last), err[-3000:]
    assert run.left_running() == [], "processes outlived the driver"


ONE_RANK = tuple(f"--set={pair}" for pair in (
    "parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
    "run.num_workers=1"))


def _documents(rng: random.Random, n: int) -> bytes:
    return b"".join(json.dumps({"input_ids": [rng.randrange(16) for _ in range(rng.randint(8, 60))]}
                               ).encode() + b"\n" for _ in range(n))


def test_skipped_records_reach_metrics_and_console(tmp_path):
    """data.on_bad_record=skip: the skips per file and reason are in every metrics line and in one
    console line at the end; a file that starts with a UTF-8 BOM keeps its first record (else it
    would count as invalid_json); kda.cp_exchange=auto's choice is on the console."""
    rng, corpus = random.Random(1), tmp_path / "corpus"
    corpus.mkdir()
    a, b = corpus / "a.jsonl", corpus / "b.jsonl"
    a.write_bytes(b"\xef\xbb\xbf" + _documents(rng, 20) + b"{broken\n" + _documents(rng, 5) + b"[1]\n")
    b.write_bytes(_documents(rng, 20) + b'{"input_ids": [999]}\n')
    out = tmp_path / "run"
    proc = cli_runs.start(out, *ONE_RANK, f"--set=data.path={corpus}", "--set=data.on_bad_record=skip",
                          "--set=train.steps=2", "--set=kda.cp_exchange=auto")
    rc, err = cli_runs.finish(proc)
    assert rc == 0, err[-3000:]
    # The shuffle buffer (1024 documents) reads the whole pass before the first row.
    want = {str(a): {"invalid_json": 1, "wrong_type": 1}, str(b): {"token_out_of_range": 1}}
    assert [m["skipped_records"] for m in cli_runs.metrics(out)] == [want, want]
    assert (f"data: skipped 3 bad records ({a}: invalid_json=1, wrong_type=1; "
            f"{b}: token_out_of_range=1)") in err.splitlines(), err[-3000:]
    assert re.search(r"^kda\.cp_exchange=auto -> \w+: ", err, re.MULTILINE), err[-3000:]


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_cp2_losses_equal_cp1(exchange):
    runs = mesh_runs()
    cp1 = [m["loss"] for m in runs["cp1"]]
    cp2 = [m["loss"] for m in runs["cp2"][exchange]]
    assert len(cp1) == len(cp2) == STEPS
    assert [m["exchange"] for m in runs["cp2"][exchange]] == [exchange] * STEPS
    first = abs(cp2[0] - cp1[0]) / cp1[0]
    assert first < 1e-5, f"{exchange}: first loss {cp2[0]} at CP2 vs {cp1[0]} at CP1 ({first:.1e})"
    worst = max(abs(a - b) for a, b in zip(cp1, cp2))
    assert worst < 1e-4, f"{exchange}: loss curves differ by {worst:.1e}: CP1 {cp1}, CP2 {cp2}"
    # The curve moves by far more than the tolerance, so equal curves are not equal by accident.
    assert max(cp1) - min(cp1) > 1e-3, cp1
    assert runs["cp2"][exchange][0]["cp_bytes"] > 0  # the CP2 run did cross the CP group
