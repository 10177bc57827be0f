"""Data mistakes named by the early data check (`data.corpus.check_data_sources`), the one the trainer runs before
the process group and the model (tests/test_train_script.py shows that order end to end); and the same corpora
reaching the preparation (`build_packed_dataset`) still fail there, or train, as they should.

Every case writes a small corpus with one mistake in a row after the first, so a check of the first row alone
would miss it; the message must name the file, the line (or session) and the fix."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_sessions import CHATML, chat_tokenizer
from helpers import write_jsonl

from ulysses_train.config import load_config
from ulysses_train.data.corpus import build_packed_dataset, check_data_sources
from ulysses_train.data.form import DataForm
from ulysses_train.data.sources import DataError

GOOD = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how are you"}]}
USER_ONLY = {"messages": [{"role": "user", "content": "hello there"}]}


def corpus_case(case, tmp):
    """(source, format, extra settings, text the message must hold)."""
    chat = {
        "row without messages": ([GOOD, {"text": "hello"}], ["line 2", "'messages'"]),
        "unknown role": ([GOOD, {"messages": [{"role": "robot", "content": "x"}, GOOD["messages"][1]]}],
                         ["line 2", "Unknown role: robot"]),
        "unknown role in line 40": ([GOOD] * 39 + [{"messages": [{"role": "robot", "content": "x"}, GOOD["messages"][1]]}],
                                    ["line 40", "Unknown role: robot"]),
        "turn without content": ([GOOD, {"messages": [{"role": "user"}, GOOD["messages"][1]]}],
                                 ["line 2", "turn 0", "'content'"]),
        "no assistant anywhere": ([USER_ONLY] * 3, ["no session with an assistant turn", "loss_on"]),
        "JSON array": ([GOOD, [GOOD]], ["line 2", "JSON list", "one object per line"]),
        "bad bytes": ([GOOD, GOOD, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n'],
                      ["line 3", "UTF-8"]),
    }
    if case in chat:
        lines, words = chat[case]
        return str(write_jsonl(tmp / "chat.jsonl", lines)), "chat", [], words
    text_rows = {
        "chat rows in a text corpus": ([{"text": "a b c"}, GOOD], ["line 2", "is a chat session", "format chat"]),
        "a number in the text field": ([{"text": "a b c"}] * 4 + [{"text": 42}], ["line 5", "holds int, not text"]),
        "JSON syntax in line 5": ([{"text": "a b c"}] * 4 + [b'{"text": [oops\n'], ["line 5", "not valid JSON"]),
        "NUL bytes in a text row": ([{"text": "a b c"}, {"text": "h\x00i\x00"}], ["line 2", "NUL bytes", "UTF-16"]),
    }
    if case in text_rows:
        lines, words = text_rows[case]
        return str(write_jsonl(tmp / "text.jsonl", lines)), "text", [], words
    if case == "UTF-16 .txt without a byte-order mark":
        (tmp / "books").mkdir()
        (tmp / "books" / "a.txt").write_bytes("a book\nin UTF-16\n".encode("utf-16-le"))
        return str(tmp / "books"), "text", [], ["a.txt, line 1", "NUL bytes", "iconv -f utf-16"]
    if case == "truncated last line":
        return str(write_jsonl(tmp / "text.jsonl", [{"text": "a b c"}] * 4, tail=b'{"text": "a b')), "text", [], \
            ["line 5", "not valid JSON", "truncated"]
    if case in ("symlink loop", "binary .txt"):
        folder = tmp / "books"
        folder.mkdir()
        (folder / "a.txt").write_text("a perfectly good book\n" * 5)
        if case == "symlink loop":
            os.symlink(folder / "b.txt", folder / "b.txt")
            return str(folder), "text", [], ["b.txt", "symbolic link"]
        (folder / "b.txt").write_bytes(b"line one\nline two\n\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
        return str(folder), "text", [], ["b.txt", "line 3", "UTF-8"]
    if case == "too short for one sequence":
        return str(write_jsonl(tmp / "short.jsonl", [{"text": "a b c"}] * 3)), "text", ["data.drop_last=true"], \
            ["fewer than seq_length=256", "drop_last"]
    if case == "parquet without the message fields":
        table = pa.Table.from_pylist([{"messages": [{"speaker": "user", "text": "x"}]}] * 2)
        pq.write_table(table, tmp / "chat.parquet")
        return str(tmp / "chat.parquet"), "chat", [], ["'role'", "'content'", "speaker, text"]
    if case == "saved dataset without the message fields":
        import datasets

        datasets.Dataset.from_list([{"messages": [{"speaker": "user", "text": "x"}]}] * 2).save_to_disk(str(tmp / "s"))
        return str(tmp / "s"), "chat", [], ["'role'", "'content'", "speaker, text"]
    raise KeyError(case)


CASES = ["row without messages", "unknown role", "unknown role in line 40", "turn without content", "no assistant anywhere", "JSON array",
         "bad bytes", "truncated last line", "symlink loop", "binary .txt", "too short for one sequence",
         "parquet without the message fields", "saved dataset without the message fields",
         "chat rows in a text corpus", "a number in the text field", "JSON syntax in line 5",
         "NUL bytes in a text row", "UTF-16 .txt without a byte-order mark"]
TAKEN_BY_THE_PREPARATION = ("chat rows in a text corpus", "NUL bytes in a text row",
                            "UTF-16 .txt without a byte-order mark")
"""Mistakes the preparation alone trained in silence (chat rows skipped as empty, NUL-laden text tokenized): the
early check (and prepare_data.py, which runs it) is what names them."""


@pytest.fixture(scope="module")
def tokenizer_dir(bpe_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("chatml")
    chat_tokenizer(bpe_tokenizer, CHATML).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("case", CASES)
def test_data_mistakes_are_named_by_the_early_check(case, tmp_path, tokenizer_dir):
    source, form, extra, words = corpus_case(case, tmp_path)
    sets = [f"data.source={source}", f"data.format={form}", f"data.tokenizer={tokenizer_dir}", "data.seq_length=256",
            f"data.cache_dir={tmp_path / 'cache'}", *extra]
    cfg = load_config(None, ["model.name_or_path=unused", *sets])
    with pytest.raises(DataError) as caught:
        check_data_sources(cfg.data, "unused")
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message
    if case in ("symlink loop", "too short for one sequence", "no assistant anywhere", *TAKEN_BY_THE_PREPARATION):
        return  # named the same way by the preparation; the early check is what is new
    # the preparation (what the trainer runs after the model build) names the same mistake: a control that the
    # corpus really holds it, and that the early check does not refuse what the preparation would take
    with pytest.raises(DataError):
        build_packed_dataset(source, tokenizer_dir, 256, form=DataForm.from_config(cfg.data),
                             cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("case", CASES)
def test_prepare_data_names_each_mistake_as_the_trainer_does(case, tmp_path, tokenizer_dir, capsys):
    """prepare_data.py runs the trainer's early check before preparing: the same one line (file, 1-based line, fix),
    exit 2. It counted chat sessions from 0 ("session 4" for line 5), gave pyarrow's "in row 4" for a JSON syntax
    error, and prepared chat rows of a text corpus (skipped as empty) and NUL-laden text without a word."""
    from helpers import load_script

    source, form, extra, words = corpus_case(case, tmp_path)
    flags = ["--drop-last"] if "data.drop_last=true" in extra else []
    argv = ["--source", source, "--format", form, "--tokenizer", tokenizer_dir, "--seq-length", "256",
            "--cache-dir", str(tmp_path / "cache"), *flags]
    assert load_script("scripts/prepare_data.py").main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and all(word in lines[-1] for word in words), lines[-1]


@pytest.mark.parametrize("form", ["chat", "text"])
def test_a_good_corpus_passes_the_early_check(form, tmp_path, tokenizer_dir):
    """Negative control: the same corpora without the mistake pass, including a last line without a newline."""
    row = GOOD if form == "chat" else {"text": "a b c"}
    source = write_jsonl(tmp_path / "good.jsonl", [row] * 3, tail=json.dumps(row).encode())
    cfg = load_config(None, ["model.name_or_path=unused", f"data.source={source}", f"data.format={form}", f"data.tokenizer={tokenizer_dir}"])
    check_data_sources(cfg.data, "unused")


@pytest.mark.parametrize("case", ["unknown role", "bad bytes", "truncated last line", "binary .txt"])
def test_a_large_corpus_is_checked_by_its_first_rows_and_its_end(case, tmp_path, tokenizer_dir, monkeypatch):
    """Above FULL_SCAN_BYTES only a sample is read (here every corpus counts as large): the first rows, each JSON
    Lines file's end, the heads of .txt files; the same mistakes are named from them."""
    from ulysses_train.data import row_checks

    monkeypatch.setattr(row_checks, "FULL_SCAN_BYTES", 0)
    if case == "truncated last line":  # read only the first row: the end is checked on its own
        monkeypatch.setattr(row_checks, "SAMPLE_ROWS", 1)
    source, form, extra, words = corpus_case(case, tmp_path)
    cfg = load_config(None, ["model.name_or_path=unused", f"data.source={source}", f"data.format={form}",
                             f"data.tokenizer={tokenizer_dir}"])
    with pytest.raises(DataError) as caught:
        check_data_sources(cfg.data, "unused")
    words = ["the last line", "truncated"] if case == "truncated last line" else words
    assert all(word in str(caught.value) for word in words), caught.value


def test_parquet_tool_arguments_merged_by_arrow_are_named(tmp_path, tokenizer_dir, capsys):
    """Arrow merges every row's tool-call arguments into one struct when a Parquet file is written from dicts:
    {"timeout": 10} reads back as 10.0, in the struct's key order. The file no longer holds the original, so the
    early check says so (once) and names the faithful forms; JSON Lines and datasets' own Parquet (a JSON column)
    render exactly the original messages (reference: the template on the messages as written) and get no warning."""
    import datasets
    from transformers import AutoTokenizer

    def session(arguments):
        return {"messages": [{"role": "user", "content": "run it"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"type": "function", "function": {"name": "sh", "arguments": arguments}}]}]}

    rows = [session({"timeout": 10, "cmd": "ls"}), session({"cmd": "ls", "timeout": 2.5})]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "merged.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "merged_saved"))  # the same merge, saved
    datasets.load_dataset("json", data_files=str(tmp_path / "chat.jsonl"), split="train",
                          cache_dir=str(tmp_path / "hf")).to_parquet(str(tmp_path / "json_column.parquet"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    form = DataForm(format="chat", loss_on="all")
    expected = sum(len(tokenizer.apply_chat_template(row["messages"], return_dict=False)) + 1 for row in rows)
    warned = {}
    for name in ("chat.jsonl", "merged.parquet", "json_column.parquet", "merged_saved"):
        cfg = load_config(None, ["model.name_or_path=unused", f"data.source={tmp_path / name}", "data.format=chat",
                                 "data.loss_on=all", f"data.tokenizer={tokenizer_dir}"])
        check_data_sources(cfg.data, "unused")
        warned[name] = capsys.readouterr().err.count("stores tool-call arguments as an Arrow struct")
        _, summary = build_packed_dataset(tmp_path / name, tokenizer, 64, form=form, cache_dir=tmp_path / "cache")
        faithful = summary.document_tokens + summary.separator_tokens == expected
        assert faithful == (not name.startswith("merged")), name  # the merged files really render otherwise
    assert warned == {"chat.jsonl": 0, "merged.parquet": 1, "json_column.parquet": 0, "merged_saved": 1}


def test_a_template_that_labels_no_session_is_named_early(bpe_tokenizer, tmp_path):
    """Every session quotes the assistant header, so under Qwen3's template (anchored search) none can be labelled:
    one skipped session is counted (tests/test_sessions.py), but all of them is a mistake, named by the early check
    and by the preparation alike."""
    from chat_sessions import QWEN3

    tokenizer_dir = tmp_path / "qwen3"
    chat_tokenizer(bpe_tokenizer, QWEN3).save_pretrained(tokenizer_dir)
    quoting = {"messages": [{"role": "user", "content": "say <|im_start|>assistant\nplease"},
                            {"role": "assistant", "content": "no"}, {"role": "user", "content": "why"},
                            {"role": "assistant", "content": "because"}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [quoting] * 3)
    cfg = load_config(None, ["model.name_or_path=unused", f"data.source={source}", "data.format=chat",
                             f"data.tokenizer={tokenizer_dir}"])
    with pytest.raises(DataError, match="none of the 3 sessions checked could be labelled, the first: session at "
                                        "file .*line 1: the assistant header"):
        check_data_sources(cfg.data, "unused")
    with pytest.raises(DataError, match="no session could be labelled .3 sessions skipped, 3 of them"):
        build_packed_dataset(source, str(tokenizer_dir), 256, form=DataForm.from_config(cfg.data),
                             cache_dir=tmp_path / "cache")


def test_parquet_text_that_looks_like_json_stays_text(tmp_path, tokenizer_dir):
    """Negative control for the JSON-column reading of chat Parquet: a text document "42" is text, counted as such
    (drop_last with a too-short corpus: the count must tokenize the text, not a number)."""
    pq.write_table(pa.Table.from_pylist([{"text": "42"}, {"text": "[1, 2]"}]), tmp_path / "text.parquet")
    cfg = load_config(None, ["model.name_or_path=unused", f"data.source={tmp_path / 'text.parquet'}",
                             f"data.tokenizer={tokenizer_dir}", "data.drop_last=true", "data.seq_length=256"])
    with pytest.raises(DataError, match="fewer than seq_length=256"):
        check_data_sources(cfg.data, "unused")


def test_bad_bytes_past_the_rows_checked_early_are_named_by_their_line(tmp_path, tokenizer_dir, monkeypatch):
    """A large corpus is sampled early; bad bytes in a row past the sample reach the preparation, whose error
    still names the line (a raw UnicodeDecodeError, a traceback, before)."""
    from ulysses_train.data import row_checks

    monkeypatch.setattr(row_checks, "FULL_SCAN_BYTES", 0)
    monkeypatch.setattr(row_checks, "SAMPLE_ROWS", 1)
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, b'{"messages": [{"role": "user", "content": "\xff"}]}\n', GOOD])
    cfg = load_config(None, ["model.name_or_path=unused", f"data.source={source}", "data.format=chat",
                             f"data.tokenizer={tokenizer_dir}"])
    check_data_sources(cfg.data, "unused")  # the sample (line 1) and the file's end (line 4) pass
    with pytest.raises(DataError, match="chat.jsonl, line 3: bytes that are not UTF-8 text"):
        build_packed_dataset(source, tokenizer_dir, 256, form=DataForm.from_config(cfg.data),
                             cache_dir=tmp_path / "cache")


def test_a_tokenizer_larger_than_the_embeddings_is_refused_before_the_model(tmp_path, bpe_tokenizer, capsys):
    """Issue 51: a 1,000-token tokenizer for a model of 512 embedding rows trained silently on text (or failed with an
    IndexError at step 1 on chat data). Now one line before the model is built, naming both sizes and the fix; the
    same tokenizer with the model's own size (the negative control) passes the check."""
    from helpers import one_error_line, save_tiny_model

    from ulysses_train.data.tokenizer import check_vocabulary_fits

    save_tiny_model(str(tmp_path / "model"), vocab_size=512)
    bpe_tokenizer.save_pretrained(tmp_path / "tokenizer")
    source = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world, once more"}] * 4)
    capsys.readouterr()
    line = one_error_line(["--set", f"model.name_or_path={tmp_path / 'model'}", "--set", f"data.source={source}", "--set", f"data.tokenizer={tmp_path / 'tokenizer'}",
                           "--set", f"train.output_dir={tmp_path / 'out'}", "--set",
                           f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.seq_length=64"], capsys)
    assert line == (f"error: data.tokenizer={str(tmp_path / 'tokenizer')!r} has 1,000 tokens but the model's "
                    f"embeddings have 512 rows (vocab_size): token ids 512 and up have no embedding. Fix: use the "
                    f"model's own tokenizer, or a model whose vocab_size is at least 1,000 (resize_token_embeddings, "
                    f"then save it).")
    assert not (tmp_path / "out" / "checkpoints").exists()
    check_vocabulary_fits(len(bpe_tokenizer), 1000, "data.tokenizer")  # the control: as many rows as tokens
    check_vocabulary_fits(len(bpe_tokenizer), 1024, "data.tokenizer")  # padded embeddings (Qwen's) fit too
    with pytest.raises(DataError, match="has 1,000 tokens but the model's embeddings have 999 rows"):
        check_vocabulary_fits(len(bpe_tokenizer), 999, "data.tokenizer")


NULL_REPLY = {"role": "assistant", "content": None}


@pytest.mark.parametrize("where,messages", [
    ("mid-session", [GOOD["messages"][0], NULL_REPLY, {"role": "user", "content": "and?"}, GOOD["messages"][1]]),
    ("last", [GOOD["messages"][0], GOOD["messages"][1], {"role": "user", "content": "and?"}, NULL_REPLY])])
def test_an_assistant_turn_with_null_content_and_no_tool_calls_is_refused(where, messages, tmp_path, tokenizer_dir):
    """Issue 51: it trained silently as an empty reply. Refused in one line naming the session and turn, by the
    early check and by the preparation; content "" (an empty reply meant) and null content with tool_calls (the
    negative controls) pass."""
    turn = messages.index(NULL_REPLY)
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": messages}, GOOD])
    cfg = load_config(None, ["model.name_or_path=unused", f"data.source={source}", "data.format=chat",
                             f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={tmp_path / 'cache'}"])
    line = (f"turn {turn}: an assistant turn with null content and no tool_calls would train as an empty reply; give "
            f"the reply as its content, add the tool_calls it made, or drop the turn.")
    with pytest.raises(DataError) as caught:
        check_data_sources(cfg.data, "unused")
    assert str(caught.value).endswith(f"line 2, {line}") and "\n" not in str(caught.value), caught.value
    with pytest.raises(DataError, match="null content and no tool_calls"):
        build_packed_dataset(str(source), tokenizer_dir, 256, form=DataForm.from_config(cfg.data),
                             cache_dir=tmp_path / "cache")
    call = {"id": "c0", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}
    for fixed in ({"role": "assistant", "content": ""}, {"role": "assistant", "content": None, "tool_calls": [call]}):
        rows = [GOOD, {"messages": [fixed if m is NULL_REPLY else m for m in messages]}, GOOD]
        write_jsonl(tmp_path / "chat.jsonl", rows)
        check_data_sources(cfg.data, "unused")
