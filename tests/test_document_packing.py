"""Chat sessions and document packing through the data pipeline (ulysses_train/data/document_packing.py,
sessions.render_sessions, corpus.build_packed_dataset with a DataForm).

The references are independent of the pipeline: each session's tokens are apply_chat_template on the messages
as written (before any JSON or arrow round trip), its labels come from chat_sessions.expected_labels (a regular
expression over the rendered text), and the pieces a long session is split into are cut here by hand. Every
packed row is then read back segment by segment and compared with that multiset: nothing lost, nothing
duplicated, no label across a document boundary.
"""
import collections
import json

import numpy as np
import pytest
from chat_sessions import CHATML, QWEN3, SESSIONS, call, chat_tokenizer, expected_labels

from ulysses_train.config import ConfigError
from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.data.corpus import DataError, build_packed_dataset, check_data_inputs
from ulysses_train.data.document_packing import best_fit_decreasing
from ulysses_train.data.form import DataForm
from ulysses_train.model.attention_checks import check_document_attention

SEQ = 256
CHAT = DataForm(format="chat", packing="documents")


def long_session(turns: int = 12) -> list[dict]:
    """An agent session longer than SEQ tokens: tool calls, tool results and assistant turns."""
    messages = [{"role": "system", "content": "you are an agent that reads files"}]
    for n in range(turns):
        messages += [{"role": "user", "content": f"read file number {n} and tell me what it says"},
                     {"role": "assistant", "content": "", "tool_calls": [call("cat", path=f"f{n}.txt")]},
                     {"role": "tool", "content": f"the file {n} says hello world " * 3},
                     {"role": "assistant", "content": f"file {n} greets the world three times"}]
    return messages


SESSION_LIST = [*SESSIONS.values(), long_session(), [{"role": "user", "content": "no reply"}]]


def write_sessions(path, sessions=SESSION_LIST, field="messages"):
    path.write_text("".join(json.dumps({field: messages, "id": n}) + "\n" for n, messages in enumerate(sessions)))
    return path


@pytest.fixture(scope="module", params=["qwen3", "chatml"])
def tokenizer(request, bpe_tokenizer):
    return chat_tokenizer(bpe_tokenizer, {"qwen3": QWEN3, "chatml": CHATML}[request.param])


def reference_pieces(tokenizer, sessions, seq_length):
    """(ids, labels) of every piece the corpus should become, first label IGNORE; and labels lost at cuts."""
    pieces, lost = [], 0
    for messages in sessions:
        if not any(m["role"] == "assistant" for m in messages):
            continue
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        labels = expected_labels(tokenizer, messages, ids)
        assert labels[0] == IGNORE_INDEX  # a session opens with a header, never with a learned token
        for start in range(0, len(ids), seq_length):
            piece_labels = [IGNORE_INDEX, *labels[start + 1:start + seq_length]]
            lost += start > 0 and labels[start] != IGNORE_INDEX
            pieces.append((tuple(ids[start:start + seq_length]), tuple(piece_labels)))
    return pieces, lost


def packed_segments(dataset, pad_id):
    """Every segment of every row as (ids, labels), padding segments left out; checks the rows' shape and
    that no label sits on the first token of a segment (the token after another document's last)."""
    segments = []
    for row in dataset:
        lengths = [int(n) for n in row["document_lengths"]]
        assert sum(lengths) == SEQ == len(row["input_ids"])
        for end, length in zip(np.cumsum(lengths), lengths):
            ids, labels = row["input_ids"][end - length:end], row["labels"][end - length:end]
            assert labels[0] == IGNORE_INDEX, "a label crosses a document boundary"
            if not (np.all(ids == pad_id) and np.all(labels == IGNORE_INDEX)):
                segments.append((tuple(int(t) for t in ids), tuple(int(t) for t in labels)))
    return segments


def test_every_session_once_with_exactly_its_assistant_labels(tokenizer, tmp_path):
    source = write_sessions(tmp_path / "sessions.jsonl")
    dataset, summary = build_packed_dataset(source, tokenizer, SEQ, form=CHAT, cache_dir=tmp_path / "cache")
    expected, lost = reference_pieces(tokenizer, SESSION_LIST, SEQ)
    got = packed_segments(dataset, tokenizer.pad_token_id)
    assert collections.Counter(got) == collections.Counter(expected)
    assert summary.documents == len(SESSION_LIST) - 1 and summary.empty_documents == 1  # "no reply": skipped
    assert summary.split_documents >= 1 and summary.split_lost_labels == lost
    assert summary.label_tokens == sum(sum(label != IGNORE_INDEX for label in labels) for _, labels in expected)
    assert summary.padding_tokens == len(dataset) * SEQ - sum(len(ids) for ids, _ in expected)
    assert summary.sequences == len(dataset) and "document_lengths" in dataset.column_names
    # negative control: the reference really tells sessions apart (a label moved by one fails it)
    ids, labels = expected[0]
    assert collections.Counter(got) != collections.Counter([(ids, (*labels[1:], IGNORE_INDEX)), *expected[1:]])


def test_best_fit_decreasing_by_hand_and_on_random_lengths():
    # longest first: 6 -> A (2 left), 5 -> B (3 left), 4 -> C (4 left), 3 -> B (fits tightest), 2 -> A, 1 -> C
    assert best_fit_decreasing([5, 3, 4, 2, 6, 1], 8) == [[4, 3], [0, 1], [2, 5]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, 500).tolist()
    bins = best_fit_decreasing(lengths, 512)
    assert sorted(i for members in bins for i in members) == list(range(500))
    assert all(sum(lengths[i] for i in members) <= 512 for members in bins)
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // 512) + 1  # the decreasing fit's bound over the optimum


def test_text_documents_with_eos_split_truncate_and_drop(bpe_tokenizer, tmp_path):
    words = "alpha beta gamma delta " * 60  # ~240 tokens: longer than a 64-token sequence
    rows = [{"text": words}, {"text": "short one"}, {"text": ""}, {"text": "another short document here"}]
    source = tmp_path / "t.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eos = bpe_tokenizer.eos_token_id
    streams = [bpe_tokenizer(r["text"], add_special_tokens=False)["input_ids"] + [eos] for r in rows if r["text"]]
    results = {}
    for rule in ("split", "truncate", "drop"):
        form = DataForm(packing="documents", too_long=rule)
        dataset, summary = build_packed_dataset(source, bpe_tokenizer, 64, form=form, cache_dir=tmp_path / "c")
        results[rule] = dataset
        long = len(streams[0])
        assert summary.documents == 3 and summary.empty_documents == 1
        if rule == "split":
            assert summary.split_documents == 1 and summary.split_lost_labels == -(-long // 64) - 1
        if rule == "truncate":
            assert summary.truncated_documents == 1 and summary.truncated_tokens == long - 64
        if rule == "drop":
            assert summary.dropped_documents == 1 and summary.dropped_tokens == long
    got = {ids for ids, _ in packed_segments_at(results["split"], 64, bpe_tokenizer.pad_token_id)}
    want = {tuple(streams[0][s:s + 64]) for s in range(0, len(streams[0]), 64)} | {tuple(s) for s in streams[1:]}
    assert got == want  # each text document (EOS included) whole, the long one in 64-token pieces


def test_a_multi_megabyte_message_is_packed_reading_only_its_pieces(bpe_tokenizer, tmp_path, monkeypatch):
    """Issue 41: one 10 MB assistant message made the corpus build run for minutes at GBs per rank: packing read the
    session's whole row again for every seq_length piece (quadratic in its length). A 2 MB reply here: the build
    reads no row one by one (Dataset.__getitem__ counted; the old code read one per piece, thousands, and fails at
    once), and the pieces in order are exactly the session's tokens, learned from the end of the assistant header
    through <|im_end|>, each later piece's first label lost and counted (reference: apply_chat_template and the
    header's length, here)."""
    import datasets

    tokenizer = chat_tokenizer(bpe_tokenizer, CHATML)
    messages = [{"role": "user", "content": "write a lot"}, {"role": "assistant", "content": " hello world" * 170_000}]
    source = write_sessions(tmp_path / "big.jsonl", [messages])
    reads, read_row = [], datasets.Dataset.__getitem__

    def counted(self, key):
        reads.append(key)
        assert len(reads) < 100, "rows read one by one while packing: quadratic in a long session's length"
        return read_row(self, key)

    monkeypatch.setattr(datasets.Dataset, "__getitem__", counted)
    dataset, summary = build_packed_dataset(source, tokenizer, SEQ, form=CHAT, cache_dir=tmp_path / "cache")
    monkeypatch.undo()
    assert len(reads) <= 2
    ids = np.asarray(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    header = len(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=False))
    labels = np.full(len(ids), IGNORE_INDEX)
    labels[header:-1] = ids[header:-1]  # the reply and <|im_end|>, not the newline after it
    assert len(ids) > 100 * SEQ and tokenizer.decode(ids[-2:]) == "<|im_end|>\n"
    labels[SEQ::SEQ] = IGNORE_INDEX  # every later piece's first token (the trainer's shift would cross its edge)
    rows = dataset.with_format("numpy")[:]
    assert np.array_equal(rows["input_ids"].reshape(-1)[:len(ids)], ids)  # full pieces in order, the rest last
    assert np.array_equal(rows["labels"].reshape(-1)[:len(ids)], labels)
    assert summary.split_documents == 1 and summary.split_lost_labels == (len(ids) - 1) // SEQ
    assert summary.label_tokens == int((labels != IGNORE_INDEX).sum())


def packed_segments_at(dataset, seq_length, pad_id):
    out = []
    for row in dataset:
        ends = np.cumsum(row["document_lengths"])
        for start, end in zip([0, *ends[:-1]], ends):
            ids = row["input_ids"][start:end]
            if not np.all(ids == pad_id):
                out.append((tuple(int(t) for t in ids), tuple(int(t) for t in row["labels"][start:end])))
    return out


def test_dropping_every_document_is_an_error(bpe_tokenizer, tmp_path):
    source = tmp_path / "t.jsonl"
    source.write_text(json.dumps({"text": "word " * 200}) + "\n")
    with pytest.raises(DataError, match="longer than seq_length=16.*too_long is drop.*Fix: too_long split"):
        build_packed_dataset(source, bpe_tokenizer, 16, form=DataForm(packing="documents", too_long="drop"),
                             cache_dir=tmp_path / "c")


def test_glued_sessions_learn_no_separator_under_assistant(tokenizer, tmp_path):
    source = write_sessions(tmp_path / "s.jsonl", list(SESSIONS.values()))
    dataset, summary = build_packed_dataset(source, tokenizer, SEQ, form=DataForm(format="chat"),
                                            cache_dir=tmp_path / "cache")
    ids, labels = np.concatenate(list(dataset["input_ids"])), np.concatenate(list(dataset["labels"]))
    eos = ids == tokenizer.eos_token_id
    assert eos.sum() == summary.separator_tokens == len(SESSIONS) and np.all(labels[eos] == IGNORE_INDEX)
    expected = sum(sum(label != IGNORE_INDEX for label in expected_labels(tokenizer, m, list(
        tokenizer.apply_chat_template(m, tokenize=True, return_dict=False)))) for m in SESSIONS.values())
    assert summary.label_tokens == expected


def test_cache_key_covers_template_loss_on_and_packing(bpe_tokenizer, tmp_path):
    source = write_sessions(tmp_path / "s.jsonl", list(SESSIONS.values()))
    qwen3, chatml = chat_tokenizer(bpe_tokenizer, QWEN3), chat_tokenizer(bpe_tokenizer, CHATML)

    def cache(tokenizer, **form):
        _, summary = build_packed_dataset(source, tokenizer, SEQ, form=DataForm(format="chat", **form),
                                          cache_dir=tmp_path / "cache")
        return summary

    first = cache(qwen3, packing="documents")
    assert cache(qwen3, packing="documents").reused  # the same inputs find the same cache
    others = [cache(chatml, packing="documents"), cache(qwen3, packing="documents", loss_on="all"),
              cache(qwen3, packing="glue"), cache(qwen3, packing="documents", too_long="truncate")]
    paths = [first.cache_path] + [s.cache_path for s in others]
    assert len(set(paths)) == len(paths) and not any(s.reused for s in others)
    tokens_stages = {p.name for p in (tmp_path / "cache").glob("tokens-*")}
    assert len(tokens_stages) == 3  # qwen3/assistant, chatml/assistant, qwen3/all; packing reuses its tokens


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_sessions_survive_the_storage_round_trip_with_tool_calls(tokenizer, tmp_path, kind):
    """Parquet (and a dataset built from Python dicts) stores messages as one struct type, so every message
    gets every key any message has (tool_calls: None on user turns, tool arguments merged into one struct with
    None for the keys a call lacks): the rendered tokens must still be those of the messages as written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sessions = [SESSIONS["agent"], SESSIONS["assistant_first_and_null_content"]]
    if kind == "jsonl":
        source = write_sessions(tmp_path / "s.jsonl", sessions)
    else:
        source = tmp_path / "s.parquet"
        pq.write_table(pa.table({"messages": sessions}), source)
        assert pq.read_table(source).to_pylist()[0]["messages"][1]["tool_calls"] is None  # the union, really
    dataset, _ = build_packed_dataset(source, tokenizer, 1024, form=CHAT, cache_dir=tmp_path / "cache")
    got = {ids for ids, _ in packed_segments_at(dataset, 1024, tokenizer.pad_token_id)}
    assert got == {tuple(tokenizer.apply_chat_template(m, tokenize=True, return_dict=False)) for m in sessions}


# ---------------------------------------------------------------- bad input: one line naming the row and the fix


def test_rows_without_the_messages_field_name_the_key(tokenizer, tmp_path):
    source = write_sessions(tmp_path / "s.jsonl", field="conversation")
    with pytest.raises(DataError, match=r"no messages field 'messages'; its fields are conversation, id\. "
                                        r"Fix: data.messages_field: NAME"):
        build_packed_dataset(source, tokenizer, SEQ, form=CHAT, cache_dir=tmp_path / "cache")


def test_a_bad_row_is_named_by_its_place_counted_from_1(tokenizer, tmp_path):
    """The second session is "session 2" (as its line 2: the trainer's early check names lines from 1)."""
    sessions = [SESSIONS["one_turn"], [{"role": "user"}, {"role": "assistant", "content": "x"}]]
    source = write_sessions(tmp_path / "s.jsonl", sessions)
    with pytest.raises(DataError, match=r"session 2 of .*s.jsonl, turn 0: the message has no 'content' key") as err:
        build_packed_dataset(source, tokenizer, SEQ, form=CHAT, cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_a_role_the_template_rejects_is_named(bpe_tokenizer, tmp_path):
    chatml = chat_tokenizer(bpe_tokenizer, CHATML)
    sessions = [SESSIONS["one_turn"], [{"role": "narrator", "content": "once"}, {"role": "assistant", "content": "x"}]]
    source = write_sessions(tmp_path / "s.jsonl", sessions)
    with pytest.raises(DataError, match=r"session 2 of .*: the chat template refused the messages.*Unknown role"):
        build_packed_dataset(source, chatml, SEQ, form=CHAT, cache_dir=tmp_path / "cache")


def test_no_session_with_an_assistant_turn_is_an_error(tokenizer, tmp_path):
    source = write_sessions(tmp_path / "s.jsonl", [[{"role": "user", "content": "hi"}]] * 3)
    with pytest.raises(DataError, match=r"no session with an assistant turn \(3 sessions, all skipped\)"):
        build_packed_dataset(source, tokenizer, SEQ, form=CHAT, cache_dir=tmp_path / "cache")


def test_early_checks_of_chat_data(bpe_tokenizer, tmp_path):
    from ulysses_train.config import DataConfig

    plain = tmp_path / "plain"
    bpe_tokenizer.save_pretrained(plain)  # no chat template
    with_template = tmp_path / "chat"
    chat_tokenizer(bpe_tokenizer, CHATML).save_pretrained(with_template)
    source = write_sessions(tmp_path / "s.jsonl")

    def check(tokenizer, **keys):
        cfg = DataConfig(source=str(keys.pop("source", source)), tokenizer=str(tokenizer), format="chat",
                         seq_length=SEQ, **keys)
        check_data_inputs(cfg, "unused", pad_multiple=2)

    check(with_template)  # negative control: good data passes
    with pytest.raises(DataError, match=r"has no chat template.*Fix: a tokenizer with one.*data.format text"):
        check(plain)
    with pytest.raises(DataError, match=r"no messages field 'turns'.*Fix: data.messages_field: NAME"):
        check(with_template, messages_field="turns")
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("text")
    with pytest.raises(DataError, match=r"\.txt files, which hold text, but data.format is chat"):
        check(with_template, source=tmp_path / "txt")


def test_document_packing_refuses_kernels_without_variable_length_attention():
    for kernel in ("sdpa", "eager"):
        with pytest.raises(ConfigError, match=r"data.packing=documents needs variable-length attention.*fa4.*"
                                              r"flash_attention_2"):
            check_document_attention("documents", kernel, kernel)
    with pytest.raises(ConfigError, match=r"auto chose 'sdpa'"):
        check_document_attention("documents", "sdpa", "auto")
    check_document_attention("documents", "fa4", "auto")  # negative controls
    check_document_attention("glue", "sdpa", "sdpa")


def test_loss_on_assistant_needs_chat_data():
    with pytest.raises(ConfigError, match="needs chat data"):
        DataForm(format="text", loss_on="assistant")
    from ulysses_train.config import load_config

    with pytest.raises(ConfigError, match=r"data.loss_on=assistant needs chat data \(data.format chat\)"):
        load_config(None, ["data.source=x.jsonl", "model.name_or_path=m", "data.loss_on=assistant"])
    load_config(None, ["data.source=x.jsonl", "model.name_or_path=m", "data.loss_on=assistant", "data.format=chat"])
    with pytest.raises(ConfigError, match=r"--too-long='never' is not valid"):
        DataForm(too_long="never", flags=True)


def test_prepare_data_flags_and_the_run_config_find_the_same_cache(bpe_tokenizer, tmp_path, capsys):
    """prepare_data.py --format chat --packing documents prepares what a run config with the same data keys reads:
    the trainer's call then reuses it instead of rendering the sessions again."""
    from helpers import load_script

    from ulysses_train.config import DataConfig
    from ulysses_train.data.corpus import prepare_run_data

    chat_tokenizer(bpe_tokenizer, QWEN3).save_pretrained(tmp_path / "tok")
    source = write_sessions(tmp_path / "s.jsonl")
    argv = ["--source", str(source), "--tokenizer", str(tmp_path / "tok"), "--seq-length", str(SEQ),
            "--pad-multiple", "2", "--format", "chat", "--packing", "documents", "--cache-dir", str(tmp_path / "c")]
    assert load_script("scripts/prepare_data.py").main(argv) == 0
    printed = capsys.readouterr().out
    assert "whole documents per sequence" in printed and "without an assistant turn, skipped" in printed
    data = DataConfig(source=str(source), tokenizer=str(tmp_path / "tok"), format="chat", packing="documents",
                      seq_length=SEQ, cache_dir=str(tmp_path / "c"), num_proc=1)
    _, summary = prepare_run_data(data, "unused", SEQ, 2)
    assert summary.reused
    _, other = prepare_run_data(DataConfig(**{**vars(data), "loss_on": "all"}), "unused", SEQ, 2)
    assert not other.reused  # negative control: another data key is another cache
