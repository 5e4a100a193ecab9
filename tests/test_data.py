"""Data: tokenizers, readers, shards, the stdlib corpus and the deterministic DP sampler."""

import json

import numpy as np
import pytest
import torch

from meshtron.data import (
    BYTE_VOCAB,
    BPETokenizer,
    ByteTokenizer,
    DistributedBatchSampler,
    TokenDataset,
    build_data,
    build_token_corpus,
    build_tokenizer,
    epoch_permutation,
    list_text_files,
    load_stdlib_corpus,
    read_jsonl,
    read_text_files,
    read_token_shard,
    shard_info,
    split_micro_batches,
    stdlib_files,
    write_token_shard,
)

SAMPLE = ("The quick brown fox jumps over the lazy dog. 12345 - naïve café, 日本語, 🚀.\n"
          "def f(x):\n    return x * 2  # tabs\tand spaces\n")


def _one_line_value_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


# ---- tokenizers ----------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == BYTE_VOCAB == 259
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (256, 257, 258)
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == SAMPLE
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == SAMPLE  # specials dropped
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # truncated UTF-8 is replaced, not raised
    flat = tok.encode_documents(["ab", "c"])
    assert flat.dtype == np.uint16 and flat.tolist() == [97, 98, 257, 99, 257]
    with pytest.raises(ValueError):
        tok.decode([259])


def test_bpe_trains_round_trips_saves_and_is_deterministic(tmp_path):
    texts = [SAMPLE * 3, "import os\nimport sys\n" * 20, "hello world " * 50]
    tok = BPETokenizer.train(texts, vocab_size=300)
    assert BYTE_VOCAB <= tok.vocab_size <= 300
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    ids = tok.encode(SAMPLE)
    assert len(ids) < len(SAMPLE.encode("utf-8"))  # merges actually compress
    assert tok.decode(ids) == SAMPLE
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == SAMPLE
    flat = tok.encode_documents(["hello world", "import os"])
    assert flat.dtype == np.uint16 and (flat == tok.eos_id).sum() == 2
    # Same texts, same vocabulary: training is deterministic.
    assert BPETokenizer.train(texts, vocab_size=300).fingerprint == tok.fingerprint
    path = tok.save(tmp_path / "tok" / "bpe.json")
    loaded = build_tokenizer("bpe", path=path, vocab_size=tok.vocab_size)
    assert loaded.encode(SAMPLE) == ids and loaded.fingerprint == tok.fingerprint
    assert build_tokenizer("bpe", path=path, vocab_size=999).vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match="data.bpe_vocab=259"):
        build_tokenizer("bpe", path=path, vocab_size=259)
    with pytest.raises(ValueError, match="data.bpe_vocab=100"):
        BPETokenizer.train(texts, vocab_size=100)
    with pytest.raises(ValueError, match="data.tokenizer='wordpiece'") as exc:
        build_tokenizer("wordpiece")
    _one_line_value_error(exc)


# ---- readers -------------------------------------------------------------------------------

def test_text_files_directory_is_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zz")
    (tmp_path / "a.md").write_text("aa")
    (tmp_path / "b" / "skip.bin").write_bytes(b"\x00")
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / "empty.txt").write_text("")
    files = list_text_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.md", "b/z.txt", "empty.txt"]
    assert list(read_text_files(tmp_path)) == ["aa", "zz"]
    (tmp_path / "b" / "notes.log").write_text("log")
    assert list(read_text_files(tmp_path / "b" / "notes.log")) == ["log"]  # named: read
    with pytest.raises(ValueError, match=r"skip\.bin': not UTF-8 text \(UTF-16\?\): 1 NUL "
                                         r"byte \(100%\)"):
        list(read_text_files(tmp_path / "b" / "skip.bin"))  # read, and refused: not text


def test_jsonl_reader_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n{"body": "x", "text": ""}\n')
    assert list(read_jsonl(good)) == ["first", "second"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON") as exc:
        list(read_jsonl(bad))
    _one_line_value_error(exc)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"missing\.jsonl:2: no 'text' field"):
        list(read_jsonl(missing))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=r"wrong\.jsonl:1: field 'text' must be a string"):
        list(read_jsonl(wrong))
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")  # checked eagerly, not at first next()


@pytest.mark.parametrize("vocab,dtype", [(259, np.uint16), (65536, np.uint16), (70000, np.uint32)])
def test_token_shard_round_trip(tmp_path, vocab, dtype):
    ids = np.random.default_rng(0).integers(0, vocab, size=10_001)
    path = write_token_shard(tmp_path / "s.bin", ids, vocab, meta={"note": "t"})
    info = shard_info(path)
    assert info["vocab_size"] == vocab and info["num_tokens"] == ids.size
    assert info["dtype"] == np.dtype(dtype).name and info["meta"] == {"note": "t"}
    back = read_token_shard(path)
    assert isinstance(back, np.memmap) and back.dtype == dtype
    np.testing.assert_array_equal(back, ids)
    assert path.stat().st_size == ids.size * np.dtype(dtype).itemsize


def test_token_shard_errors(tmp_path):
    with pytest.raises(ValueError, match="outside vocab_size=259"):
        write_token_shard(tmp_path / "x.bin", [1, 2, 300], 259)
    path = write_token_shard(tmp_path / "s.bin", list(range(100)), 259)
    with open(path, "r+b") as fh:
        fh.truncate(50)
    with pytest.raises(ValueError, match="truncated"):
        read_token_shard(path)
    (tmp_path / "raw.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(ValueError, match="no sidecar"):
        read_token_shard(tmp_path / "raw.bin")


def test_build_data_from_shard_text_and_jsonl(tmp_path):
    tok = ByteTokenizer()
    docs = [f"document number {i}: " + "lorem ipsum " * (i % 7 + 3) for i in range(200)]
    shard = write_token_shard(tmp_path / "d.bin", tok.encode_documents(docs), tok.vocab_size)
    d = build_data(str(shard), seq_len=16, global_batch=4)
    x, y = d.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert d.info["train_tokens"] + d.info["eval_tokens"] == sum(len(s) + 1 for s in docs)

    (tmp_path / "docs").mkdir()
    for i, doc in enumerate(docs[:60]):
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(doc)
    d = build_data(str(tmp_path / "docs"), seq_len=16, global_batch=4)
    assert d.info["documents"] == 60 and d.info["eval_documents"] == 1

    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    d = build_data(str(jl), tokenizer="bpe", bpe_vocab=300, seq_len=16, global_batch=4)
    assert d.vocab_size <= 300 and d.info["eval_documents"] == 4
    x, _ = d.next_batch()
    assert int(x.max()) < d.vocab_size
    cache = tmp_path / "cache"
    first = build_data(str(jl), tokenizer="bpe", bpe_vocab=300, seq_len=16, global_batch=4,
                       cache_dir=cache)
    again = build_data(str(jl), tokenizer="bpe", bpe_vocab=300, seq_len=16, global_batch=4,
                       cache_dir=cache)
    assert not first.info["cached"] and again.info["cached"]
    assert again.tokenizer.fingerprint == first.tokenizer.fingerprint == d.tokenizer.fingerprint
    assert torch.equal(again.next_batch()[0], first.next_batch()[0])
    with pytest.raises(ValueError, match="data.tokenizer='byte'"):
        build_data(str(write_token_shard(tmp_path / "big.bin", [5], 4096)), seq_len=4,
                   global_batch=1)


# ---- stdlib corpus -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_stdlib_corpus(ByteTokenizer())


def test_stdlib_corpus_is_deterministic_and_nontrivial(stdlib_corpus, tmp_path):
    files = stdlib_files()
    rels = [rel for rel, _ in files]
    assert rels == sorted(rels) and len(rels) > 100
    assert not any(part in ("test", "tests", "site-packages", "__pycache__")
                   for rel in rels for part in rel.split("/"))
    assert not any(rel.rsplit("/", 1)[-1].startswith("_sysconfigdata") for rel in rels)
    c = stdlib_corpus
    assert len(c.train) > 1_000_000 and len(c.eval) > 10_000
    assert c.num_eval_documents >= 2 and c.vocab_size == 259
    assert int(c.train.max()) <= 257 and int((c.train == 257).sum()) == c.num_documents - \
        c.num_eval_documents
    again = load_stdlib_corpus(ByteTokenizer(), cache_dir=tmp_path)
    assert again.fingerprint == c.fingerprint
    np.testing.assert_array_equal(again.train, c.train)
    np.testing.assert_array_equal(again.eval, c.eval)
    cached = load_stdlib_corpus(ByteTokenizer(), cache_dir=tmp_path)
    assert cached.extra["cached"] and cached.fingerprint == c.fingerprint
    np.testing.assert_array_equal(cached.train, c.train)
    small = load_stdlib_corpus(ByteTokenizer(), max_bytes=200_000)
    assert small.fingerprint != c.fingerprint and len(small.train) < 200_000


def test_held_out_split_is_disjoint_by_document():
    docs = [f"doc{i} " * 5 for i in range(100)]
    c = build_token_corpus(docs, ByteTokenizer(), holdout_every=10)
    tok = ByteTokenizer()
    held = tok.decode(c.eval.tolist())
    assert held == "".join(docs[i] for i in range(9, 100, 10))
    assert c.num_eval_documents == 10
    single = build_token_corpus(["x" * 1000], tok, holdout_every=10)  # one document: token tail
    assert len(single.eval) == 100 and len(single.train) == 901


# ---- windows and sampler -------------------------------------------------------------------

def test_windows_shift_targets_and_cover_every_token():
    tokens = np.arange(101, dtype=np.uint16)
    ds = TokenDataset(tokens, seq_len=10)
    assert len(ds) == 10
    x, y = ds.batch([0, 9])
    assert x[0].tolist() == list(range(10)) and y[0].tolist() == list(range(1, 11))
    assert x[1].tolist() == list(range(90, 100)) and y[1].tolist() == list(range(91, 101))
    assert x.is_contiguous() and y.is_contiguous()
    with pytest.raises(ValueError, match="data.seq_len=200"):
        TokenDataset(tokens, seq_len=200)


def test_permutation_is_pinned_and_changes_per_epoch():
    # Golden values: the order must never change across machines or numpy versions.
    assert epoch_permutation(10, 0, 0).tolist() == [3, 1, 8, 0, 4, 7, 5, 2, 6, 9]
    assert epoch_permutation(10, 0, 1).tolist() == [5, 3, 8, 6, 9, 4, 1, 2, 0, 7]
    assert epoch_permutation(10, 7, 0).tolist() == [1, 4, 6, 7, 2, 8, 3, 0, 9, 5]
    s = DistributedBatchSampler(num_windows=50, global_batch=10, seed=3)
    epochs = [np.concatenate([s.global_indices(k) for k in range(5 * e, 5 * e + 5)])
              for e in range(3)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(50))  # each epoch visits every window once
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    other = DistributedBatchSampler(num_windows=50, global_batch=10, seed=4)
    assert not np.array_equal(other.global_indices(0), s.global_indices(0))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_union_equals_single_process_batch(dp):
    # 37 windows, batch 8: steps straddle epoch boundaries (37 is prime to 8).
    ref = DistributedBatchSampler(num_windows=37, global_batch=8, seed=11)
    ranks = [DistributedBatchSampler(37, 8, seed=11, dp_rank=r, dp_size=dp) for r in range(dp)]
    for step in range(12):
        want = ref.next_indices()
        got = np.concatenate([s.next_indices() for s in ranks])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, ref.global_indices(step))


def test_dp_union_through_build_data():
    ref = build_data(seq_len=32, global_batch=8, seed=5, max_bytes=300_000)
    for dp in (2, 4):
        ranks = [build_data(seq_len=32, global_batch=8, seed=5, dp_rank=r, dp_size=dp,
                            max_bytes=300_000) for r in range(dp)]
        assert all(d.local_batch == 8 // dp for d in ranks)
        for step in range(3):
            gx, gy = ref.train.global_batch_at(step)
            parts = [d.next_batch() for d in ranks]
            assert torch.equal(torch.cat([p[0] for p in parts]), gx)
            assert torch.equal(torch.cat([p[1] for p in parts]), gy)
        for j in range(len(ref.eval)):
            ex, ey = ref.eval[j]
            assert torch.equal(torch.cat([d.eval[j][0] for d in ranks]), ex)
            assert torch.equal(torch.cat([d.eval[j][1] for d in ranks]), ey)


def test_state_dict_resume_gives_identical_batches():
    d = build_data(seq_len=16, global_batch=4, seed=2, max_bytes=50_000)
    for _ in range(3):
        d.next_batch()
    state = d.state_dict()
    assert set(state) >= {"epoch", "step", "seed"} and state["step"] == 3
    json.dumps(state)  # small and JSON-able
    expected = [d.next_batch() for _ in range(5)]

    fresh = build_data(seq_len=16, global_batch=4, seed=999, max_bytes=50_000)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # the saved seed wins
    for want in expected:
        got = fresh.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    # Resume under a different dp size: the ranks' union continues the same stream.
    halves = [build_data(seq_len=16, global_batch=4, seed=2, dp_rank=r, dp_size=2,
                         max_bytes=50_000) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    for want in expected:
        got = torch.cat([h.next_batch()[0] for h in halves])
        assert torch.equal(got, want[0])

    other = build_data(seq_len=8, global_batch=4, max_bytes=50_000)
    with pytest.raises(ValueError, match="num_windows"):
        other.load_state_dict(state)


def test_resume_across_epochs():
    s = DistributedBatchSampler(num_windows=13, global_batch=4, seed=1)
    for _ in range(7):  # 28 samples: into epoch 2
        s.next_indices()
    state = s.state_dict()
    assert state["epoch"] == 2
    want = [s.next_indices() for _ in range(5)]
    t = DistributedBatchSampler(num_windows=13, global_batch=4, seed=1)
    t.load_state_dict(state)
    for w in want:
        np.testing.assert_array_equal(t.next_indices(), w)


def test_micro_batches_and_eval_are_deterministic():
    d = build_data(seq_len=16, global_batch=8, dp_rank=1, dp_size=2, max_bytes=50_000,
                   eval_batches=3)
    x, y = d.next_batch()
    micro = split_micro_batches(x, y, micro_batch=2)
    assert len(micro) == 2 and torch.equal(torch.cat([m[0] for m in micro]), x)
    assert torch.equal(torch.cat([m[1] for m in micro]), y)
    with pytest.raises(ValueError, match="data.micro_batch=3"):
        split_micro_batches(x, y, micro_batch=3)
    ev1, ev2 = d.eval_batches(), list(d.eval)
    assert len(ev1) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(ev1, ev2))
    assert ev1[0][0].shape == (4, 16)
    train, evals = d  # unpacks as (train loader, eval batches)
    assert train is d.train and evals is d.eval


# ---- user errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    ({"source": "/no/such/place.txt"}, "data.source='/no/such/place.txt': does not exist"),
    ({"global_batch": 6, "dp_size": 4}, "data.global_batch=6: must be divisible by dp_size=4"),
    ({"dp_rank": 2, "dp_size": 2}, "dp_rank=2: must be in 0..1"),
    ({"tokenizer": "wordpiece"}, "data.tokenizer='wordpiece'"),
    ({"seq_len": 0}, "data.seq_len=0"),
    ({"seed": -1}, "train.seed=-1"),
    ({"tokenizer": "bpe"}, "data.bpe_vocab=None"),
    ({"max_bytes": 10_000, "seq_len": 4096}, "data.seq_len=4096"),
])
def test_user_errors_are_one_line_value_errors(kwargs, needle):
    args = {"max_bytes": 100_000, **kwargs}
    with pytest.raises(ValueError) as exc:
        build_data(**args)
    assert needle in _one_line_value_error(exc)
