"""The project's sampler (``integrations/skyrl/glm5_next_client.py``) in a process of its own, for
tests/test_sampler_device.py:

    python -m tests.support.sampler_runs generate ROOT DEVICE OUT.json
    python -m tests.support.sampler_runs score ROOT ROWS.json OUT.json

``generate`` publishes the rl_tiny example's random glm5_next checkpoint under ``ROOT`` (once,
as ``weight_sync.DiskPublisher`` does) and samples ``PROMPTS`` with a client on ``DEVICE``;
``score`` gives, on the CPU, the log-prob of each generated response token with one forward of
its whole row, from the client's model as loaded and from the same model with one stacked MoE
tensor in the wrong expert order (a layout bug: the size of difference the device test must
catch).

A process each, so that the sampler imports transformers' glm5_next first there (its torch
path), whatever the test session imported before; ``run`` hides CUDA from a CPU run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PROMPT, RESPONSE = 66, 14
"""Tokens per prompt and per response: rows of 80, every response token past the tiny recipe's
``index_topk`` (64), so DSA's selection (and its tie rule) decides what each sampled query
attends to; a short response keeps the token-by-token sampling cheap."""
PROMPTS = 3
SEED = 0
LAYOUT_BUG = ("model.language_model.layers.3.mlp.experts.gate_up_proj", 0, 1)
"""The tensor whose two experts ``score`` swaps (the DSA layer's MoE)."""


def _publish(root: Path) -> None:
    """The example's checkpoint and tokenizer in ``root/hf``, published as version 1."""
    from examples.rl_tiny import make_inputs as example
    from skyrl_megatron_kda.integrations.skyrl.weight_sync import LATEST, TRAIN_STEP, version_folder

    weights = root / "weights"
    if (weights / LATEST).exists():
        return
    example.make_hf_checkpoint(root / "hf")
    example.make_tokenizer(root / "hf")
    folder = version_folder(weights, 1)
    shutil.copytree(root / "hf", folder)
    (folder / TRAIN_STEP).write_text("0")
    (weights / LATEST).write_text(folder.name)


def _client(root: Path, device: str):
    from transformers import AutoTokenizer

    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import Glm5NextInferenceClient

    return Glm5NextInferenceClient(root / "weights", AutoTokenizer.from_pretrained(root / "hf"),
                                   model_name="tiny", seed=SEED, device=device)


def generate(root: Path, device: str) -> dict:
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import _glm5_next_class

    _glm5_next_class()  # the sampler's torch-path import, before the example's checkpoint maker
    _publish(root)
    client = _client(root, device)
    asyncio.run(client.resume_generation())
    ids = list(range(3, 3 + PROMPT * PROMPTS))  # not pad / bos / eos (0, 1, 2)
    prompts = [ids[i * PROMPT:(i + 1) * PROMPT] for i in range(PROMPTS)]
    out = asyncio.run(client.generate({"prompt_token_ids": prompts, "sampling_params": {
        "temperature": 1.0, "max_tokens": RESPONSE, "min_tokens": RESPONSE, "logprobs": 0}}))
    return {"prompts": prompts, "response_ids": out["response_ids"],
            "response_logprobs": out["response_logprobs"],
            "device": str(next(client.model.parameters()).device)}


def score(root: Path, rows: dict) -> dict:
    import torch

    model = _client(root, "cpu").model

    def logprobs() -> list:
        scored = []
        for prompt, response in zip(rows["prompts"], rows["response_ids"]):
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()[0, len(prompt) - 1:-1]
            scored.append(torch.log_softmax(logits, dim=-1).gather(
                -1, ids[0, len(prompt):, None])[:, 0].tolist())
        return scored

    clean = logprobs()
    name, a, b = LAYOUT_BUG
    tensor = dict(model.named_parameters())[name]
    with torch.no_grad():
        tensor[[a, b]] = tensor[[b, a]]
    return {"scored": clean, "layout_bug": logprobs()}


def run(*args: str, cuda: bool) -> dict:
    """``python -m tests.support.sampler_runs ARGS OUT`` in a fresh process (CUDA hidden unless
    ``cuda``); what it wrote to ``OUT``."""
    out = Path(args[1]) / f"{args[0]}-{'cuda' if cuda else 'cpu'}.json"
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-m", __name__, *args, str(out)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def main(argv: list[str]) -> int:
    command, root, arg, out = argv
    result = (generate(Path(root), arg) if command == "generate"
              else score(Path(root), json.loads(Path(arg).read_text())))
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
