"""The fine-tune example end to end on CPU, with the tiny recipe instead of the 1M-token one:

1. make a random glm5_next Hugging Face checkpoint shaped like ``glm53_flash_tiny`` with a tiny
   word-level tokenizer beside it (standing in for the released GLM-5.3-Flash folder), and a JSONL
   corpus of text;
2. ``skyrl-kda run glm53_flash_tiny`` from those weights on 4 Ray CPU ranks (TP2 x CP2 +SP, EP2),
   stopped with SIGTERM after a few steps (it saves a checkpoint and exits 143);
3. the same command with ``--resume``, to the last step;
4. ``skyrl-kda export`` of the final checkpoint back to Hugging Face format;
5. (unless ``--skip-hf-check``) transformers loads the exported folder and scores a sentence.

Usage: ``python examples/finetune_1m/run_cpu.py WORKDIR [--steps 5] [--stop-after 2]``.
The last stdout line is a JSON summary (paths, the step the stop happened after, exit codes).
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

RECIPE = "glm53_flash_tiny"
WORDS = ("the a one two three red green blue small large cat dog bird fish tree river stone "
         "sees likes finds follows near under over and then").split()
SPECIALS = ("[PAD]", "[UNK]", "</s>")  # ids 0, 1, 2


def make_tokenizer(out: Path) -> None:
    """A word-level tokenizer over ``WORDS`` (a stand-in for GLM-5.3-Flash's tokenizer folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="</s>").save_pretrained(out)


def sentence(rng: random.Random) -> str:
    """Subject-verb-object sentences: a grammar a 4-layer model picks up in a few steps."""
    def noun_phrase() -> str:
        return " ".join([rng.choice(["the", "a", "one", "two", "three"]),
                         rng.choice(["red", "green", "blue", "small", "large"]),
                         rng.choice(["cat", "dog", "bird", "fish", "tree", "river", "stone"])])
    verb = rng.choice(["sees", "likes", "finds", "follows"])
    where = rng.choice(["near", "under", "over"])
    return f"{noun_phrase()} {verb} {noun_phrase()} {where} {noun_phrase()} and then"


def make_corpus(path: Path, documents: int = 300, seed: int = 0) -> None:
    """JSONL of ``{"text": ...}`` documents of 1 to 4 sentences (14 to 53 tokens with EOS).

    At most 64 tokens, the tiny recipe's DSA ``index_topk``, so its sparse attention keeps every
    key: with only 2 indexer heads many pool scores are exactly 0 and tie at the top-k boundary,
    where our DSA and transformers' break ties differently (tests/test_example.py compares the
    two, and docs/training.md says so)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            text = " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))
            f.write(json.dumps({"text": text}) + "\n")


def make_hf_checkpoint(out: Path, seed: int = 0, recipe: str = RECIPE) -> None:
    """A random glm5_next checkpoint with ``recipe``'s text model (the tiny one unless named; and
    a 1-block vision tower, as the released model has one), saved in the recipe's
    ``model.params_dtype``: transformers' own init, every tensor then nudged by noise so that no
    weight sits at a constant (norms at 1, biases at 0) a mapping could hide in."""
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from skyrl_megatron_kda.model.hf_io import hf_text_config
    from skyrl_megatron_kda.recipes import load_recipe

    model_recipe = load_recipe(recipe).recipe
    text = dict(hf_text_config(model_recipe), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16,
                  out_hidden_size=text["hidden_size"], projection_intermediate_size=16,
                  patch_size=2, temporal_patch_size=1)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for tensor in [*model.parameters(), *biases]:
            tensor.add_(0.05 * torch.randn(tensor.shape, generator=gen))
    model.to(getattr(torch, model_recipe.model.params_dtype)).save_pretrained(out)


def skyrl_kda(*args: str) -> list[str]:
    """The command line ``skyrl-kda ARGS`` with this interpreter (the venv's entry point)."""
    return [sys.executable, "-m", "skyrl_megatron_kda.cli", *args]


def train_command(hf_in: Path, corpus: Path, run_dir: Path, steps: int) -> list[str]:
    """``skyrl-kda run`` of the tiny recipe from ``hf_in``'s weights on ``corpus`` (text records,
    tokenized with the tokenizer in ``hf_in``)."""
    return skyrl_kda("run", RECIPE, "--set", f"run.init_from_hf={hf_in}",
                     "--set", f"data.path={corpus}", "--set", f"data.tokenizer_path={hf_in}",
                     "--set", f"run.output_dir={run_dir}", "--set", f"train.steps={steps}")


def show(cmd: list[str]) -> None:
    print("$ skyrl-kda " + " ".join(cmd[3:]), flush=True)


def metric_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for ln in path.read_text().splitlines() if ln.strip()) if path.exists() else 0


def run_until_stopped(cmd: list[str], run_dir: Path, stop_after: int, timeout_s: float) -> int:
    """Start the run, send SIGTERM once ``stop_after`` steps are in metrics.jsonl; its exit code."""
    show(cmd)
    proc = subprocess.Popen(cmd)
    deadline = time.time() + timeout_s
    while metric_lines(run_dir) < stop_after:
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (exit {proc.returncode}) before step {stop_after}")
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"no step {stop_after} within {timeout_s:.0f} s")
        time.sleep(0.2)
    print(f"--- SIGTERM after {metric_lines(run_dir)} steps in metrics.jsonl", flush=True)
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout_s)


def checked(cmd: list[str]) -> None:
    show(cmd)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(f"exit {rc}: {' '.join(cmd)}")


def check_in_transformers(hf_dir: Path) -> float:
    """The exported folder (weights and the copied tokenizer) in transformers: the loss of two
    corpus-like sentences."""
    import torch
    from transformers import AutoTokenizer
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = Glm5NextForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="eager")
    ids = torch.tensor([tok(sentence(random.Random(1)) + " " + sentence(random.Random(2)),
                            add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stop-after", type=int, default=2,
                        help="send SIGTERM once this many steps are done")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per command")
    parser.add_argument("--skip-hf-check", action="store_true",
                        help="do not load the export in transformers at the end")
    args = parser.parse_args(argv)
    if not 0 < args.stop_after < args.steps:
        parser.error("--stop-after must be between 1 and --steps - 1")

    # fla's kernels need a GPU: hidden from this process (the training runs in others) before
    # transformers is imported, so that glm5_next uses its torch path.
    sys.modules["fla"] = None
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    hf_in, corpus = work / "GLM-tiny-hf", work / "corpus.jsonl"
    run_dir, hf_out = work / "run", work / "GLM-tiny-finetuned-hf"
    for path in (run_dir, hf_out):
        if path.exists():
            raise SystemExit(f"{path} exists: use a fresh WORKDIR")
    print(f"--- weights and tokenizer {hf_in}, corpus {corpus}", flush=True)
    make_hf_checkpoint(hf_in)
    make_tokenizer(hf_in)  # as in a released model folder, the tokenizer sits beside the weights
    make_corpus(corpus)

    train = train_command(hf_in, corpus, run_dir, args.steps)
    stop_rc = run_until_stopped(train, run_dir, args.stop_after, args.timeout)
    stopped_at = metric_lines(run_dir)
    if stop_rc != 128 + signal.SIGTERM:
        raise SystemExit(f"the stopped run exited {stop_rc}, expected {128 + signal.SIGTERM}")
    checked([*train, "--resume"])
    checked(skyrl_kda("export", str(run_dir), "--out", str(hf_out)))
    summary = {"run_dir": str(run_dir), "hf_in": str(hf_in), "hf_out": str(hf_out),
               "corpus": str(corpus), "steps": args.steps,
               "stopped_at": stopped_at, "stop_exit_code": stop_rc}
    if not args.skip_hf_check:
        summary["transformers_loss"] = check_in_transformers(hf_out)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
