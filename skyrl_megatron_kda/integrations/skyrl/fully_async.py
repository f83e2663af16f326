"""What SkyRL's fully async trainer requires of a job, checked before anything starts.

SkyRL's ``FullyAsyncRayPPOTrainer`` (``skyrl.train.fully_async_trainer``) states its requirements as
asserts in its constructor, which runs inside the Ray task after the datasets and the tokenizer
are built; ``fully_async_problems`` states the same rules by setting, so the entrypoint's dry run
and the refusal before Ray name them. SkyRL's ``validate_cfg`` checks none of them. The loss rule
reads SkyRL's own set of losses that need the old policy's log-probs, so it follows SkyRL.
"""

from typing import List

from skyrl.backends.skyrl_train.utils.ppo_utils import LOSSES_WITH_OLD_LOGPROBS, PolicyLossType


def _optimizes_against_rollout(algorithm) -> bool:
    """SkyRL's rule: stale policies are not kept, so the loss must not need pi_old ~= pi_rollout."""
    if algorithm.policy_loss_type == PolicyLossType.CISPO:
        return algorithm.cispo.cispo_anchor == "rollout"
    return algorithm.policy_loss_type not in LOSSES_WITH_OLD_LOGPROBS


def fully_async_problems(cfg) -> List[str]:
    """The job's settings SkyRL's fully async trainer refuses, one line each (empty: none, or
    ``trainer.fully_async.enabled=false``)."""
    t, fa = cfg.trainer, cfg.trainer.fully_async
    if not fa.enabled:
        if fa.simulate_training:
            return ["trainer.fully_async.simulate_training=true needs trainer.fully_async."
                    "enabled=true: SkyRL then builds no models, which its synchronous trainer needs"]
        return []
    problems = []
    mini, workers, stale = t.policy_mini_batch_size, fa.num_parallel_generation_workers, fa.max_staleness_steps
    if t.train_batch_size != mini:
        problems.append(f"trainer.train_batch_size={t.train_batch_size} must equal "
                        f"trainer.policy_mini_batch_size={mini} for fully async training")
    if not mini <= workers <= mini * (stale + 1):
        problems.append(f"trainer.fully_async.num_parallel_generation_workers={workers} must lie in "
                        f"[{mini}, {mini * (stale + 1)}] (policy_mini_batch_size .. "
                        "policy_mini_batch_size * (max_staleness_steps + 1))")
    if cfg.generator.batched:
        problems.append("generator.batched=true: set it to false (a batched generate() cannot be "
                        "paused for a weight sync)")
    if t.placement.colocate_all:
        problems.append("trainer.placement.colocate_all=true: set it to false (SkyRL's fully async "
                        "trainer generates while it trains)")
    if not _optimizes_against_rollout(t.algorithm):
        problems.append(f"trainer.algorithm.policy_loss_type={t.algorithm.policy_loss_type} needs the "
                        "old policy's log-probs: use rollout_is, dppo, or cispo with "
                        "trainer.algorithm.cispo.cispo_anchor=rollout")
    if t.algorithm.dynamic_sampling.type is not None:
        problems.append(f"trainer.algorithm.dynamic_sampling.type={t.algorithm.dynamic_sampling.type}"
                        " is not supported by SkyRL's fully async trainer (fully_async."
                        "sample_full_batch with zero_variance_filter is its counterpart)")
    if fa.sample_full_batch and not t.algorithm.zero_variance_filter:
        problems.append("trainer.fully_async.sample_full_batch=true needs "
                        "trainer.algorithm.zero_variance_filter=true")
    return problems


def drift_note(cfg) -> List[str]:
    """The console's line, under the fully async trainer, of what log-prob drift to expect."""
    fa = cfg.trainer.fully_async
    if not fa.enabled or fa.simulate_training:
        return []
    return [f"logprob drift (max_staleness_steps={fa.max_staleness_steps}): a rollout sampled "
            "with the weights being trained gives fp32 rounding (about 1e-6); one sampled k steps "
            "earlier (staleness k) was sampled by an older policy, and its drift is that "
            "policy's change over k steps (about 1 at steps 2-3 of examples/rl_tiny at "
            "staleness 1): expected, not an error; is_ratio mean, SkyRL's off-policy ratio of "
            "the same tokens, is beside it"]
