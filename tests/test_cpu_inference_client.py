"""The project's sampler (integrations/skyrl/glm5_next_client.py) on the CPU, without a trainer:
version folders are written here the way ``weight_sync.DiskPublisher`` writes them (an HF folder
with ``TRAIN_STEP``, named in ``LATEST``), from the rl_tiny example's random glm5_next checkpoint
and tokenizer.

- Reproducible across a restart: a call's samples depend on the client's seed, the optimizer
  steps of the weights (``TRAIN_STEP``), its prompts and its index among the calls with those
  prompts on them, not on what the client drew
  before; a fresh client (a resumed job) draws what a long-lived one drew. Negative controls:
  the same weights under another ``TRAIN_STEP``, and the next call on the same weights, draw
  other tokens.
- The device it is given: with ``device="cpu"`` (what the entrypoint passes for
  ``run.device=cpu``) the model is fp32 on the CPU, and a pickled copy (what SkyRL ships to the
  workers) keeps the device and no weights.
- Colocation: asleep (SkyRL's ``sleep``, and after ``wake_up(["weights"])`` only) it refuses to
  generate; once ``kv_cache`` wakes too, it serves the newest published version.
- ``offload_kv_for_weight_sync`` under the fully async trainer: SkyRL's own sync bracket
  (``WorkerDispatch.save_weights_for_sampler``: pause, ``sleep_for_weight_sync``, wake weights,
  send, wake KV cache, resume) runs against the client; it generates nothing inside the bracket
  and the newest version after it. A send that fails inside the first sync (nothing published)
  reaches the caller as itself, not as the resume's "no published weights".
"""

from __future__ import annotations

import asyncio
import pickle
import shutil
from pathlib import Path

import pytest
import torch

PROMPTS = [[5, 9, 14, 3], [5, 9, 14, 3], [7, 7, 21]]  # a repeated prompt, as GRPO sends it
BATCH = {"prompt_token_ids": PROMPTS,
         "sampling_params": {"max_tokens": 6, "temperature": 1.0, "logprobs": 0}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import _glm5_next_class

    _glm5_next_class()  # the client's torch-path import of glm5_next, before the example's
    from examples.rl_tiny import make_inputs as example

    hf = tmp_path_factory.mktemp("hf")
    example.make_hf_checkpoint(hf)
    example.make_tokenizer(hf)
    return hf


def _publish(checkpoint: Path, root: Path, version: int, train_step: int) -> None:
    from skyrl_megatron_kda.integrations.skyrl.weight_sync import LATEST, TRAIN_STEP, version_folder

    folder = version_folder(root, version)
    shutil.copytree(checkpoint, folder)
    (folder / TRAIN_STEP).write_text(str(train_step))
    (root / LATEST).write_text(folder.name)


def _client(checkpoint: Path, root: Path):
    from transformers import AutoTokenizer

    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import Glm5NextInferenceClient

    return Glm5NextInferenceClient(root, AutoTokenizer.from_pretrained(checkpoint),
                                   model_name="tiny", device="cpu")


def _sample(client) -> list:
    out = asyncio.run(client.generate(BATCH))
    return list(zip(out["response_ids"], out["response_logprobs"]))


def test_samples_depend_on_weights_step_and_call_not_on_the_clients_history(checkpoint, tmp_path):
    long_lived = _client(checkpoint, tmp_path)
    _publish(checkpoint, tmp_path, 1, train_step=0)
    asyncio.run(long_lived.resume_generation())
    at_step_0 = _sample(long_lived)
    # The same weights published as step 1 (as after a step): only the seed's inputs change.
    _publish(checkpoint, tmp_path, 2, train_step=1)
    asyncio.run(long_lived.resume_generation())
    first, second = _sample(long_lived), _sample(long_lived)

    resumed = _client(checkpoint, tmp_path)  # a restarted job's client, on the same version
    asyncio.run(resumed.resume_generation())
    assert _sample(resumed) == first
    assert _sample(resumed) == second
    # Negative controls: another weights step, or the next call, draws other tokens.
    assert [t for t, _ in at_step_0] != [t for t, _ in first]
    assert [t for t, _ in second] != [t for t, _ in first]
    # The two samples of the repeated prompt within one call differ too.
    assert first[0][0] != first[1][0]


def test_the_client_loads_its_model_on_the_device_it_is_given(checkpoint, tmp_path):
    client = _client(checkpoint, tmp_path)
    _publish(checkpoint, tmp_path, 1, train_step=0)
    asyncio.run(client.resume_generation())
    assert client.device == torch.device("cpu")
    held = {(p.device.type, p.dtype) for p in client.model.parameters()}
    assert held == {("cpu", torch.float32)}, held
    assert len(_sample(client)) == len(PROMPTS)
    shipped = pickle.loads(pickle.dumps(client))
    assert (shipped.device, shipped._model) == (torch.device("cpu"), None)


def test_a_colocated_client_generates_only_awake_on_the_newest_weights(checkpoint, tmp_path):
    client = _client(checkpoint, tmp_path)
    _publish(checkpoint, tmp_path, 1, train_step=0)
    asyncio.run(client.sleep())  # SkyRL's colocated engines start asleep
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache, weights\)"):
        asyncio.run(client.generate(BATCH))
    # A sync: weights wake, the trainer publishes, then the KV cache wakes.
    asyncio.run(client.wake_up(tags=["weights"]))
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache\)"):
        asyncio.run(client.generate(BATCH))
    _publish(checkpoint, tmp_path, 2, train_step=1)
    asyncio.run(client.wake_up(tags=["kv_cache"]))
    assert (client.loaded_version, client.loaded_train_step) == (2, 1)
    assert not asyncio.run(client.is_sleeping())
    assert len(_sample(client)) == len(PROMPTS)
    with pytest.raises(ValueError, match=r"unknown sleep tags \['gpu'\]"):
        asyncio.run(client.sleep(tags=["gpu"]))


def _dispatch(client, send):
    """SkyRL's ``WorkerDispatch`` with only what its sync bracket reads: a non-colocated fully
    async job with ``offload_kv_for_weight_sync``, ``send`` standing in for the workers'
    broadcast (no worker actors)."""
    from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch
    from skyrl.train.config import SkyRLTrainConfig

    dispatch = object.__new__(WorkerDispatch)
    dispatch.cfg = SkyRLTrainConfig.from_cli_overrides([
        "trainer.strategy=megatron", "trainer.placement.colocate_all=false",
        "trainer.fully_async.enabled=true", "generator.batched=false",
        "generator.inference_engine.offload_kv_for_weight_sync=true"])
    dispatch.colocate_all, dispatch._inference_engine_client = False, client

    async def prepare(adapter_only_sync):
        pass

    dispatch._prepare_for_weight_sync = prepare
    dispatch.ensure_active_adapter = lambda *args, **kwargs: None
    dispatch._broadcast_to_inference_engines = lambda client, model_id: send()
    dispatch._finish_weight_sync = lambda adapter_only_sync: None
    return dispatch


def test_fully_async_sync_sleeps_and_wakes_the_client_and_shows_a_failed_send(checkpoint, tmp_path):
    client = _client(checkpoint, tmp_path)

    def failing_send():
        raise RuntimeError("the send failed")

    # The first sync (nothing published yet) fails inside the bracket: its error, not the resume's.
    with pytest.raises(RuntimeError, match="the send failed"):
        asyncio.run(_dispatch(client, failing_send).save_weights_for_sampler())
    # SkyRL's finally resumes generation; it wakes the KV cache only after a send that worked.
    assert not client.paused and client.asleep == {"kv_cache"}

    seen = {}

    def send():
        seen["asleep"], seen["paused"] = set(client.asleep), client.paused
        with pytest.raises(RuntimeError, match="paused"):  # inside SkyRL's running loop
            client.generate(BATCH).send(None)
        _publish(checkpoint, tmp_path, 1, train_step=0)

    asyncio.run(_dispatch(client, send).save_weights_for_sampler())
    assert seen == {"asleep": {"kv_cache"}, "paused": True}  # weights woken for the send
    assert (client.loaded_version, client.paused, client.asleep) == (1, False, set())
    assert len(_sample(client)) == len(PROMPTS)
    with pytest.raises(RuntimeError, match="without pause_generation"):
        asyncio.run(client.sleep_for_weight_sync())


def test_a_calls_samples_do_not_depend_on_the_order_of_other_prompts_calls(checkpoint, tmp_path):
    """The fully async trainer's generation workers take turns by timing: a prompt's draws on
    the same weights are the same whichever other prompts were sampled before it."""
    _publish(checkpoint, tmp_path, 1, train_step=0)
    one, two = ({**BATCH, "prompt_token_ids": [p]} for p in PROMPTS[1:])
    forward, backward = _client(checkpoint, tmp_path), _client(checkpoint, tmp_path)
    first = [asyncio.run(forward.generate(b))["response_ids"] for b in (one, two, one)]
    second = [asyncio.run(backward.generate(b))["response_ids"] for b in (two, one, one)]
    assert (first[0], first[1], first[2]) == (second[1], second[0], second[2])
    assert first[0] != first[2]  # the same prompt's next call draws anew
