"""`skyrl-kda` on bad input: one `error: ...` line per problem on stderr, a non-zero exit status,
no traceback (unless --debug), and nothing started that the input could not use (Ray)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray
import yaml
from pydantic import ValidationError

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.config import CP_EXCHANGE_ENV
from skyrl_megatron_kda.console import error_lines
from skyrl_megatron_kda.recipes import BUILTIN_RECIPES, RECIPES_DIR, get_recipe, load_recipe
from skyrl_megatron_kda.train import manifest, run_folder
from tests.support import cli_runs

TINY = "glm53_flash_tiny"


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the command starts Ray: these inputs must be refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for an input that could be refused up front")

    monkeypatch.setattr(ray, "init", refuse)


def refused(capsys, argv: list[str], status: int = 2) -> str:
    """Run the CLI; it must exit ``status`` with one ``error:`` line; returns that line."""
    assert cli.main(argv) == status
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert "Traceback" not in captured.err and captured.out == ""
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def tiny_yaml(tmp_path, text: str | None = None):
    path = tmp_path / "recipe.yaml"
    path.write_text((RECIPES_DIR / BUILTIN_RECIPES[TINY]).read_text() if text is None else text)
    return path


# --- recipe and overrides -------------------------------------------------------------------


def test_unknown_recipe(capsys):
    line = refused(capsys, ["plan", "no_such_recipe"])
    assert "'no_such_recipe' is neither a registered recipe" in line and TINY in line


def test_override_not_key_value(capsys):
    assert "is not of the form section.key=value" in refused(capsys, ["plan", TINY, "--set", "parallel.tp"])


def test_override_not_valid_yaml(capsys):
    line = refused(capsys, ["plan", TINY, "--set", "train.recompute_layers=[kda"])
    assert "value is not valid YAML" in line and "line 1" in line


def test_override_unknown_key(capsys):
    line = refused(capsys, ["plan", TINY, "--set", "train.stepz=3"])
    assert line.endswith("train.stepz: unknown key") and TINY in line


def test_override_invalid_value(capsys):
    line = refused(capsys, ["plan", TINY, "--set", "parallel.tp=two"])
    assert "parallel.tp: Input should be a valid integer" in line and "'two'" in line


def test_override_invalid_mesh(capsys):
    line = refused(capsys, ["plan", TINY, "--set", "run.num_workers=6"])
    assert "run.num_workers=6 must be divisible by tp*cp*pp" in line


@pytest.mark.parametrize("pair, named", [
    ("model.moe.top_k=1", "model.moe.top_k=1 with model.moe.norm_topk_prob=true"),
    ("model.moe.norm_topk_prob=false", "model.moe.norm_topk_prob=false with model.moe.top_k=2"),
])
def test_run_refuses_a_router_megatron_cannot_build_before_ray(capsys, no_ray, pair, named):
    assert named in refused(capsys, ["run", TINY, "--set", pair])


def test_every_invalid_value_gets_its_line(capsys):
    assert cli.main(["plan", TINY, "--set", "parallel.tp=two", "--set", "train.stepz=3"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), err
    assert any("parallel.tp:" in line for line in lines)
    assert any("train.stepz: unknown key" in line for line in lines)


def test_bad_state_prepass(capsys):
    assert "state_prepass=-2.0 must be > -1" in refused(capsys, ["plan", TINY, "--state-prepass", "-2"])


# --- recipe files -------------------------------------------------------------------------


def test_missing_yaml_file(capsys, tmp_path):
    line = refused(capsys, ["plan", str(tmp_path / "nowhere.yaml")])
    assert "nowhere.yaml does not exist" in line


def test_malformed_yaml_file(capsys, tmp_path):
    path = tiny_yaml(tmp_path, "model:\n  hidden_size: [64\nparallel: {tp: 1}\n")
    line = refused(capsys, ["plan", str(path)])
    assert f"recipe file {path}: not valid YAML" in line and "line 3" in line


def test_empty_yaml_file(capsys, tmp_path):
    line = refused(capsys, ["plan", str(tiny_yaml(tmp_path, ""))])
    assert f"recipe file {tmp_path / 'recipe.yaml'} is empty" in line


def test_yaml_file_not_a_mapping(capsys, tmp_path):
    line = refused(capsys, ["plan", str(tiny_yaml(tmp_path, "- model\n- parallel\n"))])
    assert "must hold a mapping at top level" in line


# --- run and export: refused before Ray starts ----------------------------------------------


def test_run_with_missing_data_file(capsys, tmp_path, no_ray):
    line = refused(capsys, ["run", "--set", "data.path=/nonexistent/corpus.jsonl",
                            "--set", f"run.output_dir={tmp_path}"])
    assert "data.path='/nonexistent/corpus.jsonl' does not exist" in line


def test_run_with_data_folder_without_jsonl(capsys, tmp_path, no_ray):
    line = refused(capsys, ["run", TINY, "--set", f"data.path={tmp_path}",
                            "--set", f"run.output_dir={tmp_path / 'out'}"])
    assert "is a directory without *.jsonl files" in line


def test_resume_without_checkpoint(capsys, tmp_path, no_ray):
    line = refused(capsys, ["run", TINY, "--resume", "--set", f"run.output_dir={tmp_path}"])
    assert "--resume:" in line and "has no checkpoint" in line


def test_export_of_a_folder_that_is_no_run(capsys, tmp_path, no_ray):
    line = refused(capsys, ["export", str(tmp_path), "--out", str(tmp_path / "hf")])
    assert "RUN_DIR must be" in line


def test_export_without_checkpoint(capsys, tmp_path, no_ray):
    tiny_yaml(tmp_path)  # recipe.yaml, as a run writes it, but no checkpoints/
    line = refused(capsys, ["export", str(tmp_path), "--out", str(tmp_path / "hf")])
    assert "has no checkpoint to export" in line


def test_demo_with_unknown_exchange(capsys, no_ray):
    line = refused(capsys, ["demo", "--exchanges", "a2a,ring"])
    assert "kda.cp_exchange: Input should be" in line and "'ring'" in line


# --- run folders, resume and checkpoint verify: answered before Ray starts -------------------


def fake_run(out, steps: int = 4, saved_at: int = 2):
    """A run folder as ``skyrl-kda run`` leaves it, without training: the ``recipe.yaml`` it
    wrote, ``saved_at`` metrics lines and one checkpoint (a 16 KiB stand-in shard with a real
    manifest) of a ``steps``-step run of the tiny recipe. Returns the shard's path."""
    out.mkdir(parents=True)
    recipe = load_recipe(TINY, [f"train.steps={steps}", f"run.output_dir={out}"], environ={}).recipe
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"),
                                                    sort_keys=False))  # as train/run.py does
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 5.0}}\n'
                                               for s in range(1, saved_at + 1)))
    shard = fake_checkpoint(out, saved_at, steps)
    (out / "checkpoints" / "latest").write_text(shard.parent.name)
    return shard


def fake_checkpoint(out, step: int, steps: int = 4, with_manifest: bool = True):
    """``checkpoints/step_<step>`` of ``fake_run``'s run (``latest`` untouched); without its
    manifest it is a save that did not finish. Returns the shard's path."""
    ckpt = out / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(bytes(range(256)) * 64)
    schedule = get_recipe(TINY, [f"train.steps={steps}"], environ={}).train.schedule()
    if with_manifest:
        manifest.write(ckpt, step=step, mesh={"world": 4, "tp": 2, "cp": 2, "ep": 2, "etp": 1},
                       schedule=schedule, recipe_sha256="0" * 64)
    return shard


def run_in(out, *args: str) -> list[str]:
    return ["run", TINY, "--set", f"run.output_dir={out}", "--set", "train.steps=4", *args]


def test_run_into_a_used_folder_is_refused(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run")
    line = refused(capsys, run_in(tmp_path / "run"))
    assert f"{tmp_path / 'run'} already holds a run" in line
    assert "--resume" in line and "--overwrite" in line
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # untouched


def test_overwrite_and_resume_exclude_each_other(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run")
    line = refused(capsys, run_in(tmp_path / "run", "--resume", "--overwrite"))
    assert "--overwrite and --resume exclude each other" in line


def test_resume_with_a_changed_schedule_is_refused_naming_the_fields(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run", steps=4)
    line = refused(capsys, run_in(tmp_path / "run", "--resume", "--set", "train.steps=6",
                                  "--set", "train.lr=0.001", "--set", "train.warmup_steps=1"))
    assert "the schedule differs from step_00000002's" in line
    assert "train.steps 4 -> 6" in line and "train.lr 0.003 -> 0.001" in line
    assert "train.warmup_steps 0 -> 1" in line and "--override-schedule" in line


def test_override_schedule_needs_resume(capsys, tmp_path, no_ray):
    line = refused(capsys, run_in(tmp_path / "new", "--override-schedule"))
    assert "--override-schedule applies to a resumed run only" in line


def test_resume_of_a_finished_run_says_so_and_trains_nothing(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run", steps=2, saved_at=2)
    assert cli.main(["run", TINY, "--resume", "--set", f"run.output_dir={tmp_path / 'run'}",
                     "--set", "train.steps=2"]) == 0
    err = capsys.readouterr().err
    finished = (f"{tmp_path / 'run'} is finished: step_00000002 is at step 2 of train.steps=2 "
                "(nothing to train)")
    assert err.splitlines() == [finished]


def test_resume_from_a_checkpoint_without_manifest_is_refused(capsys, tmp_path, no_ray):
    shard = fake_run(tmp_path / "run")
    (shard.parent / manifest.MANIFEST).unlink()
    line = refused(capsys, run_in(tmp_path / "run", "--resume"))
    assert f"checkpoint {shard.parent} has no manifest.json: its save did not finish" in line


@pytest.mark.parametrize("pair, named", [
    ("model.hidden_size=32", "model.hidden_size 64 -> 32"),
    ("model.moe.num_experts=4", "model.moe.num_experts 8 -> 4"),
])
def test_resume_with_a_changed_model_is_refused_before_ray(capsys, tmp_path, no_ray, pair, named):
    fake_run(tmp_path / "run")
    line = refused(capsys, run_in(tmp_path / "run", "--resume", "--set", pair))
    assert line == (f"error: --resume: the model differs from the run's recipe.yaml: {named} (a "
                    "checkpoint loads only into the model it saved; start a new run.output_dir)")


def test_a_mesh_or_memory_change_passes_the_model_check(tmp_path):
    """The control: another mesh (CP2 -> CP1 on 2 ranks), another exchange and memory levers are
    free on a resume; the run continues from the saved checkpoint."""
    shard = fake_run(tmp_path / "run")
    recipe = get_recipe(TINY, [f"run.output_dir={tmp_path / 'run'}", "train.steps=4",
                               "run.resume=true", "parallel.cp=1", "run.num_workers=2",
                               "kda.cp_exchange=allgather", "train.recompute=full",
                               "model.hyper_connections.map_chunk_rows=64",
                               "model.dsa.torch.attention_block=16"], environ={})
    start = run_folder.prepare(recipe)
    assert start.resume_from == shard.parent and start.step == 2 and start.notes == []


def test_resume_with_an_empty_latest_names_the_step_to_continue_from(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    latest.write_text("")
    advice = (f"error: {latest} is empty; step_00000002 verifies: continue with skyrl-kda run "
              "RECIPE --resume --from-step 2")
    assert refused(capsys, run_in(tmp_path / "run", "--resume")) == advice
    assert refused(capsys, ["checkpoint", "verify", str(tmp_path / "run")]) == advice


def test_latest_naming_a_missing_folder_names_the_step_to_continue_from(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    latest.write_text("step_00000003")
    assert refused(capsys, run_in(tmp_path / "run", "--resume")) == (
        f"error: {latest} names step_00000003, which does not exist; step_00000002 verifies: "
        "continue with skyrl-kda run RECIPE --resume --from-step 2")


def test_missing_latest_names_the_newest_step_that_verifies(capsys, tmp_path, no_ray):
    """``latest`` is gone, and the newest step folder is a save that did not finish (no
    manifest): --resume picks nothing silently, and names the older one."""
    fake_run(tmp_path / "run")
    fake_checkpoint(tmp_path / "run", 4, with_manifest=False)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    latest.unlink()
    advice = (f"error: {latest} is missing; step_00000002 verifies: continue with skyrl-kda run "
              "RECIPE --resume --from-step 2 (newer: step_00000004 has no manifest.json: its save "
              "did not finish)")
    assert refused(capsys, run_in(tmp_path / "run", "--resume")) == advice
    assert refused(capsys, ["checkpoint", "verify", str(tmp_path / "run")]) == advice


def test_from_step_resumes_from_that_step_folder(tmp_path):
    shard = fake_run(tmp_path / "run", saved_at=3)
    older = fake_checkpoint(tmp_path / "run", 2)
    recipe = get_recipe(TINY, [f"run.output_dir={tmp_path / 'run'}", "train.steps=4",
                               "run.resume=true"], environ={})
    assert run_folder.prepare(recipe).resume_from == shard.parent  # latest
    start = run_folder.prepare(recipe, from_step=2)
    assert start.resume_from == older.parent and start.step == 2


def test_from_step_needs_resume(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run")
    line = refused(capsys, run_in(tmp_path / "run", "--from-step", "2"))
    assert line == "error: --from-step applies to a resumed run only (add --resume)"


def test_from_step_of_a_missing_or_unfinished_folder_is_refused(capsys, tmp_path, no_ray):
    fake_run(tmp_path / "run")
    missing = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert refused(capsys, run_in(tmp_path / "run", "--resume", "--from-step", "3")) == (
        f"error: --from-step 3: {missing} does not exist")
    unfinished = fake_checkpoint(tmp_path / "run", 3, with_manifest=False).parent
    line = refused(capsys, run_in(tmp_path / "run", "--resume", "--from-step", "3"))
    assert f"checkpoint {unfinished} has no manifest.json: its save did not finish" in line


def test_checkpoint_verify_of_a_good_checkpoint(capsys, tmp_path):
    fake_run(tmp_path / "run")
    assert cli.main(["checkpoint", "verify", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].endswith("ok, step 2, 1 files, 0.0 MiB match their sha256; "
                                             "mesh world4 tp2 cp2 ep2 etp1")


@pytest.mark.parametrize("damage, expected", [
    ("flip", "__0_0.distcp has changed since the save (sha256 differs from the manifest)"),
    ("truncate", "__0_0.distcp is 8192 bytes, the manifest says 16384 (truncated"),
    ("delete", "__0_0.distcp is missing"),
    ("add", "extra.distcp is not in the manifest"),
    ("no manifest", "has no manifest.json"),
])
def test_checkpoint_verify_names_the_damaged_file(capsys, tmp_path, damage, expected):
    shard = fake_run(tmp_path / "run")
    if damage == "flip":
        cli_runs.flip_4kib(shard)
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:8192])
    elif damage == "delete":
        shard.unlink()
    elif damage == "add":
        (shard.parent / "extra.distcp").write_bytes(b"x")
    else:
        (shard.parent / manifest.MANIFEST).unlink()
    line = refused(capsys, ["checkpoint", "verify", str(tmp_path / "run")])
    assert line.startswith(f"error: checkpoint {shard.parent}") and expected in line


def test_report_names_the_cut_metrics_line(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.9}\n'
                                            '{"step": 3, "lo')
    line = refused(capsys, ["report", str(tmp_path)])
    assert f"{tmp_path / 'metrics.jsonl'}:3: not a JSON line" in line


# --- errors from Ray ranks, and --debug ---------------------------------------------------


def test_worker_error_shows_the_rank_and_its_message_first():
    from skyrl_megatron_kda.workers.errors import RankError, WorkerError

    try:
        raise ValueError("corpus.jsonl:7: invalid_json (Expecting value)\nsecond line")
    except ValueError as err:
        cause = RankError.of(3, err)
    task_error = ray.exceptions.RayTaskError("train_step", "Traceback (most recent call last): ...",
                                             cause)
    try:
        raise WorkerError(3, task_error) from task_error
    except WorkerError as err:
        lines, status = error_lines(err, "run")
        notes = err.__notes__
    assert status == 1
    assert lines == ["error: rank 3: corpus.jsonl:7: invalid_json (Expecting value) "
                     "(run failed, ValueError)"]
    # --debug shows the rank's own traceback.
    assert any("raise ValueError" in note for note in notes), notes


def test_dead_rank_is_named_with_the_failed_command():
    from skyrl_megatron_kda.workers.errors import WorkerError

    died = ray.exceptions.ActorDiedError()
    try:
        raise WorkerError(1, died) from died
    except WorkerError as err:
        lines, status = error_lines(err, "run")
    assert status == 1 and len(lines) == 1
    assert lines[0].startswith("error: rank 1 died: The actor died unexpectedly")
    assert lines[0].endswith("(run failed, ActorDiedError)")


def test_debug_raises_with_the_traceback():
    with pytest.raises(ValidationError, match=r"train\.stepz"):
        cli.main(["--debug", "plan", TINY, "--set", "train.stepz=3"])
    with pytest.raises(KeyError):
        cli.main(["plan", "no_such_recipe", "--debug"])


def test_console_script_prints_one_line_and_debug_the_traceback():
    """As a user runs it (a process of its own): the entry point's exit status and stderr."""
    command = [sys.executable, "-m", "skyrl_megatron_kda.cli", "plan", "no_such_recipe"]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2
    assert plain.stderr.splitlines() == [plain.stderr.strip()] and plain.stderr.startswith("error: ")
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, timeout=300)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "no_such_recipe" in debug.stderr


def test_yaml_error_without_a_mark_is_one_line():
    lines, status = error_lines(yaml.YAMLError("first\nsecond"))
    assert (lines, status) == (["error: not valid YAML: first"], 2)
