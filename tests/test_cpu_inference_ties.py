"""The project's sampler's DSA selection (on the CPU) breaks ties as the trainer does, on rows
longer than ``index_topk`` (integrations/skyrl/glm5_next_client.py, ``match_trainer_dsa_ties``).

An indexer score is a sum over indexer heads of weighted ReLUs: with few heads many pools score
exactly 0, and past ``index_topk`` tokens several tie at the top-k boundary. The trainer's torch
kernel keeps the earlier pool (dsa/pool_topk.py); transformers' glm5_next takes ``torch.topk``'s
pick. The client's model keeps the earlier pool too, so:

- on each config (2 indexer heads with ``index_topk`` 64, as the tiny recipe; 4 heads, 16; 6
  heads, 16; 8 heads, 32), the client's model gives the trainer's log-probs at every position of
  a 128-token row, within fp32 rounding. The trainer's are computed as SkyRL's policy worker
  computes them (``train.rl``: the batch packed into one THD row, ``GLMModel.token_logprobs`` on
  the per-rank model; TP1, the torch DSA kernel);
- negative control: transformers' stock glm5_next on the same weights and row differs from the
  trainer by far more at the positions where a tie at the boundary is broken the other way
  (each config with fewer than 8 heads has such positions here; the 8-head rows have none);
- the RL path itself: ``Glm5NextInferenceClient.generate`` samples a response that runs past
  ``index_topk``, and its ``response_logprobs`` are the trainer's on that row (packed as the
  second document after a random row, right-padded), where the stock model's differ;
- only the client's model changes: another glm5_next instance of the same class, and torch
  calls after the indexer's, are as before.

Weights: transformers' init, every tensor nudged by noise (as the examples' checkpoints are
made), fp32. Runs after tests/test_cpu_inference_client.py and, like it, imports glm5_next
through the client first (its torch path on CPU).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.ranks import run_ranks

ROW = 128  # tokens per teacher-forced row: past every config's index_topk
VOCAB_LOW = 3  # row tokens avoid pad / bos / eos (0, 1, 2)
# config name -> (index_num_heads, index_topk, weight seed, row seed). With 6 heads a tie broken
# differently is rare (one row in 24 of those tried has one); the seeds are chosen so that each
# config with fewer than 8 heads has such positions, which the negative control checks.
CASES = {
    "2 heads, topk 64": (2, 64, 0, 100),
    "4 heads, topk 16": (4, 16, 1, 101),
    "6 heads, topk 16": (6, 16, 5, 102),
    "8 heads, topk 32": (8, 32, 0, 103),
}
TIE_PRONE = [name for name, (heads, *_) in CASES.items() if heads < 8]
GENERATED = "4 heads, topk 16"  # the config the client samples from
PROMPT, RESPONSE = 12, 52  # the sampled row: 64 tokens, the response past index_topk
PROMPT_SEED = 8  # a prompt whose response meets ties broken differently (2 of 52 tokens)
ROUNDING = 1e-5  # fp32: the measured gaps are 1e-6 (log-probs of order 5)
CHANGED = 1e-3  # 100x rounding; a position whose selection differs moves by 6e-3 to 2e-1 here


def _recipe(heads: int, topk: int):
    """The tiny recipe's model at TP1 with ``heads`` indexer heads selecting ``topk`` tokens."""
    from skyrl_megatron_kda.config.dotpath import merge
    from skyrl_megatron_kda.recipes import load_recipe

    tiny = load_recipe("glm53_flash_tiny").recipe
    return type(tiny).model_validate(merge(tiny.model_dump(), {
        "model": {"dsa": {"index_num_heads": heads, "index_topk": topk, "kernel": "torch"}},
        "parallel": {"tp": 1, "cp": 1, "ep": 1, "etp": 1, "sequence_parallel": False},
        "run": {"num_workers": 1}}))


def _make_checkpoint(folder: Path, recipe, seed: int) -> None:
    """A random glm5_next of ``recipe``: transformers' init plus noise on every tensor."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import _glm5_next_class
    from skyrl_megatron_kda.model.hf_io import hf_text_config

    text = dict(hf_text_config(recipe), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                  out_hidden_size=text["hidden_size"], projection_intermediate_size=16,
                  patch_size=2, temporal_patch_size=1)
    torch.manual_seed(seed)
    model = _glm5_next_class()(Glm5NextConfig(text_config=text, vision_config=vision))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for tensor in [*model.parameters(), *biases]:
            tensor.add_(0.05 * torch.randn(tensor.shape, generator=gen))
    model.float().save_pretrained(folder)


def _stock(folder: Path) -> torch.nn.Module:
    """transformers' glm5_next as it ships (``torch.topk``'s ties), fp32."""
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import _glm5_next_class

    return _glm5_next_class().from_pretrained(folder, attn_implementation="eager").float().eval()


def _next_token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t + 1] | ids[:t + 1]) [L - 1] from one forward of the whole row (causal: what
    a token-by-token sampler computes at each position)."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]


class _Tokenizer:
    """What the client reads of a tokenizer: no EOS (every sample runs to ``max_tokens``) and a
    decode."""

    eos_token_id = None

    def decode(self, tokens, skip_special_tokens=True) -> str:
        return " ".join(map(str, tokens))


def _client(checkpoint: Path, root: Path):
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import Glm5NextInferenceClient
    from skyrl_megatron_kda.integrations.skyrl.weight_sync import (
        LATEST,
        TRAIN_STEP,
        version_folder,
    )

    folder = version_folder(root, 1)  # published as weight_sync.DiskPublisher does
    shutil.copytree(checkpoint, folder)
    (folder / TRAIN_STEP).write_text("0")
    (root / LATEST).write_text(folder.name)
    client = Glm5NextInferenceClient(root, _Tokenizer(), model_name="ties", seed=3, device="cpu")
    asyncio.run(client.resume_generation())  # loads the published version
    return client


def _trainer_logprobs(rank, world, jobs):
    """The trainer's log-probs as SkyRL's policy worker computes them (``train.rl``: the batch
    packed into one THD row, each row a document, then ``GLMModel.token_logprobs`` through the
    per-rank model): per job, (checkpoint, recipe, rows [B, S], real-token mask [B, S]) ->
    [B, S], entry t the log-prob of token t given the tokens before it."""
    from skyrl_megatron_kda.train.rl import pack_rollout, token_logprobs
    from skyrl_megatron_kda.train.trainer import RankModel

    out = {}
    for name, (checkpoint, recipe, rows, mask) in jobs.items():
        recipe = recipe.model_copy(update={"run": recipe.run.model_copy(
            update={"init_from_hf": checkpoint})})
        model = RankModel(recipe)
        model.module.eval()
        with torch.no_grad():
            logp, _ = token_logprobs(model, pack_rollout(rows, mask, recipe.parallel,
                                                         recipe.parallel.cp_layout))
        out[name] = logp
        model.close()
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Per config: the client's, the stock model's and the trainer's log-probs of a random row;
    and the client's sampled row on ``GENERATED``."""
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import _glm5_next_class

    _glm5_next_class()  # the client's torch-path import of glm5_next comes first
    base = tmp_path_factory.mktemp("ties")
    found, jobs = {}, {}
    for i, (name, (heads, topk, seed, row_seed)) in enumerate(CASES.items()):
        recipe = _recipe(heads, topk)
        checkpoint = base / f"hf{i}"
        _make_checkpoint(checkpoint, recipe, seed)
        client = _client(checkpoint, base / f"sync{i}")
        ids = torch.randint(VOCAB_LOW, recipe.model.vocab_size, (1, ROW),
                            generator=torch.Generator().manual_seed(row_seed))
        found[name] = dict(topk=topk, client=_next_token_logprobs(client.model, ids),
                           stock=_next_token_logprobs(_stock(checkpoint), ids))
        rows, mask = ids, torch.ones_like(ids)
        if name == GENERATED:
            prompt = torch.randint(VOCAB_LOW, recipe.model.vocab_size, (PROMPT,),
                                   generator=torch.Generator().manual_seed(PROMPT_SEED)).tolist()
            out = asyncio.run(client.generate({
                "prompt_token_ids": [prompt],
                "sampling_params": {"max_tokens": RESPONSE, "temperature": 1.0, "logprobs": 0}}))
            row = torch.tensor([prompt + out["response_ids"][0]])
            found["generated"] = dict(topk=topk, row=row,
                                      client=torch.tensor(out["response_logprobs"][0]),
                                      stock=_next_token_logprobs(_stock(checkpoint), row)[PROMPT - 1:])
            # the sampled row beside the random one in the trainer's batch, right-padded as
            # SkyRL pads a batch: two documents of the packed row
            padded, real = torch.zeros_like(ids), torch.zeros_like(ids)
            padded[0, :row.shape[1]], real[0, :row.shape[1]] = row[0], 1
            rows, mask = torch.cat([ids, padded]), torch.cat([mask, real])
        jobs[name] = (str(checkpoint), recipe, rows, mask)
    (trainer,) = run_ranks(1, _trainer_logprobs, jobs)
    for name, logp in trainer.items():
        found[name]["trainer"] = logp[0, 1:]
        if name == GENERATED:
            found["generated"]["trainer"] = logp[1, PROMPT:PROMPT + RESPONSE]
    return found


def _gaps(found: dict) -> tuple[float, float, int]:
    """(client vs trainer, stock vs trainer: max abs log-prob gap; positions where the stock
    model is off by more than ``CHANGED``)."""
    client = (found["client"] - found["trainer"]).abs()
    stock = (found["stock"] - found["trainer"]).abs()
    return float(client.max()), float(stock.max()), int((stock > CHANGED).sum())


@pytest.mark.parametrize("name", list(CASES))
def test_client_gives_the_trainers_logprobs_past_index_topk(rows, name):
    found = rows[name]
    client, stock, moved = _gaps(found)
    print(f"{name}: client {client:.2e}, stock {stock:.2e} ({moved} of {ROW - 1} positions moved)")
    assert ROW > found["topk"] + 32  # rows where selection chooses among many pools
    assert client < ROUNDING, f"{name}: the client's log-probs are {client:.2e} from the trainer's"


@pytest.mark.parametrize("name", TIE_PRONE)
def test_stock_glm5_next_breaks_ties_otherwise(rows, name):
    """The negative control: without the tie rule the sampler is off at the tied positions."""
    _, stock, moved = _gaps(rows[name])
    assert moved >= 1, (
        f"{name}: stock glm5_next is within {stock:.2e} of the trainer: the row meets no tie the "
        "two rules break differently, so it tests nothing")


def test_eight_heads_meet_no_tie_here(rows):
    """With 8 indexer heads an exact 0 at the boundary needs most of a query's head weights to
    be negative: this row has none, and the stock model equals the trainer as well."""
    _, stock, moved = _gaps(rows["8 heads, topk 32"])
    assert moved == 0 and stock < ROUNDING, (stock, moved)


def test_sampled_response_past_index_topk_has_the_trainers_logprobs(rows):
    found = rows["generated"]
    client, stock, moved = _gaps(found)
    print(f"generated ({GENERATED}): client {client:.2e}, stock {stock:.2e} "
          f"({moved} of {RESPONSE} response tokens moved)")
    assert found["row"].shape[1] == PROMPT + RESPONSE > found["topk"] + 32
    assert client < ROUNDING, f"the sampled log-probs are {client:.2e} from the trainer's"
    assert moved >= 1, "negative control: the response meets no tie broken otherwise"


def test_only_the_clients_model_changes(tmp_path):
    """The rule is an attribute of the client's indexers, wrapping the class's own forward:
    another instance is untouched (the stock model's differing log-probs above show its
    ``torch.topk`` at work), the stable top-k's mode ends with the call, and applying the rule
    twice changes nothing more."""
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import (
        INDEXER_CLASS,
        load_glm5_next,
        match_trainer_dsa_ties,
    )

    from torch.overrides import _get_current_function_mode_stack

    recipe = _recipe(4, 16)
    _make_checkpoint(tmp_path, recipe, seed=1)
    ours, stock = load_glm5_next(tmp_path), _stock(tmp_path)
    indexers = [m for m in ours.modules() if type(m).__name__ == INDEXER_CLASS]
    assert len(indexers) == 1 and "forward" in vars(indexers[0])  # the tiny model's one DSA layer
    assert not any("forward" in vars(m) for m in stock.modules() if type(m).__name__ == INDEXER_CLASS)
    assert indexers[0].forward.__wrapped__ == type(indexers[0]).forward.__get__(indexers[0])
    assert match_trainer_dsa_ties(ours) == 0

    ids = torch.randint(VOCAB_LOW, recipe.model.vocab_size, (1, ROW),
                        generator=torch.Generator().manual_seed(101))
    _next_token_logprobs(ours, ids)
    assert _get_current_function_mode_stack() == []  # the stable top-k ended with the call
