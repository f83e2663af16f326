"""The inputs of the RL example, made here so that nothing is downloaded: a random glm5_next
checkpoint shaped like ``glm53_flash_tiny`` with a 256-word tokenizer, and a JSONL dataset of word
prompts for the ``rl_tiny_words`` environment (``words_env.py``).

Usage: ``python -m examples.rl_tiny.make_inputs WORKDIR`` (from the repository root) writes
``WORKDIR/GLM-tiny-hf`` and ``WORKDIR/train.jsonl``; what is there already is kept.

The prompts are long enough that a rollout (prompt and response) outgrows the recipe's
``model.dsa.index_topk`` (64 tokens): DSA's selection then decides what each query attends to,
and with the recipe's 2 indexer heads many of its scores tie at exactly zero, so the sampler and
the trainer must break those ties the same way for their log-probs to agree.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

from .words_env import ENV

HERE = Path(__file__).resolve().parent
WORDS = ("cat dog bird fish tree river stone red green blue small large the a one two three "
         "sees likes finds follows near under over and then").split()
SPECIALS = ("[PAD]", "[UNK]", "</s>")  # ids 0, 1, 2
VOCAB = 256  # the tiny recipe's vocab_size: every id the model can sample decodes to a word
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT_WORDS = (28, 40)
"""Words per prompt (one token each): with ``run_rl_tiny.sh``'s 40 generated tokens a rollout is
68-80 tokens, longer than the tiny recipe's ``index_topk`` of 64."""
PROMPTS = 16


def make_tokenizer(out: Path) -> None:
    """A word-level tokenizer with the model's 256 ids: the words above, then ``w<i>`` fillers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*SPECIALS, *WORDS]
    names += [f"w{i}" for i in range(len(names), VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(names)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_hf_checkpoint(out: Path) -> None:
    """The fine-tune example's random glm5_next checkpoint of the tiny recipe (one recipe, one
    way to make its weights)."""
    spec = importlib.util.spec_from_file_location(
        "finetune_1m_run_cpu", HERE.parent / "finetune_1m" / "run_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_hf_checkpoint(out)


def make_dataset(path: Path, prompts: int = PROMPTS, seed: int = 0) -> None:
    """SkyRL's prompt dataset: chat messages of real words, and the env class."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(prompts):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*PROMPT_WORDS)))
            f.write(json.dumps({"prompt": [{"role": "user", "content": words}],
                                "env_class": ENV}) + "\n")


def make_inputs(work: Path) -> None:
    """The checkpoint with its tokenizer and the dataset under ``work``, unless already there."""
    work.mkdir(parents=True, exist_ok=True)
    hf = work / "GLM-tiny-hf"
    if not (hf / "tokenizer.json").exists():
        make_hf_checkpoint(hf)
        make_tokenizer(hf)
    if not (work / "train.jsonl").exists():
        make_dataset(work / "train.jsonl")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m examples.rl_tiny.make_inputs WORKDIR", file=sys.stderr)
        return 2
    work = Path(argv[0]).resolve()
    make_inputs(work)
    print(f"inputs: {work / 'GLM-tiny-hf'} (random glm5_next, 256-word tokenizer), "
          f"{work / 'train.jsonl'} ({PROMPTS} prompts)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
