"""The inputs of the RL example, made here so that nothing is downloaded: a random glm5_next
checkpoint shaped like ``glm53_flash_tiny`` with a 256-word tokenizer, and a JSONL dataset of word
prompts for the ``rl_tiny_words`` environment (``words_env.py``).

Usage (from the repository root):
``python -m examples.rl_tiny.make_inputs WORKDIR [--recipe NAME] [--prompt-words MIN:MAX]``
writes ``WORKDIR/<recipe>-hf`` and ``WORKDIR/train.jsonl``; what is there already is kept. Another
recipe (the full-width ``glm53_flash_slice`` for a GPU run) gets a checkpoint of its shape and a
tokenizer with as many ids as its vocabulary; ``--prompt-words`` sets the prompts' length (longer
than that recipe's ``index_topk`` for selection to matter).

The prompts are long enough that a rollout (prompt and response) outgrows the recipe's
``model.dsa.index_topk`` (64 tokens): DSA's selection then decides what each query attends to,
and with the recipe's 2 indexer heads many of its scores tie at exactly zero, so the sampler and
the trainer must break those ties the same way for their log-probs to agree.
"""

from __future__ import annotations

import argparse
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
RECIPE = "glm53_flash_tiny"
VOCAB = 256  # the tiny recipe's vocab_size: every id the model can sample decodes to a word
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT_WORDS = (28, 40)
"""Words per prompt (one token each): with ``run_rl_tiny.sh``'s 40 generated tokens a rollout is
68-80 tokens, longer than the tiny recipe's ``index_topk`` of 64."""
PROMPTS = 16


def make_tokenizer(out: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer with the model's ``vocab`` ids: the words above, then ``w<i>``
    fillers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*SPECIALS, *WORDS]
    names += [f"w{i}" for i in range(len(names), vocab)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(names)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_hf_checkpoint(out: Path, recipe: str = RECIPE) -> None:
    """The fine-tune example's random glm5_next checkpoint of ``recipe`` (one way to make a
    recipe's weights)."""
    spec = importlib.util.spec_from_file_location(
        "finetune_1m_run_cpu", HERE.parent / "finetune_1m" / "run_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_hf_checkpoint(out, recipe=recipe)


def make_dataset(path: Path, prompts: int = PROMPTS, seed: int = 0,
                 prompt_words: tuple[int, int] = PROMPT_WORDS) -> None:
    """SkyRL's prompt dataset: chat messages of real words, and the env class."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(prompts):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words)))
            f.write(json.dumps({"prompt": [{"role": "user", "content": words}],
                                "env_class": ENV}) + "\n")


def make_inputs(work: Path, recipe: str = RECIPE, prompt_words: tuple[int, int] = PROMPT_WORDS) -> Path:
    """The checkpoint of ``recipe`` with its tokenizer, and the dataset, under ``work`` unless
    already there; returns the checkpoint's folder."""
    from skyrl_megatron_kda.recipes import load_recipe

    work.mkdir(parents=True, exist_ok=True)
    hf = work / f"{recipe}-hf"
    if not (hf / "tokenizer.json").exists():
        make_hf_checkpoint(hf, recipe)
        make_tokenizer(hf, load_recipe(recipe).recipe.model.vocab_size)
    if not (work / "train.jsonl").exists():
        make_dataset(work / "train.jsonl", prompt_words=prompt_words)
    return hf


def word_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` words per prompt, 1 <= MIN <= MAX."""
    low, _, high = text.partition(":")
    try:
        span = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN:MAX, e.g. 28:40") from None
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 1 <= MIN <= MAX")
    return span


def _one_line_error(message: str) -> None:
    """A bad argument as one ``error:`` line and exit status 2 (argparse would print its usage)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.rl_tiny.make_inputs",
                                     description="the RL example's checkpoint, tokenizer and prompts")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--recipe", default=RECIPE, help=f"the checkpoint's shape (default {RECIPE})")
    parser.add_argument("--prompt-words", type=word_range, default=PROMPT_WORDS, metavar="MIN:MAX",
                        help="words (tokens) per prompt (default %d:%d)" % PROMPT_WORDS)
    parser.error = _one_line_error
    args = parser.parse_args(argv)
    import yaml

    from skyrl_megatron_kda.console import message
    from skyrl_megatron_kda.recipes import load_recipe

    try:
        load_recipe(args.recipe)
    except (KeyError, ValueError, OSError, yaml.YAMLError) as exc:  # unknown, unreadable, invalid
        _one_line_error(f"--recipe {args.recipe}: {message(exc)}")
    work = args.workdir.resolve()
    hf = make_inputs(work, args.recipe, args.prompt_words)
    low, high = args.prompt_words
    print(f"inputs: {hf} (random glm5_next of {args.recipe}, word-level tokenizer), "
          f"{work / 'train.jsonl'} ({PROMPTS} prompts of {low}-{high} words)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
