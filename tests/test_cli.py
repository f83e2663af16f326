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
from skyrl_megatron_kda.recipes import BUILTIN_RECIPES, RECIPES_DIR

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


# --- errors from Ray ranks, and --debug ---------------------------------------------------


def test_worker_error_shows_the_rank_exception_first():
    from skyrl_megatron_kda.workers.group import WorkerError

    cause = ValueError("corpus.jsonl:7: invalid_json (Expecting value)\nsecond line")
    task_error = ray.exceptions.RayTaskError("train_step", "Traceback (most recent call last): ...",
                                             cause)
    try:
        raise WorkerError(3, task_error) from task_error
    except WorkerError as err:
        lines, status = error_lines(err, "run")
    assert status == 1
    assert lines == ["error: corpus.jsonl:7: invalid_json (Expecting value) "
                     "(run failed: rank 3 failed, ValueError)"]


def test_worker_error_that_ray_could_not_unpickle():
    from skyrl_megatron_kda.workers.group import WorkerError

    trace = ("Traceback (most recent call last):\n  File \"data.py\", line 3, in read\n"
             "skyrl_megatron_kda.train.data.BadRecord: bad.jsonl:2: invalid_json: not JSON\n")
    cause = ray.exceptions.UnserializableException(trace)
    task_error = ray.exceptions.RayTaskError("train_step", trace, cause)
    try:
        raise WorkerError(0, task_error) from task_error
    except WorkerError as err:
        lines, _ = error_lines(err, "run")
    assert lines == ["error: bad.jsonl:2: invalid_json: not JSON (run failed: rank 0 failed, BadRecord)"]


def test_dead_rank_is_named_with_the_failed_command():
    from skyrl_megatron_kda.workers.group import WorkerError

    died = ray.exceptions.ActorDiedError()
    try:
        raise WorkerError(1, died) from died
    except WorkerError as err:
        lines, status = error_lines(err, "run")
    assert status == 1 and len(lines) == 1
    assert lines[0].startswith("error: The actor died unexpectedly")
    assert "(run failed: rank 1 died, ActorDiedError)" in lines[0]


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
