"""The dry run checks what the launch will read or import (``integrations/skyrl/gate.py``,
``check_inputs``; ``config.wrong_types``): each case is SkyRL's real ``main_base`` in this process
with the RL example's job (``examples/rl_tiny/run_rl_tiny.sh``'s settings, one rank) and one
setting changed, and must end in one ``error:`` line naming the key and the fix, exit 2, before
anything starts. Before these checks each passed the dry run (exit 0, or 1 with a traceback) and
failed minutes into the launch inside Ray. The job unchanged stays ``launch: ready``.

In this process, not one per case: an interpreter start with torch, megatron-core and SkyRL
costs seconds on 2 cores; a case costs a parse of SkyRL's command line.
"""

from __future__ import annotations

import json
import sys

import pytest

from skyrl_megatron_kda.config import CP_EXCHANGE_ENV
from skyrl_megatron_kda.integrations.skyrl import ENTRYPOINT
from skyrl_megatron_kda.model.hf_io import hf_text_config
from skyrl_megatron_kda.recipes import get_recipe

from examples.rl_tiny.make_inputs import make_dataset
from examples.rl_tiny.words_env import ENV

PROMPTS = 16  # make_dataset's default; the job's batch is 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The example's inputs the gate reads: the model's config.json and the prompts."""
    work = tmp_path_factory.mktemp("gate")
    (work / "hf").mkdir()
    (work / "hf" / "config.json").write_text(json.dumps(hf_text_config(get_recipe("glm53_flash_tiny"))))
    make_dataset(work / "train.jsonl")
    return work


def _job(work) -> list[str]:
    """run_rl_tiny.sh's settings at MESH=tp1 (the ones the gate reads), with a dry run."""
    mesh = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
            "run.num_workers=1", "run.device=cpu", f"run.init_from_hf={work / 'hf'}"]
    return [
        "trainer.kda.recipe=glm53_flash_tiny", *[f"trainer.kda.overrides.{m}" for m in mesh],
        "trainer.kda.sampler=glm5_next", "trainer.kda.env_modules=[examples.rl_tiny.words_env]",
        "trainer.strategy=megatron", "trainer.logger=console",
        f"trainer.policy.model.path={work / 'hf'}", f"data.train_data=['{work / 'train.jsonl'}']",
        "data.val_data=[]", "trainer.eval_interval=-1", "trainer.eval_before_train=false",
        f"trainer.ckpt_path={work / 'ckpt'}", f"trainer.export_path={work / 'export'}",
        f"trainer.log_path={work / 'logs'}", "trainer.placement.colocate_all=false",
        "trainer.placement.policy_num_gpus_per_node=1", "trainer.placement.ref_num_gpus_per_node=1",
        "trainer.algorithm.advantage_estimator=grpo", "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=4", "trainer.micro_train_batch_size_per_gpu=2",
        "trainer.micro_forward_batch_size_per_gpu=2", "trainer.max_prompt_length=64",
        "generator.n_samples_per_prompt=2", "generator.sampling_params.max_generate_length=40",
        "generator.sampling_params.logprobs=0", "generator.inference_engine.num_engines=1",
        "generator.inference_engine.enable_ray_prometheus_stats=false", "trainer.bf16=false",
        "trainer.kda.dry_run=true"]


def _main_base(monkeypatch, capsys, args: list[str]):
    """(exit status, stdout, stderr) of ``python -m skyrl.train.entrypoints.main_base`` with the
    KDA entrypoint and ``args``, run here."""
    from skyrl.train.entrypoints import main_base

    from skyrl_megatron_kda.integrations.skyrl import entrypoint

    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", [main_base.__file__, f"trainer.override_entrypoint={ENTRYPOINT}",
                                      *args])
    # Nothing may start: a launch that got past the checks stops here.
    monkeypatch.setattr(entrypoint, "start_local_ray", lambda cfg: sys.exit("reached Ray"))
    try:
        main_base.main()
        status = 0
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else 1
    out = capsys.readouterr()
    return status, out.out, out.err


def _one_error(done) -> str:
    status, out, err = done
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(errors) == 1, (status, out[-2000:], err[-3000:])
    assert "Traceback" not in err and err.splitlines()[-1] == errors[0], err[-3000:]
    assert "launch: ready" not in out and "reached Ray" not in err
    return errors[0]


def test_the_examples_job_is_ready_and_says_what_it_read(monkeypatch, capsys, work):
    status, out, err = _main_base(monkeypatch, capsys, _job(work))
    assert status == 0, out[-2000:] + err[-3000:]
    lines = out.splitlines()
    assert lines[-1] == "launch: ready"
    assert f"data.train_data: {PROMPTS} prompts in 1 file(s); env_class {ENV}" in lines


def _write(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


CASES = {
    # case id: (settings changed, files to write {name: lines}, the error line's start)
    "train_data_missing": (["data.train_data=['{work}/no_such.jsonl']"], {},
                           "error: data.train_data: no file '{work}/no_such.jsonl' on this node"),
    "train_data_first_record_not_json": (
        ["data.train_data=['{work}/broken.jsonl']"], {"broken.jsonl": ["{prompt: 1}"]},
        "error: data.train_data: {work}/broken.jsonl line 1 is not JSON"),
    "train_data_record_without_prompt": (
        ["data.train_data=['{work}/no_prompt.jsonl']"],
        {"no_prompt.jsonl": [json.dumps({"question": "2+2", "env_class": ENV})]},
        "error: data.train_data: record 1 of {work}/no_prompt.jsonl has no 'prompt' list"),
    "data_env_class_mistyped": (
        ["data.train_data=['{work}/typo.jsonl']"],
        {"typo.jsonl": [json.dumps({"prompt": [{"role": "user", "content": "a b"}],
                                    "env_class": "rl_tiny_wrods"})] * 4},
        "error: the data's env_class 'rl_tiny_wrods' is not a registered environment"),
    "config_env_class_mistyped": (["environment.env_class=gsm8kk"], {},
                                  "error: environment.env_class 'gsm8kk' is not a registered"),
    "top_p": (["generator.sampling_params.top_p=0.9"], {},
              "error: generator.sampling_params.top_p=0.9: not served by the project's sampler "
              "(trainer.kda.sampler=glm5_next; accepted: (None, 1.0)); drop it, or use "
              "trainer.kda.sampler=vllm"),
    "top_k": (["generator.sampling_params.top_k=5"], {},
              "error: generator.sampling_params.top_k=5: not served by the project's sampler"),
    "stop": (["generator.sampling_params.stop=['x']"], {},
             "error: generator.sampling_params.stop=['x']: not served by the project's sampler"),
    "additional_kwargs": (["generator.sampling_params.additional_kwargs={{presence_penalty: 1.0}}"],
                          {}, "error: generator.sampling_params.additional_kwargs.presence_penalty="
                          "1.0: not served by the project's sampler"),
    "repetition_penalty": (["generator.sampling_params.repetition_penalty=1.2"], {},
                           "error: generator.sampling_params.repetition_penalty=1.2: SkyRL does not "
                           "send it"),
    "batch_larger_than_data": (
        ["trainer.train_batch_size=32", "trainer.policy_mini_batch_size=32"], {},
        "error: trainer.train_batch_size=32 is larger than data.train_data (16 prompts)"),
    "lr_not_a_number": (["trainer.policy.optimizer_config.lr=abc"], {},
                        "error: trainer.policy.optimizer_config.lr='abc': needs a number, e.g. "
                        "trainer.policy.optimizer_config.lr=1e-06"),
    "bool_not_a_bool": (["trainer.bf16=maybe"], {},
                        "error: trainer.bf16='maybe': needs true or false"),
    "int_null": (["trainer.epochs=null"], {}, "error: trainer.epochs=None: needs a whole number"),
    "resume_path_missing": (
        ["trainer.resume_mode=from_path", "trainer.resume_path={work}/ckpt/global_step_1"], {},
        "error: trainer.resume_path: no folder '{work}/ckpt/global_step_1' on this node"),
    "resume_path_unset": (["trainer.resume_mode=from_path"], {},
                          "error: trainer.resume_mode=from_path needs trainer.resume_path"),
    "logger_unknown": (["trainer.logger=tensorbord"], {},
                       "error: trainer.logger='tensorbord': choose one of"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_the_launch_cannot_read_is_one_error_line(monkeypatch, capsys, work, case):
    changed, files, error = CASES[case]
    for name, lines in files.items():
        _write(work / name, lines)
    changed = [c.format(work=work) for c in changed]
    keys = {c.split("=")[0] for c in changed}
    args = [a for a in _job(work) if a.split("=")[0] not in keys] + changed
    assert _one_error(_main_base(monkeypatch, capsys, args)).startswith(error.format(work=work))


def test_a_logger_that_is_not_installed_is_one_error_line(monkeypatch, capsys, work):
    """tensorboard stood in as not installed (it is not in this venv either)."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    args = [a for a in _job(work) if not a.startswith("trainer.logger=")]
    error = _one_error(_main_base(monkeypatch, capsys, [*args, "trainer.logger=tensorboard"]))
    assert error.startswith("error: trainer.logger=tensorboard: the 'tensorboard' package is not "
                            "installed here; pip install 'skyrl_megatron_kda[loggers]'")


def test_the_launch_refuses_them_too_before_ray(monkeypatch, capsys, work):
    args = [a for a in _job(work) if a not in ("trainer.kda.dry_run=true",)
            and not a.startswith("data.train_data=")]
    error = _one_error(_main_base(monkeypatch, capsys, [*args, "data.train_data=['/no/such.jsonl']"]))
    assert error.startswith("error: data.train_data: no file '/no/such.jsonl'")


def test_a_tracker_whose_logger_is_missing_says_so_and_finishes_quietly(monkeypatch, tmp_path):
    """The tracker is built in the experiment: a missing logger module is one line naming the
    setting, and SkyRL's ``__del__`` then finishes nothing (it warned of a missing 'logger')."""
    from loguru import logger

    from skyrl_megatron_kda.integrations.skyrl.tracking import KDATracking

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING")
    try:
        tracker = object.__new__(KDATracking)
        with pytest.raises(ModuleNotFoundError, match="trainer.logger=tensorboard: the 'tensorboard' "
                                                      "package is not installed"):
            tracker.__init__(metrics_file=tmp_path / "m.jsonl", steps_file=tmp_path / "s.log",
                             suffix="", project_name="p", experiment_name="e",
                             backend="tensorboard", config=None)
        tracker.__del__()
    finally:
        logger.remove(sink)
    assert warnings == []


def test_skyrls_prompt_filter_gets_the_settings_process_count(monkeypatch, work):
    """SkyRL's main_base filters prompts with 8 processes whatever the machine; the KDA
    experiment passes ``trainer.kda.prompt_filter_processes`` (default min(8, CPUs))."""
    import os

    from skyrl_megatron_kda.integrations.skyrl import entrypoint
    from skyrl_megatron_kda.integrations.skyrl.config import prompt_filter_processes

    seen = []

    class Recorder:
        def __init__(self, datasets, tokenizer, max_prompt_length, num_workers):
            seen.append(num_workers)

        def __len__(self):
            return PROMPTS

    monkeypatch.setattr(entrypoint, "PromptDataset", Recorder)
    for given, expected in ((["trainer.kda.prompt_filter_processes=1"], 1),
                            ([], min(8, len(os.sched_getaffinity(0))))):
        exp = object.__new__(entrypoint.KDAPPOExp)
        exp.cfg, exp.tokenizer = entrypoint.parse([*_job(work), *given]), None
        assert prompt_filter_processes(exp.cfg.trainer.kda) == expected
        exp.get_train_dataset()
    assert seen == [1, min(8, len(os.sched_getaffinity(0)))]


def test_the_fully_async_console_says_what_drift_to_expect(monkeypatch, capsys, work):
    from skyrl_megatron_kda.integrations.skyrl.tracking import step_line

    fully_async = ["trainer.fully_async.enabled=true", "trainer.fully_async.max_staleness_steps=1",
                   "trainer.fully_async.num_parallel_generation_workers=8", "generator.batched=false",
                   "trainer.algorithm.policy_loss_type=rollout_is"]
    status, out, err = _main_base(monkeypatch, capsys, [*_job(work), *fully_async])
    assert status == 0, out[-2000:] + err[-3000:]
    [note] = [line for line in out.splitlines() if line.startswith("logprob drift")]
    assert "(max_staleness_steps=1)" in note and "not an error" in note and "is_ratio" in note
    # Step 2 of examples/rl_tiny at staleness 1 (tests/test_rl_tiny_async.py): drift about 1.
    line = step_line(2, {"policy/rollout_train_logprobs_abs_diff_max": 0.997,
                         "policy/loss_metrics/is_ratio_mean": 1.0312, "async/staleness_max": 1})
    assert line == ("step 2 | logprob drift 9.97e-01 (rollouts up to 1 step stale: expected) | "
                    "is_ratio mean 1.031 | staleness max 1")
