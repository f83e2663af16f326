"""The SkyRL integration against the installed skyrl 0.4.0 (the ``skyrl`` extra; ``make test``
installs it). Nothing here skips: without skyrl the module import below fails the suite.

SkyRL's command line is parsed by SkyRL's own ``from_cli_overrides`` (strict keys), our section
by our pydantic ``Recipe``; the dispatch test runs SkyRL's real ``main_base`` in a subprocess
(it switches multiprocessing to spawn at import, which must not leak into this process), and the
other dry runs and refused command lines of ``main_base`` run together in one more
(``tests/support/main_base_runs``: each case as its own process would end).
"""

import importlib.metadata
import json
import os
import pickle
import subprocess
import sys
import tempfile

import pytest
from pydantic import ValidationError
from skyrl.train.config import SkyRLTrainConfig

from skyrl_megatron_kda.config import CP_EXCHANGE_ENV, Recipe
from skyrl_megatron_kda.integrations.skyrl import ENTRYPOINT, SKYRL_VERSION
from skyrl_megatron_kda.integrations.skyrl.config import KDASkyRLConfig, apply_recipe
from skyrl_megatron_kda.model.hf_io import hf_text_config
from skyrl_megatron_kda.recipes import get_recipe, load_recipe
from tests.support import main_base_runs
from tests.support.ranks import run_ranks

# The prompts every job below names: the dry run reads the data as the launch will
# (integrations/skyrl/gate.py, check_inputs), and SkyRL's default data.train_data is not here.
PROMPTS = os.path.join(tempfile.mkdtemp(prefix="test_skyrl_"), "prompts.jsonl")
with open(PROMPTS, "w") as f:
    f.write((json.dumps({"prompt": [{"role": "user", "content": "1 + 1 ="}], "env_class": "gsm8k"})
             + "\n") * 4)

# A job the integration accepts as far as SkyRL's own checks go (GRPO, no KL, not colocated).
JOB = [
    "trainer.strategy=megatron",
    f"data.train_data=['{PROMPTS}']",
    "data.val_data=[]",
    "trainer.train_batch_size=4",
    "trainer.policy_mini_batch_size=4",
    "trainer.logger=console",
    "trainer.placement.colocate_all=false",
    "trainer.algorithm.use_kl_loss=false",
    "trainer.placement.policy_num_gpus_per_node=4",
    "trainer.kda.recipe=glm53_flash_tiny",
]
ALLGATHER = JOB + ["trainer.kda.cp_exchange=allgather"]


@pytest.fixture(autouse=True)
def _no_exchange_env(monkeypatch):
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)


def test_installed_skyrl_is_the_tested_release():
    assert importlib.metadata.version("skyrl") == SKYRL_VERSION


def test_skyrl_config_selects_tiny_recipe_with_allgather():
    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER)
    assert isinstance(cfg, SkyRLTrainConfig)
    recipe = cfg.trainer.kda.resolve()
    assert isinstance(recipe, Recipe)
    assert recipe.kda.cp_exchange == "allgather"
    # The file says otherwise, so the value above came through SkyRL's command line.
    assert get_recipe("glm53_flash_tiny").kda.cp_exchange != "allgather"
    # load_recipe, as the integration: the recipe as it runs (model.dsa.kernel=auto decided).
    assert recipe == load_recipe("glm53_flash_tiny", ["kda.cp_exchange=allgather"]).recipe


def test_overrides_are_dot_paths_into_the_recipe():
    cfg = KDASkyRLConfig.from_cli_overrides(
        JOB + ["trainer.kda.overrides.train.recompute=full", "trainer.kda.overrides.kda.chunk_size=32",
               "trainer.kda.overrides.run.device=gpu"])
    recipe = cfg.trainer.kda.resolve()
    assert (recipe.train.recompute, recipe.kda.chunk_size, recipe.run.device) == ("full", 32, "gpu")


@pytest.mark.parametrize("key", ["train.lr", "train.steps", "train.seed", "model.params_dtype"])
def test_overrides_of_what_skyrl_decides_are_refused(key):
    """A recipe key SkyRL's own config decides cannot be set a second time under trainer.kda."""
    from skyrl_megatron_kda.integrations.skyrl.settings import SKYRL_DECIDES

    assert key in SKYRL_DECIDES
    cfg = KDASkyRLConfig.from_cli_overrides(JOB)
    cfg.trainer.kda.overrides = {key.split(".")[0]: {key.split(".")[1]: 1}}
    with pytest.raises(ValueError, match=f"trainer.kda.overrides.{key} is decided by SkyRL"):
        cfg.trainer.kda.resolve()


def test_command_line_wins_over_the_environment_variable(monkeypatch, caplog):
    """Command line > SKYRL_KDA_CP_EXCHANGE (logged) > recipe file; the dry run says which."""
    from skyrl_megatron_kda.integrations.skyrl.settings import cp_exchange_source

    monkeypatch.setenv(CP_EXCHANGE_ENV, "state")
    for given in (ALLGATHER, JOB + ["trainer.kda.overrides.kda.cp_exchange=allgather"]):
        cfg = KDASkyRLConfig.from_cli_overrides(given)
        with caplog.at_level("WARNING"):
            assert cfg.trainer.kda.resolve().kda.cp_exchange == "allgather"
        assert "command line (allgather; SKYRL_KDA_CP_EXCHANGE=state ignored)" in caplog.text
        caplog.clear()
    # Without a command-line value the environment beats the file, which says a2a.
    assert get_recipe("glm53_flash_tiny", environ={}).kda.cp_exchange == "a2a"
    cfg = KDASkyRLConfig.from_cli_overrides(JOB)
    assert cfg.trainer.kda.resolve().kda.cp_exchange == "state"
    assert cp_exchange_source(cfg.trainer.kda).text == f"{CP_EXCHANGE_ENV}=state"
    monkeypatch.delenv(CP_EXCHANGE_ENV)
    assert cfg.trainer.kda.resolve().kda.cp_exchange == "a2a"
    assert cp_exchange_source(cfg.trainer.kda).text == "the recipe file"


@pytest.mark.parametrize("bad, error, words", [
    (["trainer.kda.cp_exchang=allgather"], ValueError, "cp_exchang"),            # SkyRL's strict keys
    (["trainer.kda.cp_exchange=ring"], ValueError, "kda.cp_exchange: Input should be"),  # registry
    (["trainer.kda.overrides.parallel.tpp=2"], ValidationError, "parallel.tpp"),  # extra="forbid"
    (["trainer.kda.overrides.parallel.tp=3"], ValidationError, "divisible"),      # a Recipe rule
    (["trainer.kda.cp_exchange=a2a", "trainer.kda.overrides.kda.cp_exchange=state"], ValueError,
     "disagree"),
    (["trainer.kda.recipe=no_such_recipe"], KeyError, "glm53_flash_tiny"),
])
def test_bad_kda_settings_fail_while_parsing(bad, error, words):
    with pytest.raises(error, match=words):
        KDASkyRLConfig.from_cli_overrides(JOB + bad)


def test_missing_recipe_is_an_error_that_lists_them():
    cfg = KDASkyRLConfig.from_cli_overrides(JOB[:-1])
    with pytest.raises(ValueError, match="trainer.kda.recipe is required.*glm53_flash_1m"):
        cfg.trainer.kda.resolve()


def test_recipe_mesh_is_mirrored_into_skyrl_megatron_config():
    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER)
    recipe = cfg.trainer.kda.resolve()
    problems = apply_recipe(cfg, recipe)
    m = cfg.trainer.policy.megatron_config
    p = recipe.parallel
    assert (m.tensor_model_parallel_size, m.context_parallel_size, m.expert_model_parallel_size,
            m.expert_tensor_parallel_size) == (p.tp, p.cp, p.ep, p.etp)
    assert any("run.device=cpu" in line for line in problems)  # the tiny recipe is a CPU recipe


def test_skyrl_sizes_that_contradict_the_recipe_are_refused():
    cfg = KDASkyRLConfig.from_cli_overrides(
        ALLGATHER + ["trainer.policy.megatron_config.context_parallel_size=4"])
    with pytest.raises(ValueError, match="context_parallel_size=4 disagrees"):
        apply_recipe(cfg, cfg.trainer.kda.resolve())
    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER + ["trainer.placement.policy_num_gpus_per_node=8"])
    with pytest.raises(ValueError, match="8 policy workers.*num_workers=4"):
        apply_recipe(cfg, cfg.trainer.kda.resolve())


def test_config_survives_pickling_for_ray():
    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER)
    again = pickle.loads(pickle.dumps(cfg))
    assert type(again) is KDASkyRLConfig
    assert again.trainer.kda.resolve() == cfg.trainer.kda.resolve()


def _mesh_ranks_agree(rank, world, recipe_jsons):
    from megatron.core import parallel_state

    from skyrl_megatron_kda.integrations.skyrl.mesh import megatron_mesh_rank, mesh_rank

    pairs = []
    for recipe_json in recipe_jsons:
        recipe = Recipe.model_validate_json(recipe_json)
        p = recipe.parallel  # megatron's default rank order, as RankTrainer builds it
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
            context_parallel_size=p.cp, expert_model_parallel_size=p.ep,
            expert_tensor_parallel_size=p.etp)
        try:
            pairs.append((mesh_rank(recipe, rank), megatron_mesh_rank(recipe)))
        finally:
            parallel_state.destroy_model_parallel()
    return pairs


def test_mesh_rank_matches_megatrons_groups():
    """The rank SkyRL is told before the model exists equals what megatron builds, for TP2 x CP2
    and TP2 x DP2 (one spawn of 4 gloo ranks)."""
    recipes = [get_recipe("glm53_flash_tiny"), get_recipe("glm53_flash_tiny", ["parallel.cp=1"])]
    per_rank = run_ranks(4, _mesh_ranks_agree, [r.model_dump_json() for r in recipes])
    for i, recipe in enumerate(recipes):
        pairs = [per_rank[rank][i] for rank in range(4)]
        for rank, (ours, megatrons) in enumerate(pairs):
            assert ours == megatrons, f"recipe {i}, rank {rank}"
        # Megatron's tp-cp-ep-dp-pp order: TP is the fastest axis, then CP, then DP.
        tp, cp, dp = recipe.parallel.tp, recipe.parallel.cp, recipe.data_parallel_size
        assert [(m.tp, m.sp, m.dp) for m, _ in pairs] == [
            (r % tp, r // tp % cp, r // (tp * cp)) for r in range(4)]
        assert {m.dp_size for m, _ in pairs} == {dp}


def _hf_folder(path, **changed):
    """A folder whose config.json describes the tiny recipe's model, with ``changed`` fields."""
    text = hf_text_config(get_recipe("glm53_flash_tiny"))
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**text, **changed}))
    return path


def _run(code_or_module: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_module], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


DISPATCH = [f"trainer.override_entrypoint={ENTRYPOINT}"]
MAIN_BASE = ["-m", "skyrl.train.entrypoints.main_base", *DISPATCH]
"""SkyRL's own launcher, dispatching to our entrypoint."""


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict:
    """A model folder that matches the tiny recipe, and one that disagrees on two fields."""
    tmp = tmp_path_factory.mktemp("hf")
    return {"match": _hf_folder(tmp / "hf"),
            "mismatch": _hf_folder(tmp / "hf_mismatch", hidden_size=96, index_topk=32)}


@pytest.fixture(scope="module")
def dry_runs(hf_folders) -> dict[str, subprocess.CompletedProcess]:
    """Each ``main_base`` command line of the tests below that ends before Ray (a dry run, or a
    refused command line), by name, all run in one process."""
    hf = f"trainer.policy.model.path={hf_folders['match']}"
    cases = {
        "cpu_vllm": ([*ALLGATHER, "trainer.kda.dry_run=true", hf], {}),
        "env_module": ([*ALLGATHER, "trainer.kda.sampler=glm5_next",
                        "trainer.kda.env_modules=[no_such_pkg.envs]", "trainer.kda.dry_run=true",
                        hf], {}),
        "gpu_glm5_next": ([*ALLGATHER, "trainer.kda.overrides.run.device=gpu",
                           "trainer.kda.sampler=glm5_next", "trainer.kda.dry_run=true", hf], {}),
        "gate_ready": (_gate(hf_folders["match"]), {}),
        "gate_hub_id": (_gate("zai-org/GLM-5.3-Flash"), {}),
        "gate_mismatch": (_gate(hf_folders["mismatch"]), {}),
        "gate_colocate_all": (_gate(hf_folders["match"], "trainer.placement.colocate_all=true"), {}),
        "fully_async": ([*FULLY_ASYNC, "generator.batched=true",
                         "trainer.algorithm.policy_loss_type=regular", "trainer.kda.dry_run=true"],
                        {}),
    }
    for case in BAD_COMMAND_LINES:
        extra, env, _ = case.values
        replaced = {a.split("=")[0] for a in extra}
        job = [a for a in JOB if a.split("=")[0] not in replaced]
        cases[f"bad_{case.id}"] = ([*job, *extra, "trainer.kda.dry_run=true"], env)
    cases = {name: ([*DISPATCH, *args], env) for name, (args, env) in cases.items()}
    return main_base_runs.run(cases, drop_env=(CP_EXCHANGE_ENV,))


def test_skyrl_main_dispatches_to_our_entrypoint():
    """SkyRL's own main_base, given trainer.override_entrypoint, runs our main (dry run)."""
    done = _run([*MAIN_BASE, *ALLGATHER, "trainer.kda.dry_run=true"])
    assert done.returncode == 1, done.stderr[-3000:]  # blocked (the recipe's run.device=cpu)
    lines = done.stdout.splitlines()
    assert f"entrypoint: {ENTRYPOINT}" in lines
    dumped = next(line for line in lines if line.startswith("recipe json: "))
    recipe = Recipe.model_validate(json.loads(dumped.removeprefix("recipe json: ")))
    # load_recipe, as the integration: the recipe as it runs (model.dsa.kernel=auto decided).
    assert recipe == load_recipe("glm53_flash_tiny", ["kda.cp_exchange=allgather"]).recipe
    assert "launch blocked by:" in lines
    # What came from where: SkyRL's settings, each naming its source and the recipe's value.
    assert "  kda.cp_exchange=allgather <- command line (allgather)" in lines
    assert "  train.lr=1e-06 <- trainer.policy.optimizer_config.lr (recipe: 0.003)" in lines
    assert "  model.params_dtype=bfloat16 <- trainer.bf16 (recipe: float32)" in lines
    assert "  train.seed=42 <- trainer.seed (recipe: 1234)" in lines


_LAUNCH = """
import sys
from skyrl.train.trainer import RayPPOTrainer
from skyrl_megatron_kda.integrations.skyrl import entrypoint
from skyrl_megatron_kda.integrations.skyrl.trainers import KDAPPOTrainer
from skyrl_megatron_kda.integrations.skyrl.reference import KDARefWorker
from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorker

seen = []
RayPPOTrainer.build_models = lambda self, *workers: seen.extend(workers)
trainer = object.__new__(KDAPPOTrainer)
trainer.cfg = entrypoint.parse(sys.argv[1:])
KDAPPOTrainer.build_models(trainer, "skyrl's", None, None)
assert seen == [KDAPolicyWorker, None, KDARefWorker], seen
print("build_models injects KDAPolicyWorker and KDARefWorker")
entrypoint.initialize_ray = lambda cfg: sys.exit("the launch reached initialize_ray")
entrypoint.main(sys.argv[1:])
"""


def test_a_launch_is_no_longer_refused(tmp_path):
    """Without dry_run, main checks the job and goes on to start Ray (the test stops it there):
    the trainer SkyRL's experiment builds hands SkyRL our worker classes."""
    done = _run(["-c", _LAUNCH, *ALLGATHER, "trainer.kda.overrides.run.device=gpu",
                 f"trainer.policy.model.path={_hf_folder(tmp_path / 'hf')}"])
    assert "build_models injects KDAPolicyWorker and KDARefWorker" in done.stdout, done.stderr[-3000:]
    assert "policy: 4 ranks built: TP2 x CP2" in done.stdout  # said once on the console
    assert "the launch reached initialize_ray" in done.stderr, done.stderr[-3000:]
    assert "cannot run yet" not in done.stderr


_CPU_LAUNCH = """
import sys
from skyrl_megatron_kda.integrations.skyrl import entrypoint
entrypoint.start_local_ray = lambda cfg: sys.exit("the launch reached start_local_ray")
entrypoint.initialize_ray = lambda cfg: sys.exit("the launch reached initialize_ray")
entrypoint.main(sys.argv[1:])
"""


def test_a_cpu_job_with_the_projects_sampler_gets_a_local_ray(tmp_path):
    """The tiny recipe's CPU ranks with trainer.kda.sampler=glm5_next: nothing blocks, and the
    launch starts the local Ray whose logical GPUs stand for the ranks (not SkyRL's
    initialize_ray, which would wait for GPUs a CPU machine does not have)."""
    done = _run(["-c", _CPU_LAUNCH, *ALLGATHER, "trainer.kda.sampler=glm5_next",
                 f"trainer.log_path={tmp_path / 'logs'}",
                 f"trainer.policy.model.path={_hf_folder(tmp_path / 'hf')}"])
    assert "the launch reached start_local_ray" in done.stderr, done.stderr[-3000:]
    assert "cannot run yet" not in done.stderr
    assert f"per-step metrics: {tmp_path / 'logs' / 'metrics.jsonl'}" in done.stdout.splitlines()


def test_dry_run_lists_only_what_remains(dry_runs):
    """The dry run's blockers are exactly this job's settings that cannot run (here the tiny
    recipe's CPU device under SkyRL's default vLLM sampler), one line each."""
    done = dry_runs["cpu_vllm"]
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = _blockers(done)
    assert line.startswith("run.device=cpu: vLLM (trainer.kda.sampler=vllm) serves rollouts")
    assert "set trainer.kda.sampler=glm5_next" in line


def test_dry_run_blocks_an_env_module_it_cannot_import(dry_runs):
    done = dry_runs["env_module"]
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = _blockers(done)
    assert line.startswith("trainer.kda.env_modules: no module 'no_such_pkg.envs' to import"), line


def test_dry_run_is_ready_for_the_projects_sampler_on_a_gpu_recipe(dry_runs):
    """trainer.kda.sampler=glm5_next serves a GPU recipe too, on cuda. The dry run asks for no
    CUDA (it may run on a login node without GPUs): the client refuses cuda where its process
    sees none (tests/test_sampler_device.py)."""
    done = dry_runs["gpu_glm5_next"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "launch: ready"
    assert any(line.endswith("rollouts from trainer.kda.sampler=glm5_next on cuda")
               for line in lines), lines


def test_the_experiment_builds_the_sampler_on_the_recipes_device(tmp_path):
    """The one place the client is built (``KDAPPOExp.get_inference_client``) gives it the
    recipe's device: cpu for run.device=cpu, cuda for run.device=gpu (refused at once by the
    client where this process has no CUDA)."""
    import torch

    from skyrl_megatron_kda.integrations.skyrl.entrypoint import KDAPPOExp, parse

    def client(device: str):
        exp = object.__new__(KDAPPOExp)  # no tokenizer, datasets or engines: the hook alone
        exp.cfg = parse([*ALLGATHER, f"trainer.kda.overrides.run.device={device}",
                         "trainer.kda.sampler=glm5_next", f"trainer.export_path={tmp_path}"])
        exp.recipe, exp.tokenizer = exp.cfg.trainer.kda.resolve(), None
        return exp.get_inference_client()

    assert client("cpu").device == torch.device("cpu")
    if torch.cuda.is_available():
        assert client("gpu").device.type == "cuda"
    else:
        with pytest.raises(RuntimeError, match="device='cuda' but this process sees no CUDA GPU"):
            client("gpu")


# --- the dry run as a gate: exit 0 only when nothing blocks the launch ------------------------

def _gate(model_path, *extra: str) -> list[str]:
    """SkyRL's launcher's settings (after the dispatch) of a dry run of a job that only
    ``model_path`` and ``extra`` may block."""
    return [*ALLGATHER, "trainer.kda.overrides.run.device=gpu",
            "trainer.kda.dry_run=true", f"trainer.policy.model.path={model_path}", *extra]


def _blockers(done: subprocess.CompletedProcess) -> list[str]:
    """The dry run's ``launch blocked by:`` lines, after the provenance table."""
    lines = done.stdout.splitlines()
    assert "what comes from where:" in lines, done.stderr[-3000:]
    at = lines.index("launch blocked by:")
    assert at > lines.index("what comes from where:")
    return [line.removeprefix("  - ") for line in lines[at + 1:]]


def test_dry_run_ready_with_a_matching_model_folder_exits_0(dry_runs):
    done = dry_runs["gate_ready"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "launch: ready"


def test_dry_run_blocks_a_hub_id(dry_runs):
    """A hub id is not a folder here; the workers download nothing, so the launch is blocked on
    the head node (not in the workers, after Ray and the placement group are up)."""
    done = dry_runs["gate_hub_id"]
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = _blockers(done)
    assert line.startswith("trainer.policy.model.path='zai-org/GLM-5.3-Flash' is not a folder on ")
    assert line.endswith("at this path on every node (they download nothing)")


def test_dry_run_names_each_field_a_model_folder_disagrees_on(dry_runs, hf_folders):
    folder = hf_folders["mismatch"]
    done = dry_runs["gate_mismatch"]
    assert done.returncode == 1, done.stderr[-3000:]
    assert _blockers(done) == [
        f"trainer.policy.model.path: {folder}/config.json does not match the recipe: "
        "hidden_size: checkpoint 96, recipe 64; index_topk: checkpoint 32, recipe 64"]


def test_dry_run_lists_skyrls_own_validation_error(dry_runs):
    """SkyRL's validate_cfg asserts; the dry run prints its table, then the assertion as one
    line (colocate_all with SkyRL's default of one inference engine for 4 policy GPUs)."""
    done = dry_runs["gate_colocate_all"]
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert _blockers(done) == [
        "SkyRL's validate_cfg: num_policy_gpus (4) and num_rollout_gpus (1) must be the same when "
        "colocating all models"]


BAD_COMMAND_LINES = [pytest.param(*case, id=name) for name, case in {
    "recipe-name": (["trainer.kda.recipe=no_such_recipe"], {},
                    "error: 'no_such_recipe' is neither a registered recipe (glm53_flash_1m, "
                    "glm53_flash_slice, glm53_flash_tiny) nor a .yaml/.yml file"),
    "env-variable": ([], {CP_EXCHANGE_ENV: "bogus"},
                     f"error: {CP_EXCHANGE_ENV}='bogus' is not a KDA CP exchange; allowed values: "
                     "a2a, allgather, state, auto"),
    "pydantic": (["trainer.kda.overrides.parallel.tp=abc"], {},
                 "error: recipe glm53_flash_tiny (glm53_flash_tiny.yaml): parallel.tp: Input "
                 "should be a valid integer, got 'abc'"),
    "no-value": (["trainer.epochs"], {},
                 "error: argument 'trainer.epochs' has no =VALUE: SkyRL settings are KEY=VALUE "
                 "with a dotted KEY, e.g. trainer.epochs=1"),
    "no-key": (["=3"], {}, "error: argument '=3' has no KEY before =: SkyRL settings are "
               "KEY=VALUE with a dotted KEY, e.g. trainer.epochs=1"),
}.items()]
"""(extra settings, environment, the one error line), each replacing JOB's setting of its key."""


@pytest.mark.parametrize("extra, env, error", BAD_COMMAND_LINES)
def test_main_base_refuses_a_bad_command_line_in_one_line(extra, env, error, dry_runs, request):
    """Under SkyRL's main_base, what the command line gets wrong is one ``error:`` line on stderr
    and exit 2, as with skyrl-kda, not a traceback."""
    done = dry_runs[f"bad_{request.node.callspec.id}"]
    assert done.args[-len(extra) - 1:] == [*extra, "trainer.kda.dry_run=true"]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [error]
    assert done.stderr.splitlines()[-1] == error


def test_worker_refuses_settings_it_does_not_implement():
    """Token-based micro-batches, sample-support replay and the fused LM-head log-prob are refused
    by the config check (so the entrypoint lists them) and by the worker, with the setting named."""
    from skyrl_megatron_kda.integrations.skyrl.config import unsupported_settings

    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER + ["trainer.max_tokens_per_microbatch=4096",
                                                         "trainer.fused_lm_head_logprob=true"])
    # Set after parsing: SkyRL's own checks want the rollout side's sampling set up for it.
    cfg.trainer.algorithm.enable_sample_support_replay = True
    problems = unsupported_settings(cfg)
    assert any("max_tokens_per_microbatch" in p for p in problems)
    assert any("enable_sample_support_replay" in p for p in problems)
    assert any("fused_lm_head_logprob" in p for p in problems)
    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorkerBase

    worker = object.__new__(KDAPolicyWorkerBase)  # the checks run before the model is touched
    worker.cfg = cfg.trainer
    for call in (worker.forward, worker.forward_backward):
        with pytest.raises(ValueError, match="max_tokens_per_microbatch.*enable_sample|"
                                             "enable_sample.*max_tokens_per_microbatch"):
            call(None)


def test_missing_skyrl_names_the_extra():
    done = _run(["-c", "import sys; sys.modules['skyrl'] = None; "
                       "import skyrl_megatron_kda.integrations.skyrl"])
    assert done.returncode != 0
    assert "ImportError" in done.stderr and "skyrl_megatron_kda[skyrl]" in done.stderr


# One bad value per refused SkyRL setting (set after parsing: some of SkyRL's own checks of these
# need other parts of a job, the rollout side's, which these tests do not configure).
REFUSED_VALUES = {
    "trainer.policy.megatron_config.lora_config.lora_type": "canonical_lora",
    "trainer.policy.megatron_config.lora_config.experts_shared_outer_loras": True,
    "trainer.policy.model.lora.sync_mode": "memory",
    "trainer.policy.model.lora.max_loras": 2,
    "trainer.policy.model.lora.max_cpu_loras": 4,
    "trainer.policy.model.lora.init_method": "normal",
    "trainer.policy.megatron_config.moe_enable_routing_replay": True,
    "trainer.mtp.enabled": True,
    "trainer.policy.megatron_config.mtp_num_layers": 1,
    "trainer.policy.optimizer_config.scheduler": "cosine",
    "trainer.policy.optimizer_config.adam_betas": [0.9, 0.95],
    "trainer.policy.model.fake_int4_qat.enabled": True,
    "trainer.policy.inference_only_init": True,
    "trainer.policy.sequence_parallel_size": 2,
    "trainer.ref.sequence_parallel_size": 2,
    "trainer.policy.megatron_config.freeze_moe_router": True,
    "trainer.policy.megatron_config.fp8": "e4m3",
    "trainer.policy.megatron_config.fp8_param": True,
    "trainer.policy.megatron_config.ddp_config.overlap_grad_reduce": True,
    "trainer.policy.megatron_config.ddp_config.overlap_param_gather": True,
    "trainer.policy.megatron_config.optimizer_config_kwargs": {"optimizer_cpu_offload": True},
    "trainer.policy.megatron_config.transformer_config_kwargs": {"recompute_granularity": None},
}


# Refused only under LoRA: set with LoRA on (and, for that case, the default job accepts it).
LORA_ON = {"trainer.policy.model.lora.rank": 8}
NEEDS_LORA = {"trainer.policy.model.lora.sync_mode"}


def _set(cfg, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, leaf, value)


def test_every_refused_setting_has_a_case():
    from skyrl_megatron_kda.integrations.skyrl.settings import REFUSALS

    assert set(REFUSED_VALUES) == {r.setting for r in REFUSALS}


@pytest.mark.parametrize("setting", sorted(REFUSED_VALUES))
def test_refused_skyrl_setting_is_named(setting):
    """Each SkyRL setting the workers do not implement is an error naming it (the entrypoint's
    list and the worker's check), and the default job refuses none of them."""
    from skyrl_megatron_kda.integrations.skyrl.config import unsupported_settings
    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorkerBase

    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER)
    assert unsupported_settings(cfg) == []
    _set(cfg, setting, REFUSED_VALUES[setting])
    if setting in NEEDS_LORA:
        assert unsupported_settings(cfg) == []  # without LoRA the setting does nothing
        for key, value in LORA_ON.items():
            _set(cfg, key, value)
    problems = unsupported_settings(cfg)
    assert len(problems) >= 1 and problems[0].startswith(f"{setting}="), problems
    worker = object.__new__(KDAPolicyWorkerBase)
    worker.cfg = cfg.trainer
    with pytest.raises(ValueError, match=f"KDAPolicyWorker: {setting}="):
        worker.forward(None)


def test_colocation_and_kl_are_accepted_and_build_a_reference():
    """SkyRL's defaults (colocate_all, use_kl_loss) are no longer refused; the recipe's mesh is
    mirrored into the reference's megatron_config too, whose placement must match."""
    from skyrl_megatron_kda.integrations.skyrl.config import uses_reference

    from skyrl.train.utils import validate_cfg

    from skyrl_megatron_kda.integrations.skyrl.config import unsupported_settings

    job = [a for a in ALLGATHER if "colocate_all" not in a and "use_kl_loss" not in a]
    cfg = KDASkyRLConfig.from_cli_overrides(job + ["trainer.placement.ref_num_gpus_per_node=4",
                                                   "generator.inference_engine.num_engines=4"])
    assert cfg.trainer.placement.colocate_all and cfg.trainer.algorithm.use_kl_loss
    assert uses_reference(cfg.trainer)
    problems = apply_recipe(cfg, cfg.trainer.kda.resolve())
    assert [p.split(":")[0] for p in problems] == ["run.device=cpu"]
    assert cfg.trainer.ref.megatron_config.context_parallel_size == 2
    # SkyRL's own validation (as the entrypoint runs it) leaves nothing the workers refuse.
    validate_cfg(cfg)
    assert unsupported_settings(cfg) == []
    cfg = KDASkyRLConfig.from_cli_overrides(job)  # ref_num_gpus_per_node stays 1
    with pytest.raises(ValueError, match="1 ref workers.*ref_num_gpus_per_node=1.*num_workers=4"):
        apply_recipe(cfg, cfg.trainer.kda.resolve())


def test_skyrl_config_decides_the_training_settings(tmp_path):
    """lr, schedule (constant after the warm-up), warm-up, weight decay, grad clip,
    num_training_steps, seed, dtype and the weights' folder come from SkyRL's config."""
    from skyrl_megatron_kda.integrations.skyrl.settings import (
        SKYRL_DECIDES,
        apply_decided,
        check_weights_folder,
        decided_settings,
    )

    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER + [
        "trainer.policy.optimizer_config.lr=2e-5", "trainer.policy.optimizer_config.num_warmup_steps=3",
        "trainer.policy.optimizer_config.weight_decay=0.05",
        "trainer.policy.optimizer_config.max_grad_norm=0.5", "trainer.seed=7", "trainer.bf16=false",
        f"trainer.policy.model.path={tmp_path}"])
    t, recipe = cfg.trainer, cfg.trainer.kda.resolve()
    decided = decided_settings(t, recipe, model_path=t.policy.model.path, num_training_steps=40)
    assert {d.key for d in decided} - {"run.init_from_hf"} <= set(SKYRL_DECIDES)
    check_weights_folder(decided)
    r = apply_decided(recipe, decided)
    assert (r.train.lr, r.train.min_lr, r.train.warmup_steps, r.train.weight_decay,
            r.train.grad_clip, r.train.steps, r.train.seed, r.model.params_dtype,
            r.run.init_from_hf) == (2e-5, 2e-5, 3, 0.05, 0.5, 40, 7, "float32", str(tmp_path))
    # The recipe (file or trainer.kda.overrides) naming its weights wins over SkyRL's path.
    recipe = load_recipe("glm53_flash_tiny", [f"run.init_from_hf={tmp_path / 'x'}"]).recipe
    (weights,) = [d for d in decided_settings(t, recipe, model_path="elsewhere")
                  if d.key == "run.init_from_hf"]
    assert weights.value == str(tmp_path / "x") and "the recipe" in weights.source
    # A model path that is not a folder (a hub id) is refused, naming the SkyRL setting.
    with pytest.raises(FileNotFoundError, match="trainer.policy.model.path='Qwen/x' is not a folder"):
        check_weights_folder(decided_settings(t, load_recipe("glm53_flash_tiny").recipe, model_path="Qwen/x"))
    # max_grad_norm=0: no clipping, as in megatron.
    t.policy.optimizer_config.max_grad_norm = 0.0
    assert apply_decided(recipe, decided_settings(t, recipe)).train.grad_clip is None


def test_skyrls_megatron_worker_import_gets_the_kda_workers():
    """trainer.strategy=megatron makes SkyRL's _setup_trainer import its own Megatron workers,
    which need megatron.bridge (not installed: the import fails without the stand-in); inside
    the entrypoint's context the same import statement gives the KDA workers, and the module
    table is restored after."""
    import importlib.util

    from skyrl_megatron_kda.integrations.skyrl.entrypoint import (
        SKYRL_MEGATRON_WORKERS,
        kda_workers_for_skyrl_import,
    )
    from skyrl_megatron_kda.integrations.skyrl.reference import KDARefWorker
    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorker

    assert importlib.util.find_spec("megatron.bridge") is None
    with kda_workers_for_skyrl_import():
        from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import (
            CriticWorker,
            PolicyWorker,
            RefWorker,
        )
    assert (PolicyWorker, CriticWorker, RefWorker) == (KDAPolicyWorker, None, KDARefWorker)
    assert SKYRL_MEGATRON_WORKERS not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="megatron.bridge|megatron_bridge"):
        importlib.import_module(SKYRL_MEGATRON_WORKERS)


def test_skyrl_extra_declares_what_a_launch_imports():
    """The skyrl extra lists the standalone cloudpickle (SkyRL's registry sync) and no
    Megatron-Bridge (the test above shows it is not needed)."""
    import tomllib
    from pathlib import Path

    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["skyrl"]
    names = {req.split("=")[0].split("<")[0].split(">")[0].strip() for req in extra}
    assert "cloudpickle" in names
    assert not any("bridge" in n for n in names)


def test_reference_weights_follow_skyrls_paths(tmp_path):
    """The reference's init_model path: the policy's path (SkyRL's default ref path) means the
    policy's initial weights (the recipe's run.init_from_hf wins, as for the policy); another
    path (an explicit reference, the policy's export) is loaded as given; never a resume."""
    from skyrl_megatron_kda.integrations.skyrl.settings import reference_settings

    cfg = KDASkyRLConfig.from_cli_overrides(ALLGATHER + [f"trainer.policy.model.path={tmp_path}"])
    t = cfg.trainer
    assert t.ref.model.path == str(tmp_path)  # SkyRL's default

    def weights(recipe, path):
        recipe, decided = reference_settings(t, recipe, path)
        assert recipe.run.resume is False
        return {(d.value, d.source) for d in decided if d.key == "run.init_from_hf"}

    plain = load_recipe("glm53_flash_tiny").recipe
    named = load_recipe("glm53_flash_tiny", ["run.init_from_hf=/recipe/hf", "run.resume=true"]).recipe
    assert weights(plain, str(tmp_path)) == {(str(tmp_path), "trainer.policy.model.path")}
    assert {v for v, _ in weights(named, str(tmp_path))} == {"/recipe/hf"}
    assert weights(named, "/export/global_step_3/policy") == {
        ("/export/global_step_3/policy", "trainer.ref.model.path")}
    assert weights(plain, None) == set()  # the recipe's weights (none: a seeded random init)


def test_a_resume_may_change_only_the_step_count_of_skyrls_constant_schedule():
    """SkyRL resumes that train further (a larger ``trainer.max_training_steps``) load with this
    run's schedule when only ``train.steps`` differs and the schedule is SkyRL's constant one;
    everything else is left to the checkpoint load's refusal."""
    from skyrl_megatron_kda.integrations.skyrl.settings import (
        steps_only_extend_a_constant_schedule as extends,
    )

    def with_train(**train):
        recipe = load_recipe("glm53_flash_tiny").recipe
        return recipe.model_copy(update={"train": recipe.train.model_copy(update=train)})

    constant = with_train(lr=3e-3, min_lr=3e-3, steps=4)
    saved = {**constant.train.schedule(), "train.steps": 2}
    assert extends(saved, constant)
    assert not extends(constant.train.schedule(), constant)  # nothing differs: a plain load
    assert not extends({**saved, "train.lr": 1e-3}, constant)  # another LR too
    decaying = with_train(lr=3e-3, min_lr=0.0, steps=4)  # steps shape a decaying schedule
    assert not extends({**decaying.train.schedule(), "train.steps": 2}, decaying)


# A fully async job SkyRL's FullyAsyncRayPPOTrainer accepts: one mini-batch per step, as many
# generation workers as the staleness bound allows, unbatched generation, a loss against the
# rollout's log-probs, no colocation (JOB's).
FULLY_ASYNC = JOB + [
    "trainer.fully_async.enabled=true", "trainer.fully_async.max_staleness_steps=1",
    "trainer.fully_async.num_parallel_generation_workers=8", "trainer.train_batch_size=4",
    "trainer.policy_mini_batch_size=4", "generator.batched=false",
    "trainer.algorithm.policy_loss_type=rollout_is"]


def test_fully_async_settings_choose_skyrls_fully_async_trainer_with_the_kda_workers(monkeypatch):
    from skyrl.train.fully_async_trainer import FullyAsyncRayPPOTrainer
    from skyrl.train.fully_async_trainer_sim import FullyAsyncTrainerSim
    from skyrl.train.trainer import RayPPOTrainer

    from skyrl_megatron_kda.integrations.skyrl.reference import KDARefWorker
    from skyrl_megatron_kda.integrations.skyrl.trainers import (
        KDAFullyAsyncTrainer, KDAPPOTrainer, trainer_class)
    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorker

    assert trainer_class(KDASkyRLConfig.from_cli_overrides(JOB)) is KDAPPOTrainer
    assert trainer_class(KDASkyRLConfig.from_cli_overrides(FULLY_ASYNC)) is KDAFullyAsyncTrainer
    assert issubclass(KDAFullyAsyncTrainer, FullyAsyncRayPPOTrainer)
    # simulate_training: SkyRL builds no models, so its simulated trainer runs as it is
    simulated = KDASkyRLConfig.from_cli_overrides(
        FULLY_ASYNC + ["trainer.fully_async.simulate_training=true"])
    assert trainer_class(simulated) is FullyAsyncTrainerSim
    seen = []
    monkeypatch.setattr(RayPPOTrainer, "build_models", lambda self, *workers: seen.append(workers))
    trainer = object.__new__(KDAFullyAsyncTrainer)
    trainer.cfg = KDASkyRLConfig.from_cli_overrides(FULLY_ASYNC)
    KDAFullyAsyncTrainer.build_models(trainer, "skyrl's", None, None)
    assert seen == [(KDAPolicyWorker, None, KDARefWorker)]


@pytest.mark.parametrize("setting, reason", [
    ("trainer.train_batch_size=8", "trainer.train_batch_size=8 must equal"),
    ("trainer.fully_async.num_parallel_generation_workers=9",
     "trainer.fully_async.num_parallel_generation_workers=9 must lie in [4, 8]"),
    ("trainer.fully_async.num_parallel_generation_workers=3",
     "trainer.fully_async.num_parallel_generation_workers=3 must lie in [4, 8]"),
    ("generator.batched=true", "generator.batched=true: set it to false"),
    ("trainer.placement.colocate_all=true", "trainer.placement.colocate_all=true: set it to false"),
    ("trainer.algorithm.policy_loss_type=regular",
     "trainer.algorithm.policy_loss_type=regular needs the old policy's log-probs"),
    ("trainer.algorithm.policy_loss_type=cispo",
     "trainer.algorithm.policy_loss_type=cispo needs the old policy's log-probs"),
    ("trainer.fully_async.sample_full_batch=true",
     "trainer.fully_async.sample_full_batch=true needs trainer.algorithm.zero_variance_filter"),
])
def test_each_fully_async_requirement_the_job_breaks_is_named(setting, reason):
    from skyrl_megatron_kda.integrations.skyrl.fully_async import fully_async_problems

    assert fully_async_problems(KDASkyRLConfig.from_cli_overrides(FULLY_ASYNC)) == []
    cfg = KDASkyRLConfig.from_cli_overrides(FULLY_ASYNC + [setting])
    assert [p[:len(reason)] for p in fully_async_problems(cfg)] == [reason]


def test_fully_async_job_without_its_requirements_gets_them_listed_in_the_dry_run(dry_runs):
    """SkyRL's main_base, dispatched to our entrypoint: the dry run names the trainer and, among
    the blockers, each fully async requirement the job breaks."""
    done = dry_runs["fully_async"]
    assert done.returncode == 1, done.stderr[-3000:]  # blocked: the dry run is a gate
    lines = done.stdout.splitlines()
    assert ("trainer: KDAFullyAsyncTrainer (fully async: max_staleness_steps=1, "
            "num_parallel_generation_workers=8)") in lines
    blockers = [b.split(":")[0] for b in lines[lines.index("launch blocked by:") + 1:]]
    assert blockers[:3] == ["  - run.device=cpu", "  - generator.batched=true",
                            "  - trainer.algorithm.policy_loss_type=regular needs the old policy's log-probs"]
    # then the model folder: SkyRL's default trainer.policy.model.path is a hub id
    assert len(blockers) == 4 and blockers[3].startswith("  - trainer.policy.model.path="), blockers
