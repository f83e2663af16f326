"""Ray for a CPU job of the KDA entrypoint: a local Ray whose logical GPUs stand for the ranks.

SkyRL places every worker, and every colocated engine slot, in a bundle with one GPU; the ranks
of a CPU recipe use gloo and no device, so the local Ray declares one logical GPU per slot for
SkyRL's placement groups to fill. SkyRL's ``initialize_ray`` does not serve here: on a head node
without GPUs its runtime environment probes NCCL peer access on a node with 2 GPUs (a placement
group a CPU machine never fills), and the rest of it is CUDA, NCCL and vLLM settings. Its console
behaviour is kept: the workers write their output to SkyRL's infra log (``SKYRL_LOG_FILE``), so
that the console shows the training progress.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import ray

from .config import uses_reference

_HOOK = "skyrl_megatron_kda.console.quiet_warnings"


def logical_gpus(cfg) -> int:
    """GPU slots SkyRL's placement asks of a job ``cfg``: the policy ranks, the reference ranks
    (SkyRL builds them for its KL terms) and the colocated engine slots. Colocation puts the
    workers in the engines' bundles, so this counts some slots twice: spare logical GPUs cost
    nothing."""
    t, ie = cfg.trainer, cfg.generator.inference_engine
    slots = t.placement.policy_num_nodes * t.placement.policy_num_gpus_per_node
    if uses_reference(t):
        slots += t.placement.ref_num_nodes * t.placement.ref_num_gpus_per_node
    if t.placement.colocate_all:
        slots += ie.num_engines * ie.tensor_parallel_size * ie.pipeline_parallel_size * \
            ie.data_parallel_size
    return slots


def start_local_ray(cfg) -> Path:
    """Start a Ray of this process's own (never a cluster named by ``RAY_ADDRESS``) for the CPU
    job ``cfg``; returns the infra log the workers write to."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries
    from skyrl.env_vars import SKYRL_DUMP_INFRA_LOG_TO_STDOUT

    log_dir = Path(cfg.trainer.log_path).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / f"infra-{datetime.now():%y%m%d_%H%M%S}.log"
    env = {} if SKYRL_DUMP_INFRA_LOG_TO_STDOUT else {"SKYRL_LOG_FILE": str(log_file)}
    if not SKYRL_DUMP_INFRA_LOG_TO_STDOUT:
        os.environ["RAY_BACKEND_LOG_LEVEL"] = "fatal"  # as SkyRL's initialize_ray
    gpus = logical_gpus(cfg)
    # One CPU per GPU bundle (SkyRL's bundles hold one of each), one for the experiment's task and
    # one for SkyRL's registry actor; logical, so a laptop with fewer cores runs them all.
    ray.init(address="local", num_cpus=gpus + 2, num_gpus=gpus, include_dashboard=False,
             log_to_driver=True,
             runtime_env={"worker_process_setup_hook": _HOOK, "env_vars": env})
    sync_registries()
    return log_file
