"""The data pipeline: records -> documents, packing invariants, order, CP/SP split, resume.

Everything runs on CPU in a temporary directory; the tokenizer is a tiny WordLevel model built
here and loaded back from its local directory (nothing is downloaded).
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch

from skyrl_megatron_kda.config import DataConfig, ParallelConfig
from skyrl_megatron_kda.distributed.rank_split import shard_for_rank
from skyrl_megatron_kda.train.data import build_loader
from skyrl_megatron_kda.train.data.packing import pack_row, pad_multiple, row_multiple
from skyrl_megatron_kda.train.data.records import BadRecord, RecordRules
from skyrl_megatron_kda.train.data.sources import JsonlSource, SyntheticSource
from skyrl_megatron_kda.train.data.stats import UNRECORDED_FILE, DataStats, skip_summary

WORDS = "the quick brown fox jumps over lazy dog a long document about packing rows".split()
VOCAB = 64  # vocabulary bound for input_ids records


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   eos_token="</s>")
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return str(out)


def write_jsonl(path: Path, lines: list) -> Path:
    """Each item: a dict (dumped as JSON) or raw bytes (written as they are)."""
    with open(path, "wb") as f:
        for item in lines:
            f.write(item if isinstance(item, bytes) else json.dumps(item).encode())
            f.write(b"\n")
    return path


def docs_of(lengths, start=3):
    return [{"input_ids": [(start + i + j) % VOCAB for j in range(n)]} for i, n in enumerate(lengths)]


def take(loader, n):
    return [loader.next_row() for _ in range(n)]


def assert_rows_equal(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for name in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens",
                     "cu_seqlens_unpadded"):
            assert torch.equal(getattr(ra, name), getattr(rb, name)), name


# ------------------------------------------------------------------------------------------
# Packing invariants


def check_row(row, seq_len, multiple, pad_id=0):
    """Every invariant a packed row must keep, from its own tensors."""
    assert row.tokens.shape == row.labels.shape == row.loss_mask.shape == (seq_len,)
    cu, real = row.cu_seqlens.long(), row.cu_seqlens_unpadded.long()
    assert row.cu_seqlens.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == seq_len
    assert bool((cu.diff() > 0).all()), "no empty sequences"
    assert bool((cu.diff() % multiple == 0).all()), f"lengths {cu.diff().tolist()} vs {multiple}"
    assert real.shape == cu.shape and int(real[0]) == 0
    for s, e, n in zip(cu[:-1].tolist(), cu[1:].tolist(), real.diff().tolist()):
        r = s + n
        assert s <= r <= e
        if r > s:  # a document: next-token labels inside it, nothing across its end
            assert torch.equal(row.labels[s:r - 1], row.tokens[s + 1:r])
            assert bool((row.loss_mask[s:r - 1] == 1).all())
        assert bool((row.loss_mask[max(r - 1, s):e] == 0).all()), "last token and padding masked"
        assert bool((row.tokens[r:e] == pad_id).all()) and bool((row.labels[r:e] == pad_id).all())
        assert torch.equal(row.position_ids[s:e], torch.arange(e - s))


@pytest.mark.parametrize("multiple", [1, 4, 8])
def test_pack_row_invariants(multiple):
    docs = [torch.arange(1, 6), torch.arange(10, 13), torch.tensor([7])]  # 5, 3, 1 tokens
    row = pack_row(docs, seq_len=32, multiple=multiple)
    check_row(row, 32, multiple)
    assert row.num_documents == 3
    # The tail is one padding sequence after the documents.
    used = sum(-(-len(d) // multiple) * multiple for d in docs)
    assert int(row.cu_seqlens[-2]) == used and row.cu_seqlens_unpadded.tolist() == [0, 5, 8, 9, 9]


def test_pack_row_exact_fit_has_no_tail():
    row = pack_row([torch.arange(1, 5), torch.arange(1, 5)], seq_len=8, multiple=4)
    assert row.cu_seqlens.tolist() == [0, 4, 8]
    assert row.loss_mask.tolist() == [1, 1, 1, 0, 1, 1, 1, 0]


def test_loader_rows_keep_invariants_and_every_document(tmp_path):
    lengths = [5, 17, 3, 30, 1, 8, 12, 2, 29, 7, 16, 4]
    path = write_jsonl(tmp_path / "a.jsonl", docs_of(lengths))
    data = DataConfig(seq_len=32, path=str(path), shuffle_buffer=1)
    loader = build_loader(data, seed=0, parallel=ParallelConfig(cp=2), vocab_size=VOCAB)
    rows = take(loader, 8)
    for row in rows:
        check_row(row, 32, 4)
    # shuffle_buffer=1 keeps file order; greedy packing keeps it too: the documents read back in
    # order, each whole, proves none was cut or dropped.
    seen = [row.tokens[s:s + n].tolist() for row in rows
            for s, n in zip(row.cu_seqlens[:-1].tolist(), row.cu_seqlens_unpadded.diff().tolist()) if n]
    expected = [d["input_ids"] for d in docs_of(lengths)]
    assert seen[:len(expected)] == expected
    assert loader.stats.epochs_completed >= 1


def test_pad_multiple_and_row_multiple():
    assert pad_multiple(ParallelConfig(cp=1)) == 1
    assert pad_multiple(ParallelConfig(cp=2)) == 4
    assert pad_multiple(ParallelConfig(cp=4, tp=2, sequence_parallel=True)) == 8
    assert pad_multiple(ParallelConfig(cp=2), "contiguous") == 1
    assert row_multiple(ParallelConfig(cp=2, tp=4, sequence_parallel=True)) == 8
    assert row_multiple(ParallelConfig(cp=2, tp=3, sequence_parallel=True)) == 12
    assert row_multiple(ParallelConfig(cp=2, tp=2, sequence_parallel=True), "contiguous") == 4
    with pytest.raises(ValueError, match="must divide by 8"):
        build_loader(DataConfig(seq_len=20), seed=0, vocab_size=VOCAB,
                     parallel=ParallelConfig(cp=2, tp=4, sequence_parallel=True))


# ------------------------------------------------------------------------------------------
# Order


def synthetic_loader(seed, buffer=16):
    return build_loader(DataConfig(seq_len=64, shuffle_buffer=buffer), seed=seed, vocab_size=VOCAB,
                        parallel=ParallelConfig(cp=2), synthetic_documents=40)


def test_same_seed_same_rows_other_seed_other_rows():
    a, b, c = (take(synthetic_loader(s), 6) for s in (1, 1, 2))
    assert_rows_equal(a, b)
    assert any(not torch.equal(x.tokens, y.tokens) for x, y in zip(a, c))
    for row in a:
        check_row(row, 64, 4)


def test_shuffle_seed_changes_order_of_same_documents(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", docs_of([3] * 40))

    def first_tokens(seed):
        loader = build_loader(DataConfig(seq_len=4, path=str(path), shuffle_buffer=8), seed=seed,
                              vocab_size=VOCAB)
        return [row.tokens[:3].tolist() for row in take(loader, 40)]

    one, again, other = first_tokens(0), first_tokens(0), first_tokens(1)
    assert one == again and one != other
    assert sorted(one) == sorted(other) == sorted(d["input_ids"] for d in docs_of([3] * 40))


# ------------------------------------------------------------------------------------------
# Records


def test_text_and_input_ids_records(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "the quick brown fox"},
                                               {"input_ids": [3, 4, 5]}, {"text": "lazy dog"}])
    data = DataConfig(seq_len=8, path=str(path), tokenizer_path=tokenizer_dir, shuffle_buffer=1)
    loader = build_loader(data, seed=0)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    eos = tok.eos_token_id
    fox = tok("the quick brown fox", add_special_tokens=False)["input_ids"]
    assert len(fox) == 4 and tok.unk_token_id not in fox
    rows = take(loader, 2)
    assert rows[0].tokens[:5].tolist() == fox + [eos]
    assert rows[0].tokens[5:8].tolist() == [3, 4, 5]  # input_ids taken as given: no EOS
    dog = tok("lazy dog", add_special_tokens=False)["input_ids"]
    assert rows[1].tokens[:3].tolist() == dog + [eos]


def test_append_eos_off(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "the dog"}])
    data = DataConfig(seq_len=3, path=str(path), tokenizer_path=tokenizer_dir, append_eos=False)
    row = build_loader(data, seed=0).next_row()
    assert row.cu_seqlens_unpadded.tolist() == [0, 2, 2]


def test_text_without_tokenizer_is_a_config_error(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}])
    loader = build_loader(DataConfig(seq_len=8, path=str(path), on_bad_record="skip"), seed=0,
                          vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"a\.jsonl:1: .*tokenizer_path is not set"):
        loader.next_row()


def test_directory_of_jsonl_read_in_name_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [2, 2]}])
    write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 1]}])
    (tmp_path / "notes.txt").write_text("not data")
    loader = build_loader(DataConfig(seq_len=2, path=str(tmp_path), shuffle_buffer=1), seed=0,
                          vocab_size=VOCAB)
    assert [r.tokens.tolist() for r in take(loader, 2)] == [[1, 1], [2, 2]]


BAD = {
    # kind: (raw line, words the message must carry)
    "invalid_json": (b'{"input_ids": [1, 2', "not valid JSON"),
    "non_utf8": (b'{"text": "caf\xe9"}', "not valid UTF-8"),
    "empty_text": (b'{"text": ""}', '"text" is empty'),
    "empty_input_ids": (b'{"input_ids": []}', '"input_ids" is empty'),
    "text_not_string": (b'{"text": 5}', '"text" is a int, expected a string'),
    "ids_not_list": (b'{"input_ids": "1 2"}', '"input_ids" is a str'),
    "ids_not_ints": (b'{"input_ids": [1, 2.5]}', '"input_ids"[1] is a float'),
    "ids_bool": (b'{"input_ids": [1, true]}', '"input_ids"[1] is a bool'),
    "not_object": (b"[1, 2]", "record is a JSON list"),
    "no_key": (b'{"content": "x"}', 'exactly one of "text" or "input_ids"'),
    "id_too_big": (b'{"input_ids": [1, 64]}', "token id 64 at index 1 is outside [0, 64)"),
    "id_negative": (b'{"input_ids": [-1]}', "token id -1 at index 0 is outside [0, 64)"),
    "too_long": (b'{"input_ids": [1, 1, 1, 1, 1, 1, 1, 1, 1]}', "9 tokens, more than one sequence"),
}
KIND = {"invalid_json": "invalid_json", "non_utf8": "non_utf8", "empty_text": "empty",
        "empty_input_ids": "empty", "text_not_string": "wrong_type", "ids_not_list": "wrong_type",
        "ids_not_ints": "wrong_type", "ids_bool": "wrong_type", "not_object": "wrong_type",
        "no_key": "wrong_type", "id_too_big": "token_out_of_range",
        "id_negative": "token_out_of_range", "too_long": "too_long"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_record_stops_with_file_line_and_reason(tmp_path, tokenizer_dir, case):
    raw, words = BAD[case]
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"input_ids": [1, 2]}, b"", raw, {"input_ids": [3]}])
    data = DataConfig(seq_len=8, path=str(path), tokenizer_path=tokenizer_dir, on_bad_record="stop")
    loader = build_loader(data, seed=0, vocab_size=VOCAB)
    with pytest.raises(BadRecord) as err:
        loader.next_row()
    message = str(err.value)
    assert message.startswith(f"{path}:3: {KIND[case]}: "), message
    assert words in message, message
    assert (err.value.file, err.value.line, err.value.kind) == (str(path), 3, KIND[case])


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_record_skipped_and_counted(tmp_path, tokenizer_dir, case):
    raw, _ = BAD[case]
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"input_ids": [1, 2]}, raw, {"input_ids": [3]}])
    data = DataConfig(seq_len=3, path=str(path), tokenizer_path=tokenizer_dir, on_bad_record="skip",
                      shuffle_buffer=1)
    loader = build_loader(data, seed=0, vocab_size=VOCAB)
    row = loader.next_row()
    assert row.tokens[:3].tolist() == [1, 2, 3]
    assert loader.stats.skipped == {str(path): {KIND[case]: 1}}


def test_skip_counts_every_reason_and_logs_the_pass(tmp_path, caplog):
    lines = [{"input_ids": [1]}, *(BAD[c][0] for c in sorted(BAD)), b"   "]
    path = write_jsonl(tmp_path / "corpus.jsonl", lines)
    loader = build_loader(DataConfig(seq_len=8, path=str(path), on_bad_record="skip"), seed=0,
                          vocab_size=VOCAB)
    per_pass: dict[str, int] = {}
    for case in BAD:
        per_pass[KIND[case]] = per_pass.get(KIND[case], 0) + 1
    with caplog.at_level("WARNING", logger="skyrl_megatron_kda.train.data"):
        row = loader.next_row()  # eight one-token documents, one per pass
    assert torch.equal(row.tokens, torch.ones(8, dtype=torch.long))
    # Seven passes are over; the buffer (1024 documents) has read the eighth ahead of its draw.
    assert loader.stats.epochs_completed == 7 and loader.stats.blank_lines == 8
    assert loader.stats.skipped == {str(path): {k: 8 * v for k, v in per_pass.items()}}
    pass_logs = [r.message for r in caplog.records if "end of pass" in r.message]
    assert len(pass_logs) == 7 and f"skipped 13 bad records ({path}: " in pass_logs[0], pass_logs[0]


def test_skips_are_counted_per_file_and_reason(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1]}, b"{bad", b"{bad"])
    b = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [999]}, b"{bad", {"input_ids": [2]}])
    loader = build_loader(DataConfig(seq_len=2, path=str(tmp_path), on_bad_record="skip",
                                     shuffle_buffer=1), seed=0, vocab_size=VOCAB)
    assert loader.next_row().tokens.tolist() == [1, 2]  # one pass, nothing read ahead
    assert loader.stats.skipped == {str(a): {"invalid_json": 2},
                                    str(b): {"invalid_json": 1, "token_out_of_range": 1}}
    assert loader.stats.skipped_by_reason() == {"invalid_json": 3, "token_out_of_range": 1}
    assert skip_summary(loader.stats.skipped) == (
        f"skipped 4 bad records ({a}: invalid_json=2; {b}: invalid_json=1, token_out_of_range=1)")
    restored = DataStats.from_state_dict(loader.state_dict()["stats"])
    assert restored == loader.stats


def test_skip_counts_saved_by_reason_only_still_load():
    """A loader state saved before skips were counted per file keeps its counts, marked."""
    state = {**DataStats().state_dict(), "skipped": {"invalid_json": 2}}
    assert DataStats.from_state_dict(state).skipped == {UNRECORDED_FILE: {"invalid_json": 2}}


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_utf8_bom_keeps_the_first_record(tmp_path, policy):
    """A file that starts with a UTF-8 byte order mark (Windows editors write one) keeps its first
    record, also when a resumed loader re-reads it by reference."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"input_ids": [1, 2]}\n{"input_ids": [3]}\n')
    data = DataConfig(seq_len=3, path=str(path), on_bad_record=policy, shuffle_buffer=1)
    loader = build_loader(data, seed=0, vocab_size=VOCAB)
    assert loader.next_row().tokens[:3].tolist() == [1, 2, 3]
    assert loader.stats.skipped == {}
    source = loader.source
    assert source.fetch((0, 1, 0)).tokens.tolist() == [1, 2]


def test_corpus_of_only_bad_records_raises_instead_of_spinning(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [b"{", b"[]"])
    loader = build_loader(DataConfig(seq_len=8, path=str(path), on_bad_record="skip"), seed=0,
                          vocab_size=VOCAB)
    with pytest.raises(ValueError, match="no usable documents.*skipped 2"):
        loader.next_row()


# ------------------------------------------------------------------------------------------
# Streaming


def test_reader_is_lazy_line_by_line(tmp_path):
    """Reading the first document of a ~16 MB corpus touches only its first lines and allocates a
    tiny fraction of the file; a later bad line is not even seen."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"input_ids": list(range(1, 60))}).encode() + b"\n"
    with open(path, "wb") as f:
        f.write(line * 80_000)
        f.write(b"{broken\n")
    size = path.stat().st_size
    assert size > 15e6
    source = JsonlSource([path], RecordRules(vocab_size=VOCAB, max_tokens=64))
    stats = DataStats()
    tracemalloc.start()
    reader = source.read(source.start(), stats)
    doc, position = next(reader)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert doc.tokens.tolist() == list(range(1, 60))
    assert position == (0, 2, len(line))
    assert peak < 1e6, f"peak {peak} bytes reading one line of a {size}-byte file"
    # Seeking: a reader started at a later position begins exactly there.
    later = next(source.read((0, 1001, 1000 * len(line)), stats))
    assert later[0].ref == (0, 1001, 1000 * len(line))


# ------------------------------------------------------------------------------------------
# CP / SP split


SPLITS = [
    # (layout, tp, sequence_parallel)
    ("zigzag", 1, False),      # plain CP2
    ("zigzag", 2, False),      # TP2 without SP: every TP rank holds the whole CP shard
    ("zigzag", 2, True),       # TP2 + SP: hidden rows are SP slices of the CP shard
    ("contiguous", 1, False),
    ("contiguous", 2, True),
]


@pytest.mark.parametrize("layout,tp,sp", SPLITS, ids=[f"{l}-tp{t}-sp{int(s)}" for l, t, s in SPLITS])
def test_cp_split_reassembles_the_row(layout, tp, sp):
    cp = 2
    parallel = ParallelConfig(cp=cp, tp=tp, sequence_parallel=sp)
    seq_len = 32
    assert seq_len % row_multiple(parallel, layout) == 0
    docs = [torch.arange(1, 12), torch.arange(20, 23), torch.arange(30, 37)]  # 11, 3, 7 tokens
    row = pack_row(docs, seq_len, pad_multiple(parallel, layout))
    check_row(row, seq_len, pad_multiple(parallel, layout))
    tokens = torch.full((seq_len,), -1, dtype=torch.long)
    labels, mask = tokens.clone(), torch.full((seq_len,), -1.0)
    hidden_owner = torch.zeros(seq_len, dtype=torch.long)
    for c in range(cp):
        shards = [shard_for_rank(row, cp, c, tp, t, sp, layout) for t in range(tp)]
        for s in shards:  # model inputs: the CP shard, the same on every TP rank
            assert torch.equal(s.tokens, shards[0].tokens) and torch.equal(s.cu_seqlens, row.cu_seqlens)
        s = shards[0]
        assert s.tokens.numel() == seq_len // cp
        tokens[s.positions], labels[s.positions], mask[s.positions] = s.tokens, s.labels, s.loss_mask
        for t, s in enumerate(shards):
            hidden_owner[s.hidden_positions] += 1
            if sp:
                assert torch.equal(s.hidden_positions, s.positions.chunk(tp)[t])
            else:
                assert torch.equal(s.hidden_positions, s.positions)
    assert torch.equal(tokens, row.tokens) and torch.equal(labels, row.labels)
    assert torch.equal(mask, row.loss_mask)
    # Hidden rows: under SP every natural row lives on exactly one (cp, tp) rank.
    assert bool((hidden_owner == (1 if sp else tp)).all())


def test_zigzag_split_matches_megatron_chunks():
    row = pack_row([torch.arange(1, 9)], seq_len=8, multiple=4)  # one sequence, 4 chunks of 2
    assert shard_for_rank(row, 2, 0).positions.tolist() == [0, 1, 6, 7]
    assert shard_for_rank(row, 2, 1).positions.tolist() == [2, 3, 4, 5]


def test_sp_hidden_rows_are_the_cp_rows_then_the_tp_slice():
    # One 8-token sequence, cp=2, tp=2 with SP: zigzag gives CP rank 0 rows [0,1,6,7] and rank 1
    # [2,3,4,5]; each TP rank's hidden states hold its contiguous half of them.
    row = pack_row([torch.arange(1, 9)], seq_len=8, multiple=4)
    cp_rows = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    hidden_rows = {(0, 0): [0, 1], (0, 1): [6, 7], (1, 0): [2, 3], (1, 1): [4, 5]}
    for (c, t), rows in hidden_rows.items():
        shard = shard_for_rank(row, 2, c, 2, t, True, "zigzag")
        assert shard.hidden_positions.tolist() == rows
        assert shard.positions.tolist() == cp_rows[c]  # tokens: the whole CP shard on every TP rank


# ------------------------------------------------------------------------------------------
# Resume


def resume_case(make_loader, warmup, after):
    """Rows ``warmup..warmup+after`` from one loader equal those of a fresh loader resumed from
    the first's state after ``warmup`` rows (state passed through JSON: plain types only)."""
    straight = make_loader()
    take(straight, warmup)
    state = json.loads(json.dumps(straight.state_dict()))
    expected = take(straight, after)
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert_rows_equal(take(resumed, after), expected)
    assert resumed.stats == straight.stats
    return state, straight


@pytest.mark.parametrize("warmup", [1, 5, 13])
def test_resume_jsonl_mid_stream(tmp_path, warmup):
    lengths = [(7 * i) % 23 + 1 for i in range(30)]
    lines = docs_of(lengths)
    lines.insert(4, b"{bad")
    lines.insert(11, {"input_ids": [999]})
    write_jsonl(tmp_path / "a.jsonl", lines[:15])
    write_jsonl(tmp_path / "b.jsonl", lines[15:])
    data = DataConfig(seq_len=24, path=str(tmp_path), shuffle_buffer=6, on_bad_record="skip")
    state, loader = resume_case(
        lambda: build_loader(data, seed=3, parallel=ParallelConfig(cp=2), vocab_size=VOCAB),
        warmup, after=12)
    assert state["buffer"], "resumed with documents waiting in the shuffle buffer"
    passes = loader.stats.epochs_completed + 1
    assert loader.stats.skipped_by_reason() == {"invalid_json": passes,
                                                "token_out_of_range": passes}
    if warmup == 13:
        assert state["stats"]["epochs_completed"] == 0 and loader.stats.epochs_completed == 1


def test_resume_synthetic():
    resume_case(lambda: synthetic_loader(seed=5, buffer=4), warmup=7, after=10)


def test_resume_refuses_another_seed():
    state = synthetic_loader(seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this loader has 2"):
        synthetic_loader(seed=2).load_state_dict(state)


def test_synthetic_documents_fit_and_cover_lengths():
    source = SyntheticSource(vocab_size=VOCAB, max_tokens=64, num_documents=200, seed=0)
    lengths = [len(source.fetch((i,)).tokens) for i in range(200)]
    assert min(lengths) >= 1 and max(lengths) <= 64
    assert min(lengths) < 8 and max(lengths) > 32
    assert torch.equal(source.fetch((3,)).tokens, source.fetch((3,)).tokens)


def test_loader_is_an_endless_iterator():
    rows = []
    for row in synthetic_loader(seed=0):  # 40 documents per pass; 30 rows run past the first
        rows.append(row)
        if len(rows) == 30:
            break
    assert_rows_equal(rows, take(synthetic_loader(seed=0), 30))


def test_synthetic_documents_have_structure_to_learn():
    # Each document repeats a short motif from a small alphabet: a trainer's loss can fall on it.
    source = SyntheticSource(vocab_size=VOCAB, max_tokens=64, num_documents=50, seed=0)
    for i in range(50):
        tokens = source.fetch((i,)).tokens
        assert int(tokens.max()) < SyntheticSource.ALPHABET
        period = next(p for p in range(2, 9) if len(tokens) <= p or torch.equal(tokens[p:], tokens[:-p]))
        assert period <= 8
