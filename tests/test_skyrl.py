"""The SkyRL integration against the installed skyrl 0.4.0 (the ``skyrl`` extra; ``make test``
installs it). Nothing here skips: without skyrl the module import below fails the suite.

SkyRL's command line is parsed by SkyRL's own ``from_cli_overrides`` (strict keys), our section
by our pydantic ``Recipe``; the dispatch test runs SkyRL's real ``main_base`` in a subprocess
(it switches multiprocessing to spawn at import, which must not leak into this process).
"""

import importlib.metadata
import json
import pickle
import subprocess
import sys

import pytest
from pydantic import ValidationError
from skyrl.train.config import SkyRLTrainConfig

from skyrl_megatron_kda.config import CP_EXCHANGE_ENV, Recipe
from skyrl_megatron_kda.integrations.skyrl import ENTRYPOINT, SKYRL_VERSION
from skyrl_megatron_kda.integrations.skyrl.config import KDASkyRLConfig, apply_recipe
from skyrl_megatron_kda.recipes import get_recipe, load_recipe
from tests.support.ranks import run_ranks

# A job the integration accepts as far as SkyRL's own checks go (GRPO, no KL, not colocated).
JOB = [
    "trainer.strategy=megatron",
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
    assert recipe == load_recipe("glm53_flash_tiny", ["kda.cp_exchange=allgather"])


def test_overrides_are_dot_paths_into_the_recipe():
    cfg = KDASkyRLConfig.from_cli_overrides(
        JOB + ["trainer.kda.overrides.train.steps=3", "trainer.kda.overrides.kda.chunk_size=32",
               "trainer.kda.overrides.run.device=gpu"])
    recipe = cfg.trainer.kda.resolve()
    assert (recipe.train.steps, recipe.kda.chunk_size, recipe.run.device) == (3, 32, "gpu")


def test_environment_variable_wins_over_the_command_line(monkeypatch):
    monkeypatch.setenv(CP_EXCHANGE_ENV, "state")
    assert KDASkyRLConfig.from_cli_overrides(ALLGATHER).trainer.kda.resolve().kda.cp_exchange == "state"


@pytest.mark.parametrize("bad, error, words", [
    (["trainer.kda.cp_exchang=allgather"], ValueError, "cp_exchang"),            # SkyRL's strict keys
    (["trainer.kda.cp_exchange=ring"], ValidationError, "kda.cp_exchange"),      # our Literal
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


def _run(code_or_module: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_module], capture_output=True, text=True,
                          timeout=600)


def test_skyrl_main_dispatches_to_our_entrypoint():
    """SkyRL's own main_base, given trainer.override_entrypoint, runs our main (dry run)."""
    done = _run(["-m", "skyrl.train.entrypoints.main_base", f"trainer.override_entrypoint={ENTRYPOINT}",
                 *ALLGATHER, "trainer.kda.dry_run=true"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert f"entrypoint: {ENTRYPOINT}" in lines
    dumped = next(line for line in lines if line.startswith("recipe json: "))
    recipe = Recipe.model_validate(json.loads(dumped.removeprefix("recipe json: ")))
    # load_recipe, as the integration: the recipe as it runs (model.dsa.kernel=auto decided).
    assert recipe == load_recipe("glm53_flash_tiny", ["kda.cp_exchange=allgather"])
    assert "launch blocked by:" in lines


_LAUNCH = """
import sys
from skyrl.train.trainer import RayPPOTrainer
from skyrl_megatron_kda.integrations.skyrl import entrypoint
from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorker

seen = []
RayPPOTrainer.build_models = lambda self, *workers: seen.extend(workers)
entrypoint.KDAPPOTrainer.build_models(object.__new__(entrypoint.KDAPPOTrainer), "skyrl's", None, None)
assert seen == [KDAPolicyWorker, None, None], seen
print("build_models injects KDAPolicyWorker")
entrypoint.main(sys.argv[1:])
"""


def test_launch_is_refused_until_the_workers_serve_the_rl_loop():
    """Without dry_run, main refuses before Ray starts and names what is missing; the trainer
    SkyRL's experiment builds hands SkyRL our worker class."""
    from skyrl_megatron_kda.integrations.skyrl.workers import NOT_INTEGRATED

    done = _run(["-c", _LAUNCH, *ALLGATHER, "trainer.kda.overrides.run.device=gpu"])
    assert "build_models injects KDAPolicyWorker" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 1, done.stderr[-3000:]
    assert "cannot run yet" in done.stderr
    for call in NOT_INTEGRATED:
        assert f"worker call {call}:" in done.stderr
    # The RL calls are integrated (tests/test_skyrl_rl.py runs them), so they are not listed.
    assert "forward" not in NOT_INTEGRATED and "optim_step" not in NOT_INTEGRATED
    for call in ("forward", "forward_backward", "optim_step"):
        assert f"worker call {call}:" not in done.stderr


def test_dry_run_lists_only_what_remains():
    """The dry run's blockers are exactly the NOT_INTEGRATED calls plus this job's settings
    (here the tiny recipe's CPU device), one line each."""
    from skyrl_megatron_kda.integrations.skyrl.workers import NOT_INTEGRATED

    done = _run(["-m", "skyrl.train.entrypoints.main_base", f"trainer.override_entrypoint={ENTRYPOINT}",
                 *ALLGATHER, "trainer.kda.dry_run=true"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    blockers = lines[lines.index("launch blocked by:") + 1:]
    assert [b.split(":")[0] for b in blockers] == (
        ["  - run.device=cpu"] + [f"  - worker call {call}" for call in NOT_INTEGRATED])
    # weight sync is integrated (tests/test_skyrl_weight_sync.py, tests/test_rl_tiny.py)
    assert set(NOT_INTEGRATED) == {"offload_to_cpu", "backload_to_gpu"}


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
