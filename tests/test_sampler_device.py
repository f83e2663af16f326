"""The project's sampler on the device it is given (``Glm5NextInferenceClient(device=...)``: the
entrypoint passes ``cuda`` for a GPU recipe, ``cpu`` for a CPU one).

- Without CUDA, ``device="cuda"`` is refused when the client is built, in one line that says
  why and what to do (the dry run does not check CUDA: it may run on a node without GPUs).
- On a GPU (``gpu`` mark): the rl_tiny example's random checkpoint, loaded on cuda, samples
  rows whose log-probs the CPU's model gives within ``DEVICE_TOL``, and the same tokens as the
  CPU client from the same seed (rows of 80 tokens, past ``index_topk``, so DSA's selection runs
  on the GPU too).
- On the CPU, the comparison's reach: teacher-forced scoring of the sampled rows gives the
  sampler's own log-probs within fp32 rounding, and a layout bug (one stacked MoE tensor's
  experts swapped) moves them by more than ``DEVICE_TOL``.

Each side runs in its own process (``tests/support/sampler_runs.py``), the CPU one with CUDA
hidden, so that glm5_next is imported there by the sampler first, as in a job.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.sampler_runs import run

ROUNDING = 1e-5
"""fp32, the same device: one forward of the whole row against the sampler's token-by-token
forwards (measured 1e-6 on log-probs of order 5)."""
DEVICE_TOL = 1e-3
"""GPU against CPU, both fp32 on transformers' torch path (no TF32): rounding of other sums,
1e-6 to 1e-5. A layout bug moves log-probs by 0.3 to 1.9 at its worst position (two experts of
one MoE tensor swapped, two KDA heads swapped, a square projection transposed, on rows of this
checkpoint), and a selection or route that flips by 6e-3 to 0.2."""


def _max_gap(a: list, b: list) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory) -> tuple:
    """(the folder with the published checkpoint, what the CPU client sampled there)."""
    root = tmp_path_factory.mktemp("sampler")
    return root, run("generate", str(root), "cpu", cuda=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal is "
                    "for a process without it")
def test_the_client_refuses_cuda_without_cuda(tmp_path):
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import Glm5NextInferenceClient

    with pytest.raises(RuntimeError) as refused:
        Glm5NextInferenceClient(tmp_path, None, model_name="tiny", device="cuda")
    assert str(refused.value) == (
        "Glm5NextInferenceClient: device='cuda' but this process sees no CUDA GPU "
        "(torch.cuda.is_available() is False); run the job where SkyRL's experiment sees a GPU, "
        "or use a CPU recipe (run.device=cpu)")


@pytest.mark.parametrize("device", ["mps", "tpu"])
def test_the_client_refuses_a_device_other_than_cpu_or_cuda(tmp_path, device):
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import Glm5NextInferenceClient

    with pytest.raises(ValueError, match=rf"^Glm5NextInferenceClient: device='{device}': "
                                         "choose cpu or cuda$"):
        Glm5NextInferenceClient(tmp_path, None, model_name="tiny", device=device)


def test_the_device_comparison_would_catch_a_layout_bug(on_cpu):
    root, sampled = on_cpu
    assert sampled["device"] == "cpu"
    scored = run("score", str(root), str(root / "generate-cpu.json"), cuda=False)
    rounding = _max_gap(scored["scored"], sampled["response_logprobs"])
    assert rounding < ROUNDING, f"scoring the sampled rows: {rounding:.2e} from the sampler's " \
        f"own log-probs (budget {ROUNDING:.0e}): the comparison below would measure nothing"
    bug = _max_gap(scored["layout_bug"], sampled["response_logprobs"])
    assert bug > 10 * DEVICE_TOL, f"a layout bug moves log-probs by only {bug:.2e}: the GPU " \
        f"test's tolerance {DEVICE_TOL:.0e} would not catch it"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sampler on cuda: needs CUDA")
def test_the_sampler_on_cuda_samples_what_it_samples_on_the_cpu(on_cpu):
    root, on_host = on_cpu
    on_gpu = run("generate", str(root), "cuda", cuda=True)
    assert on_gpu["device"].startswith("cuda"), on_gpu["device"]
    # The GPU's own rows, scored on the CPU: position by position, whatever was drawn.
    scored = run("score", str(root), str(root / "generate-cuda.json"), cuda=False)
    gap = _max_gap(on_gpu["response_logprobs"], scored["scored"])
    assert gap < DEVICE_TOL, (
        f"cuda vs cpu log-probs differ by {gap:.2e} (budget {DEVICE_TOL:.0e}: fp32 rounding is "
        "1e-6 to 1e-5; a layout bug or a flipped DSA selection / MoE route is 6e-3 or more)")
    assert on_gpu["response_ids"] == on_host["response_ids"], (
        "the same seed drew other tokens on cuda, though the log-probs agree: the draw is not "
        "made from the CPU's generator as on the CPU")
