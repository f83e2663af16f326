"""The loader of a recipe's ``data`` section: the tokenizer, the record rules, the source and the
CP layout's padding."""

from __future__ import annotations

from collections.abc import Callable

from ...config import DataConfig, ParallelConfig
from ...distributed.cp_layout import LayoutName
from .loader import PackedLoader
from .packing import pad_multiple, row_multiple
from .records import RecordRules
from .sources import JsonlSource, Source, SyntheticSource, list_jsonl


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a local directory only (nothing is downloaded)."""
    from transformers import AutoTokenizer  # heavy import, only when text records need it

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """Text -> ids without BOS or other special tokens (documents are raw text; EOS is a policy)."""
    def encode(text: str) -> list[int]:
        # verbose=False: 1M-token documents exceed model_max_length by design.
        return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return encode


def _record_rules(data: DataConfig, vocab_size: int | None) -> RecordRules:
    """Tokenizer, EOS and vocabulary bound for the JSONL records."""
    encode: Callable[[str], list[int]] | None = None
    eos_id: int | None = None
    if data.tokenizer_path is not None:
        tokenizer = load_tokenizer(data.tokenizer_path)
        encode = _text_encoder(tokenizer)
        if data.append_eos:
            if tokenizer.eos_token_id is None:
                raise ValueError(f"data.append_eos=true but the tokenizer at {data.tokenizer_path!r} "
                                 "has no EOS token; set data.append_eos=false")
            eos_id = tokenizer.eos_token_id
        vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if vocab_size is None:
        raise ValueError("vocab_size is needed to check input_ids: pass the model's vocabulary size "
                         "or set data.tokenizer_path")
    return RecordRules(vocab_size=vocab_size, max_tokens=data.seq_len, encode=encode, eos_id=eos_id)


def build_loader(data: DataConfig, *, seed: int, parallel: ParallelConfig | None = None,
                 layout: LayoutName = "zigzag", vocab_size: int | None = None, pad_id: int = 0,
                 synthetic_documents: int = 1024) -> PackedLoader:
    """The loader for ``data``: JSONL at data.path, or synthetic documents when it is None.

    ``vocab_size`` bounds token ids (default: the tokenizer's size); padding follows the CP layout
    of ``parallel``, and seq_len must divide by ``row_multiple``.
    """
    parallel = parallel or ParallelConfig()
    multiple, row = pad_multiple(parallel, layout), row_multiple(parallel, layout)
    if data.seq_len % row:
        raise ValueError(f"data.seq_len={data.seq_len} must divide by {row} for the {layout} CP layout "
                         f"at cp={parallel.cp}, tp={parallel.tp}, "
                         f"sequence_parallel={parallel.sequence_parallel}")
    if data.path is None:
        if vocab_size is None:
            raise ValueError("synthetic data (data.path unset) needs vocab_size")
        source: Source = SyntheticSource(vocab_size=vocab_size, max_tokens=data.seq_len,
                                         num_documents=synthetic_documents, seed=seed)
    else:
        source = JsonlSource(list_jsonl(data.path), _record_rules(data, vocab_size), data.on_bad_record)
    return PackedLoader(source, seq_len=data.seq_len, pad_multiple=multiple,
                        shuffle_buffer=data.shuffle_buffer, seed=seed, pad_id=pad_id)
