"""Data pipeline: nothing lost or duplicated, cache reuse, padding vs drop-last, order, errors.

The reference for every packing test is the token stream built directly here: each non-empty
document tokenized on its own, followed by EOS, concatenated in corpus order.
"""
import json
import os
import random
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import generated_words
from datasets import Dataset
from helpers import load_script
from transformers import PreTrainedTokenizerFast

from ulysses_train.data import corpus as data
from ulysses_train.data import packing
from ulysses_train.data.corpus import (DataError, build_packed_dataset, prepare_or_wait, resolve_source, sample_order,
                                       tokenizer_identity)
from ulysses_train.data.form import DataForm

SEQ = 512
EOS, PAD = 1, 2  # ids in the conftest tokenizer


def make_documents(seed=0, count=24) -> list[str]:
    """Varied lengths (empty, a few words, several sequences long), newlines, non-ASCII."""
    rng = random.Random(seed)
    words = generated_words()
    documents = []
    for i in range(count):
        n_words = rng.choice([0, 3, 40, 300, 1500]) if i else 2000
        text = " ".join(rng.choice(words) for _ in range(n_words))
        if i % 5 == 2:
            text += "\nNouvelle ligne — café, naïve, 東京, 🙂"
        documents.append(text)
    documents[3] = ""  # an empty document must be skipped, not turned into a lone EOS
    return documents


DOCUMENTS = make_documents()


def expected_stream(tokenizer, documents) -> np.ndarray:
    pieces = []
    for text in documents:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids:
            pieces.extend(ids + [tokenizer.eos_token_id])
    return np.array(pieces)


def unpadded_stream(dataset) -> np.ndarray:
    """All rows in storage order, padding positions (labels -100) removed."""
    ids = np.stack([row["input_ids"] for row in dataset])
    labels = np.stack([row["labels"] for row in dataset])
    return ids[labels != -100]


def write_corpus(folder: Path, kind: str, documents=DOCUMENTS, field="body") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "text":
        for i, text in enumerate(documents):
            (folder / f"doc_{i:03d}.txt").write_text(text, encoding="utf-8")
        return folder
    if kind == "jsonl":  # two files: documents keep their order across files
        half = len(documents) // 2
        for name, part in (("a.jsonl", documents[:half]), ("b.jsonl", documents[half:])):
            lines = [json.dumps({field: text, "id": i}) for i, text in enumerate(part)]
            (folder / name).write_text("\n".join(lines) + "\n")
        return folder
    if kind == "parquet":
        path = folder / "corpus.parquet"
        pq.write_table(pa.table({field: documents}), path)
        return path
    if kind == "saved":
        Dataset.from_dict({field: documents}).save_to_disk(str(folder / "saved"))
        return folder / "saved"
    raise AssertionError(kind)


def build(source, tokenizer, tmp_path, text_field="body", drop_last=False, **options):
    options.setdefault("cache_dir", tmp_path / "cache")
    options.setdefault("form", DataForm(text_field=text_field, drop_last=drop_last))
    seq_length = options.pop("seq_length", SEQ)
    return build_packed_dataset(source, tokenizer, seq_length, **options)


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "saved"])
def test_every_token_once_in_order(kind, bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "corpus", kind)
    dataset, summary = build(source, bpe_tokenizer, tmp_path, text_field="body")
    expected = expected_stream(bpe_tokenizer, DOCUMENTS)

    np.testing.assert_array_equal(unpadded_stream(dataset), expected)
    assert all(len(row["input_ids"]) == SEQ == len(row["labels"]) for row in dataset)
    non_empty = sum(1 for text in DOCUMENTS if text)
    assert summary.documents == non_empty
    assert summary.empty_documents == len(DOCUMENTS) - non_empty
    assert summary.document_tokens + summary.separator_tokens == len(expected)
    assert summary.sequences == len(dataset) == -(-len(expected) // SEQ)
    assert summary.padding_tokens == summary.sequences * SEQ - len(expected)
    assert summary.padding_share == pytest.approx(summary.padding_tokens / (summary.sequences * SEQ))
    assert not summary.reused


@pytest.mark.parametrize("seq_length", [64, 4096])
def test_batch_boundaries_do_not_matter(seq_length, bpe_tokenizer, tmp_path, monkeypatch):
    """Small batches: rows that span several batches (4096) and batches that fill several rows (64)."""
    monkeypatch.setattr(packing, "PACK_BATCH_DOCUMENTS", 5)
    monkeypatch.setattr(data, "TOKENIZE_BATCH_DOCUMENTS", 3)
    source = write_corpus(tmp_path / "c", "text")
    dataset, _ = build(source, bpe_tokenizer, tmp_path, seq_length=seq_length)
    np.testing.assert_array_equal(unpadded_stream(dataset), expected_stream(bpe_tokenizer, DOCUMENTS))


def test_labels_equal_ids_except_padding(bpe_tokenizer, tmp_path):
    dataset, summary = build(write_corpus(tmp_path / "c", "text"), bpe_tokenizer, tmp_path)
    assert summary.padding_tokens > 0
    ids = np.stack(dataset["input_ids"])
    labels = np.stack(dataset["labels"])
    padded = labels == -100
    np.testing.assert_array_equal(ids[~padded], labels[~padded])
    assert padded.sum() == summary.padding_tokens
    assert padded[:-1].sum() == 0 and padded[-1, -summary.padding_tokens :].all()
    assert (ids[padded] == PAD).all()


def test_drop_last_drops_only_the_tail(bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "c", "text")
    dataset, summary = build(source, bpe_tokenizer, tmp_path, drop_last=True)
    expected = expected_stream(bpe_tokenizer, DOCUMENTS)
    full = len(expected) // SEQ
    np.testing.assert_array_equal(np.stack(dataset["input_ids"]).ravel(), expected[: full * SEQ])
    assert (np.stack(dataset["labels"]) != -100).all()
    assert summary.padding_tokens == 0 and summary.dropped_tokens == len(expected) - full * SEQ > 0


def test_pad_id_falls_back_to_eos(bpe_tokenizer, tmp_path):
    no_pad = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer.backend_tokenizer, eos_token="<eos>")
    assert no_pad.pad_token_id is None
    dataset, summary = build(write_corpus(tmp_path / "c", "text"), no_pad, tmp_path)
    last = dataset[len(dataset) - 1]
    assert (last["input_ids"][last["labels"] == -100] == EOS).all()
    assert summary.padding_tokens > 0


def test_two_processes_give_the_same_stream(bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "c", "text")
    dataset, _ = build(source, bpe_tokenizer, tmp_path, num_proc=2)
    np.testing.assert_array_equal(unpadded_stream(dataset), expected_stream(bpe_tokenizer, DOCUMENTS))


def test_second_run_reuses_the_cache_without_tokenizing(bpe_tokenizer, tmp_path, monkeypatch):
    source = write_corpus(tmp_path / "c", "text")
    first, summary = build(source, bpe_tokenizer, tmp_path)
    assert not summary.reused

    def must_not_run(*args, **kwargs):
        raise AssertionError("the corpus was read or tokenized again")

    monkeypatch.setattr(data, "load_corpus", must_not_run)
    monkeypatch.setattr(data, "tokenize_documents", must_not_run)
    again, summary_again = build(source, bpe_tokenizer, tmp_path)
    assert summary_again.reused and summary_again.cache_path == summary.cache_path
    assert summary_again == summary
    np.testing.assert_array_equal(np.stack(again["input_ids"]), np.stack(first["input_ids"]))
    # another length re-packs from the cached tokens: still no reading or tokenizing
    other, other_summary = build(source, bpe_tokenizer, tmp_path, seq_length=256)
    assert not other_summary.reused and other_summary.seq_length == 256
    np.testing.assert_array_equal(unpadded_stream(other), unpadded_stream(first))
    # negative control: the patch is live, so a changed corpus must fail to rebuild
    (source / "doc_000.txt").write_text("changed text", encoding="utf-8")
    with pytest.raises(AssertionError, match="tokenized again"):
        build(source, bpe_tokenizer, tmp_path)


def test_changed_corpus_is_prepared_again(bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "c", "text")
    _, summary = build(source, bpe_tokenizer, tmp_path)
    with open(source / "doc_005.txt", "a", encoding="utf-8") as handle:
        handle.write(" extra words at the end")
    changed = list(DOCUMENTS)
    changed[5] += " extra words at the end"
    dataset, summary_after = build(source, bpe_tokenizer, tmp_path)
    assert not summary_after.reused and summary_after.cache_path != summary.cache_path
    np.testing.assert_array_equal(unpadded_stream(dataset), expected_stream(bpe_tokenizer, changed))


def test_tokenizer_identity_ignores_call_state_but_not_vocab(bpe_tokenizer):
    before = tokenizer_identity(bpe_tokenizer)
    bpe_tokenizer("some text here", truncation=True, max_length=2)
    assert tokenizer_identity(bpe_tokenizer) == before
    other = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer.backend_tokenizer, eos_token="<eos>")
    other.add_tokens(["<new_token>"])
    assert tokenizer_identity(other)["definition_sha256"] != before["definition_sha256"]


def test_failed_preparation_leaves_no_partial_cache(bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "c", "text", documents=["tiny document"])
    with pytest.raises(DataError, match="fewer than seq_length=512.*drop_last"):
        build(source, bpe_tokenizer, tmp_path, drop_last=True)
    names = [p.name for p in (tmp_path / "cache").iterdir() if p.name != "file-digests"]  # the corpus's digests
    assert len(names) == 1 and names[0].startswith("tokens-")  # no packed-*, no *.partial-*


def test_order_is_a_deterministic_permutation_per_seed_and_epoch():
    order = sample_order(50, seed=7, epoch=0)
    assert sorted(order) == list(range(50))
    np.testing.assert_array_equal(order, sample_order(50, seed=7, epoch=0))
    assert not np.array_equal(order, sample_order(50, seed=7, epoch=1))
    assert not np.array_equal(order, sample_order(50, seed=8, epoch=0))



def test_one_rank_prepares_the_other_waits(bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "c", "text")
    barrier = threading.Barrier(2, timeout=60)
    results = {}

    def rank(is_main):
        try:
            results[is_main] = prepare_or_wait(
                source, bpe_tokenizer, SEQ, is_main_process=is_main, barrier=barrier.wait,
                form=DataForm(text_field="body"), cache_dir=tmp_path / "cache",
            )
        except Exception as exc:
            results[is_main] = exc

    threads = [threading.Thread(target=rank, args=(flag,)) for flag in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (main_data, main_summary), (other_data, other_summary) = results[True], results[False]
    assert not main_summary.reused and other_summary.reused
    np.testing.assert_array_equal(np.stack(other_data["input_ids"]), np.stack(main_data["input_ids"]))


def test_main_failure_is_reported_on_every_rank(tmp_path, bpe_tokenizer):
    (tmp_path / "empty").mkdir()
    barrier = threading.Barrier(2, timeout=60)
    errors = {}

    def rank(is_main):
        try:
            prepare_or_wait(tmp_path / "empty", bpe_tokenizer, SEQ, is_main_process=is_main,
                            barrier=barrier.wait, cache_dir=tmp_path / "cache")
        except DataError as exc:
            errors[is_main] = str(exc)

    threads = [threading.Thread(target=rank, args=(flag,)) for flag in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert "is empty" in errors[True]
    assert "empty" in errors[False] or "after waiting for the main process" in errors[False]


# ------------------------------------------------------------------------------ bad input


def test_seq_length_not_multiple_of_sp(bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "c", "text")
    with pytest.raises(DataError, match=r"seq_length=1,000 is not a multiple of pad_multiple=16.*1,008 or 992"):
        build_packed_dataset(source, bpe_tokenizer, 1000, pad_multiple=16, cache_dir=tmp_path / "k")
    with pytest.raises(DataError, match="positive whole number"):
        build_packed_dataset(source, bpe_tokenizer, 0, cache_dir=tmp_path / "k")
    dataset, _ = build_packed_dataset(source, bpe_tokenizer, 1008, pad_multiple=16, cache_dir=tmp_path / "k")
    assert len(dataset[0]["input_ids"]) == 1008


def test_empty_corpus(bpe_tokenizer, tmp_path):
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="is empty: no .* files"):
        build(tmp_path / "none", bpe_tokenizer, tmp_path)
    blank = write_corpus(tmp_path / "blank", "text", documents=["", "", ""])
    with pytest.raises(DataError, match="no text: all 3 documents are empty"):
        build(blank, bpe_tokenizer, tmp_path)
    (tmp_path / "zero.jsonl").write_text("")
    with pytest.raises(DataError, match="zero.jsonl is empty"):
        build(tmp_path / "zero.jsonl", bpe_tokenizer, tmp_path)


def test_missing_or_wrong_text_field(bpe_tokenizer, tmp_path):
    source = write_corpus(tmp_path / "c", "jsonl", field="body")
    with pytest.raises(DataError, match="no text field 'text'; its fields are body, id"):
        build(source, bpe_tokenizer, tmp_path, text_field="text")
    with pytest.raises(DataError, match="field 'id' .* not text"):
        build(source, bpe_tokenizer, tmp_path, text_field="id")


def test_unreadable_files_are_named(bpe_tokenizer, tmp_path):
    bad_text = write_corpus(tmp_path / "latin1", "text", documents=["fine", "also fine"])
    (bad_text / "doc_001.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"doc_001\.txt.*utf-8"):
        build(bad_text, bpe_tokenizer, tmp_path)

    broken = write_corpus(tmp_path / "links", "text", documents=["fine"])
    os.symlink(tmp_path / "missing.txt", broken / "doc_999.txt")
    with pytest.raises(DataError, match=r"doc_999\.txt"):
        build(broken, bpe_tokenizer, tmp_path)

    bad_json = write_corpus(tmp_path / "json", "jsonl")
    (bad_json / "b.jsonl").write_text('{"body": "ok"}\n{"body": oops}\n')
    with pytest.raises(DataError, match=r"b\.jsonl.*JSON"):
        build(bad_json, bpe_tokenizer, tmp_path)


def test_tokenizer_without_eos(bpe_tokenizer, tmp_path):
    no_eos = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer.backend_tokenizer)
    assert no_eos.eos_token_id is None
    with pytest.raises(DataError, match="has no EOS token"):
        build(write_corpus(tmp_path / "c", "text"), no_eos, tmp_path)


def test_sources_that_are_not_corpora(bpe_tokenizer, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build(tmp_path / "nowhere", bpe_tokenizer, tmp_path)
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported extension"):
        build(tmp_path / "table.csv", bpe_tokenizer, tmp_path)
    mixed = write_corpus(tmp_path / "mixed", "text", documents=["x"])
    (mixed / "more.jsonl").write_text('{"body": "y"}\n')
    with pytest.raises(DataError, match="mixes file kinds"):
        build(mixed, bpe_tokenizer, tmp_path)
    assert resolve_source("deepmind/pg19") == ("hub", [])


# ------------------------------------------------------------------------------ the script


def load_prepare_data():
    return load_script("scripts/prepare_data.py")


def script_argv(bpe_tokenizer, tmp_path, seq_length: int) -> list:
    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    source = write_corpus(tmp_path / "c", "text")
    return ["--source", str(source), "--tokenizer", str(tmp_path / "tok"), "--seq-length", str(seq_length),
            "--pad-multiple", "8", "--cache-dir", str(tmp_path / "cache")]


def test_script_prepares_and_reports(bpe_tokenizer, tmp_path, capsys):
    argv = script_argv(bpe_tokenizer, tmp_path, 512)
    assert load_prepare_data().main(argv) == 0
    out = capsys.readouterr().out
    assert "sequences" in out and "x 512 tokens" in out and "tokens/s" in out
    assert load_prepare_data().main(argv) == 0
    assert "(reused)" in capsys.readouterr().out


def test_script_error_is_one_line_and_exit_2(bpe_tokenizer, tmp_path, capsys):
    assert load_prepare_data().main(script_argv(bpe_tokenizer, tmp_path, 500)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: seq_length=500 is not a multiple of pad_multiple=8")
    assert "Traceback" not in err
