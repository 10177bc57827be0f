"""A local corpus read row by row before anything heavy: every rank runs this before the process group and the model
(check_data_sources), because the preparation that would find the same mistakes runs only after both, which takes
minutes on a real model. A mistake is named with its file and line (or row) and the fix.

How much is read: the whole corpus when its files hold at most FULL_SCAN_BYTES (then the checks that need every row
run too: no assistant turn anywhere, too few tokens for one sequence with drop_last); else the first SAMPLE_ROWS rows
(at most SAMPLE_BYTES) of the JSON Lines files in order, the end of each (an interrupted write truncates the last
line), the first rows of the first Parquet file and every Parquet schema, the first rows of a saved dataset and the
head of the first SAMPLE_FILES .txt files: a few MB per rank whatever the corpus's size. Up to RENDER_SESSIONS chat
sessions are rendered with the template, and the first session holding each role not rendered yet.
Every file is stat'ed (a symbolic link loop or a dangling link is named here). .json files (one document that
`datasets` may read several ways) and hub datasets are checked when loaded."""
from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

from ulysses_train.data.form import DataForm
from ulysses_train.data.packing import raise_no_documents, raise_too_short
from ulysses_train.data.sessions import UnlabelledSession, check_messages, plain_messages, render_session
from ulysses_train.data.sources import DataError, resolve_source
from ulysses_train.user_input import one_line

FULL_SCAN_BYTES = 8 << 20  # JSON parsing of chat sessions: ~1 s per rank
SAMPLE_ROWS = 256
SAMPLE_BYTES = 8 << 20
SAMPLE_FILES = 64
TEXT_HEAD_BYTES = 1 << 16
RENDER_SESSIONS = 32
LAST_LINE_BYTES = 1 << 12
COUNT_BATCH = 16
MAX_CHARS_PER_TOKEN = 16


def check_rows(kind: str, files: list[Path], source, form: DataForm, tokenizer, seq_length: int) -> None:
    """Raise DataError for the first mistake found in the rows read (see the module docstring)."""
    if kind == "saved":
        documents = _saved_rows(source, form)
        if form.chat:
            _check_sessions(documents, tokenizer, form, False, source)
        return
    if kind not in ("text", "json", "parquet"):
        return
    sizes = [_size(path) for path in files]
    complete = sum(sizes) <= FULL_SCAN_BYTES
    if kind == "text":
        documents = _text_documents(files, complete)
    elif kind == "json":
        documents = _json_documents([path for path in files if path.suffix.lower() == ".jsonl"], form, complete)
        complete = complete and all(path.suffix.lower() == ".jsonl" for path in files)
    else:
        documents = [doc for n, path in enumerate(files) for doc in _parquet_rows(path, form, complete, n == 0)]
    if form.chat:
        _check_sessions(documents, tokenizer, form, complete, source)
    if complete and form.packing == "glue" and form.drop_last:
        tokens = _token_count(documents, tokenizer, form, seq_length)
        if tokens < seq_length:
            raise_too_short(source, tokens, seq_length)


def _size(path: Path) -> int:
    """The file's size; a link that loops or points nowhere, or a file that cannot be read, is named here."""
    try:
        return os.stat(path).st_size
    except OSError as err:
        kind = ("a symbolic link loop" if err.errno == errno.ELOOP else "a symbolic link to nothing" if path.is_symlink()
                else err.strerror)
        raise DataError(f"cannot read corpus file {path}: {kind} ({err.strerror}). Fix: remove it from the corpus "
                        f"folder or point it at a real file.") from None


def _text_documents(files: list[Path], complete: bool) -> list[tuple[str, str]]:
    """(where, text) per .txt file read: whole files when complete, else the heads of the first ones."""
    out = []
    for path in files if complete else files[:SAMPLE_FILES]:
        with open(path, "rb") as handle:
            raw = handle.read() if complete else handle.read(TEXT_HEAD_BYTES)
        text = _decode(raw, path, final=complete)
        check_no_nul(text, f"corpus file {path}", lines=True)
        out.append((f"corpus file {path}", text))
    return out


def _decode(raw: bytes, path: Path, line: int | str | None = None, final: bool = True) -> str:
    """Strict UTF-8; the error names the line holding the bad bytes (`line`: its number or words; counted in `raw`
    when not given)."""
    import codecs

    try:
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
    except UnicodeDecodeError as err:
        at = line if line is not None else raw.count(b"\n", 0, err.start) + 1
        raise DataError(f"corpus file {path}, {at if isinstance(at, str) else f'line {at}'}: bytes that are not UTF-8 text ({err.reason}: "
                        f"{raw[err.start:err.end]!r}); a binary file, or text in another encoding. Fix: re-encode "
                        f"the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or remove it or that line.") from None


def bad_bytes_error(source, err: UnicodeDecodeError) -> DataError:
    """The error for bad bytes met while preparing a corpus larger than the rows checked early: the first line that
    holds them, found by decoding each local file line by line (only on this error path), else the corpus."""
    kind, files = resolve_source(source)
    for path in files if kind in ("text", "json") else ():
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                try:
                    _decode(raw, path, number)
                except DataError as found:
                    return found
    return DataError(f"corpus {source} holds bytes that are not UTF-8 text ({one_line(err)}). Fix: re-encode it as "
                     f"UTF-8, or remove the rows that hold them.")


def _json_documents(files: list[Path], form: DataForm, complete: bool) -> list[tuple[str, object]]:
    """(where, document field) of the rows read from JSON Lines files (see the module docstring)."""
    out, budget = [], {"rows": SAMPLE_ROWS, "bytes": SAMPLE_BYTES}
    for path in files:
        if complete or budget["rows"] > 0 and budget["bytes"] > 0:
            out += _json_lines(path, form, complete, budget)
        if not complete:
            _check_file_end(path, form)
    return out


def _json_lines(path: Path, form: DataForm, complete: bool, budget: dict) -> list[tuple[str, object]]:
    """The rows of one file, all of them when complete, else while `budget` lasts (spent here)."""
    out = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            budget["bytes"] -= len(raw)
            if raw.strip():
                out.append(_json_row(raw, path, number, form, last=not handle.peek(1)))
                budget["rows"] -= 1
            if not complete and (budget["rows"] <= 0 or budget["bytes"] <= 0):
                break
    return out


def _check_file_end(path: Path, form: DataForm) -> None:
    """The last line, parsed when it fits in the LAST_LINE_BYTES read from the end; a longer one must at least
    end like an object does."""
    with open(path, "rb") as handle:
        start = max(0, handle.seek(0, os.SEEK_END) - LAST_LINE_BYTES)
        handle.seek(start)
        lines = [line for line in handle.read().split(b"\n") if line.strip()]
    if not lines:
        return
    if start == 0 or len(lines) > 1:
        _json_row(lines[-1], path, None, form, last=True)
    elif not lines[-1].rstrip().endswith(b"}"):
        raise DataError(f"corpus file {path}: its last line does not end with '}}', so it looks truncated (an "
                        f"interrupted write?). Fix: repair or remove that line; JSON Lines hold one complete "
                        f"object per line.")


def _json_row(raw: bytes, path: Path, number: int | None, form: DataForm, last: bool) -> tuple[str, object]:
    line = f"line {number}" if number is not None else "the last line"
    text = _decode(raw, path, number if number is not None else line)
    try:
        row = json.loads(text)
    except ValueError as err:
        cut = "; it is the file's last line, so it looks truncated (an interrupted write?)" if last else ""
        raise DataError(f"corpus file {path}, {line} is not valid JSON ({one_line(err)}){cut}. Fix: repair or "
                        f"remove that line; JSON Lines hold one complete object per line.") from None
    where = f"corpus file {path}, {line}"
    if not isinstance(row, dict):
        raise DataError(f"{where} is a JSON {type(row).__name__}, not an object {{\"{form.field}\": ...}}; JSON "
                        f"Lines need one object per line. Fix: one object per line (a JSON array of rows is a .json "
                        f"file, not .jsonl).")
    return _field(row, where, form)


def _field(row: dict, where: str, form: DataForm) -> tuple[str, object]:
    value = row.get(form.field)
    if form.chat and value is None:
        raise DataError(f"{where} has no messages field {form.field!r} (its fields: {', '.join(row) or 'none'}); "
                        f"every row of a chat corpus holds a session. Fix: add it, or "
                        f"{form.option('messages_field')} naming the field.")
    if not form.chat and value is None and isinstance(row.get(form.messages_field), list):
        raise DataError(f"{where} is a chat session (a {form.messages_field!r} list, no text field "
                        f"{form.field!r}), in a corpus read as text, where it would be skipped as empty. Fix: "
                        f"{form.option('format')} chat for a corpus of sessions, or text in every row.")
    if not form.chat and value is not None and not isinstance(value, str):
        raise DataError(f"{where}: its text field {form.field!r} holds {type(value).__name__}, not text. Fix: text "
                        f"in every row, or {form.option('text_field')} naming a text field.")
    if not form.chat and isinstance(value, str):
        check_no_nul(value, where)
    return where, value


def check_no_nul(text: str, where: str, lines: bool = False) -> None:
    """Text holding NUL characters is a binary file or UTF-16/32 text read as UTF-8 (every ASCII letter followed by a
    NUL byte decodes without error), whose tokens would be noise: named, with the fix. `lines`: `where` is a whole
    file, so the first NUL's line is named."""
    if "\x00" in text:
        at = f", line {text.count(chr(10), 0, text.index(chr(0))) + 1}" if lines else ""
        raise DataError(f"{where}{at} holds NUL bytes (\\x00): a binary file, or text in UTF-16 or UTF-32, not "
                        f"UTF-8. Fix: re-encode it as UTF-8 (e.g. iconv -f utf-16 -t utf-8), or remove it.")


def _parquet_rows(path: Path, form: DataForm, complete: bool, first: bool) -> list[tuple[str, object]]:
    """(where, document field) of the rows of a Parquet file: all when complete, else RENDER_SESSIONS of the
    `first` file and none of the others (their schema only)."""
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        if form.field not in reader.schema_arrow.names:
            return []  # check_first_rows names the missing field (first file) or the loader does
        check_message_fields(reader.schema_arrow.field(form.field).type, path, form)
        out = []
        if not (complete or first):
            return out
        for batch in reader.iter_batches(batch_size=SAMPLE_ROWS if complete else RENDER_SESSIONS,
                                         columns=[form.field]):
            out.extend(batch.column(0).to_pylist())
            if not complete:
                break
    except DataError:
        raise
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"cannot read corpus file {path}: {one_line(err)}.") from None
    return [(f"corpus file {path}, row {n + 1}", _json_value(value) if form.chat else value)
            for n, value in enumerate(out)]


def _saved_rows(source, form: DataForm) -> list[tuple[str, object]]:
    """The first RENDER_SESSIONS rows of a saved dataset's train split (memory-mapped: only these are read), after
    the messages' type (check_message_fields); check_first_rows has named a missing field or split."""
    from datasets import DatasetDict, Features, load_from_disk

    corpus = load_from_disk(str(Path(source).expanduser()))
    corpus = corpus.get("train") if isinstance(corpus, DatasetDict) else corpus
    if corpus is None or form.field not in corpus.features:
        return []
    check_message_fields(Features({form.field: corpus.features[form.field]}).arrow_schema.field(form.field).type,
                         source, form)
    values = corpus.select(range(min(len(corpus), RENDER_SESSIONS)))[form.field]
    return [(f"corpus {source}, row {n + 1}", _json_value(value) if form.chat else value)
            for n, value in enumerate(values)]


def _json_value(value):
    """A message (or session) that a JSON-typed column stores as text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    return value


def check_message_fields(arrow_type, source, form: DataForm) -> None:
    """A chat column stored as a list of structs must have role and content among the struct's fields; and a
    struct for tool-call arguments is worth a warning (struct_arguments_warning)."""
    import pyarrow as pa

    if not form.chat or not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return
    item = arrow_type.value_type
    if not pa.types.is_struct(item):
        return
    names = [item.field(i).name for i in range(item.num_fields)]
    missing = [name for name in ("role", "content") if name not in names]
    if missing:
        raise DataError(f"field {form.field!r} of corpus {source} holds messages with the fields {', '.join(names)}, "
                        f"without {' or '.join(map(repr, missing))}. Fix: rename them to role and content (the form "
                        f"chat templates read), or {form.option('messages_field')} naming the messages.")
    if _struct_arguments(item):
        warn_once(struct_arguments_warning(source))


def _struct_arguments(arrow_type) -> bool:
    """Whether a field named `arguments` anywhere inside `arrow_type` (a message struct) is itself a struct."""
    import pyarrow as pa

    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return _struct_arguments(arrow_type.value_type)
    if not pa.types.is_struct(arrow_type):
        return False
    fields = [arrow_type.field(i) for i in range(arrow_type.num_fields)]
    return any((f.name == "arguments" and pa.types.is_struct(f.type)) or _struct_arguments(f.type) for f in fields)


def struct_arguments_warning(source) -> str:
    return (f"warning: corpus {source} stores tool-call arguments as an Arrow struct: Arrow merged every row's "
            f"arguments into one type when the file was written, so a number can read back as a float (10 as 10.0) "
            f"and keys come in the struct's order, not the row's; the tool calls then render unlike the original "
            f"JSON. Fix: JSON Lines (read as JSON, exactly), or Parquet written by datasets (a JSON column) or with "
            f"arguments as JSON strings.")


_WARNED: set[str] = set()


def warn_once(text: str) -> None:
    """Printed once, by the process of global rank 0 only (every rank runs these checks, on every file)."""
    if text not in _WARNED and int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        _WARNED.add(text)
        print(text, file=sys.stderr, flush=True)


def _check_sessions(documents, tokenizer, form: DataForm, complete: bool, source) -> None:
    """Each session's structure; rendered and labelled: the first RENDER_SESSIONS, and the first session holding
    each role not rendered yet (a role the template refuses or drops is found wherever it first occurs); with every
    row read, that some session has an assistant turn when only assistant turns are learned."""
    learned, rendered, unlabelled, roles = form.learned, 0, [], set()
    for where, messages in documents:
        at = f"at {where.removeprefix('corpus ')}"
        check_messages(messages, f"session {at}")
        new_roles = {message["role"] for message in messages} - roles
        if rendered + len(unlabelled) < RENDER_SESSIONS or new_roles:
            roles |= new_roles
            try:  # as the preparation renders it (render_sessions: None values dropped)
                rendered += render_session(tokenizer, plain_messages(messages), learned, row=at) is not None
            except UnlabelledSession as err:
                unlabelled.append(str(err))
    if unlabelled and rendered == 0:
        raise DataError(f"none of the {len(unlabelled)} sessions checked could be labelled, the first: "
                        f"{unlabelled[0]}")
    has_assistant = "assistant" in roles
    if complete and learned == "assistant" and not has_assistant:
        raise_no_documents(source, len(documents), chat=True)


def _token_count(documents, tokenizer, form: DataForm, enough: int) -> int:
    """Tokens the glue packing would hold, counted until there are `enough`: each document's tokens and its EOS
    (text; a document is cut to MAX_CHARS_PER_TOKEN x `enough` characters first, more than `enough` tokens of any
    real text), or each rendered session with an assistant turn and its EOS (chat). Stopping early keeps this to
    about one sequence's worth of tokenizing whatever the corpus's size."""
    total = 0
    for first in range(0, len(documents), COUNT_BATCH):
        batch = documents[first:first + COUNT_BATCH]
        if not form.chat:
            texts = [(text or "")[:MAX_CHARS_PER_TOKEN * enough] for _, text in batch]
            ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
            total += sum(len(row) + 1 for row in ids if row)
        for where, messages in batch if form.chat else ():
            if form.learned == "assistant" and not any(m["role"] == "assistant" for m in messages):
                continue
            at = f"at {where.removeprefix('corpus ')}"
            total += len(render_session(tokenizer, plain_messages(messages), "all", row=at)["input_ids"]) + 1
        if total >= enough:
            break
    return total
