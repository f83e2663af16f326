"""The RL example's launcher (``examples/rl_tiny/run_rl_tiny.sh``) on bad input: one ``error:``
line on stderr, exit status 2, no traceback, and no Ray. The script's own checks (the mesh, a
finished WORKDIR) come before it writes anything; a bad SkyRL setting is refused by the KDA
entrypoint under SkyRL's ``main_base`` (after the script made the example's inputs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.rl_tiny_jobs import SCRIPT


def _script(work, *settings: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, WORKDIR=str(work), PYTHON=sys.executable, TORCHDYNAMO_DISABLE="1",
                **env)
    full.pop("SKYRL_KDA_CP_EXCHANGE", None)
    return subprocess.run(["bash", str(SCRIPT), *settings], env=full, capture_output=True,
                          text=True, timeout=600)


def _one_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and done.stderr.splitlines()[-1] == errors[0], done.stderr[-3000:]
    assert "Started a local Ray instance" not in done.stderr and "worker logs:" not in done.stdout
    return errors[0]


def test_an_unknown_mesh_is_one_error_line_and_writes_nothing(tmp_path):
    work = tmp_path / "work"
    assert _one_error(_script(work, MESH="tp9")) == "error: MESH=tp9: choose tp1 or tp2cp2"
    assert not work.exists()


@pytest.mark.parametrize("env, error", [
    ({"STEPS": "two"}, "error: STEPS=two: a whole number, e.g. STEPS=2"),
    ({"FULLY_ASYNC": "-1"}, "error: FULLY_ASYNC=-1: a whole number, e.g. FULLY_ASYNC=2"),
])
def test_a_count_that_is_not_a_number_is_one_error_line_and_writes_nothing(tmp_path, env, error):
    work = tmp_path / "work"
    assert _one_error(_script(work, **env)) == error
    assert not work.exists()


@pytest.mark.parametrize("env, error", [
    ({"RECIPE": "glm53_flash_huge"}, "error: --recipe glm53_flash_huge: 'glm53_flash_huge' is "
     "neither a registered recipe (glm53_flash_1m, glm53_flash_slice, glm53_flash_tiny) nor a "
     ".yaml/.yml file"),
    ({"PROMPT_WORDS": "40:28"}, "error: argument --prompt-words: '40:28': needs 1 <= MIN <= MAX"),
    ({"PROMPT_WORDS": "long"}, "error: argument --prompt-words: 'long': MIN:MAX, e.g. 28:40"),
])
def test_a_bad_recipe_or_prompt_length_is_one_error_line_and_writes_nothing(tmp_path, env, error):
    work = tmp_path / "work"
    assert _one_error(_script(work, **env)) == error
    assert not work.exists()


def test_a_finished_workdir_is_one_error_line_and_is_left_alone(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text('{"step": 1}\n')
    error = _one_error(_script(tmp_path))
    assert error == f"error: {tmp_path} holds a finished job: use a fresh WORKDIR"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]


def test_a_bad_skyrl_setting_is_one_error_line_from_the_entrypoint(tmp_path):
    """The script passes KEY=VALUE to ``main_base``; SkyRL's own parser errors through
    ``main_base`` are tests/test_skyrl.py's."""
    named = "trainer.kda.sampler='bogus': choose one of vllm, glm5_next"
    assert named in _one_error(_script(tmp_path / "work", "trainer.kda.sampler=bogus"))
