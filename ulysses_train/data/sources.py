"""Where documents come from: a folder of .txt, .jsonl/.json/.parquet files, a saved dataset or a hub name,
read as one string column; the text field checked cheaply (first row, schema) or on load."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from datasets import Dataset, DatasetDict, Features, LargeList, List, Sequence, Value, load_dataset, load_from_disk

from ulysses_train.data.form import DataForm

from ulysses_train.errors import UserError
from ulysses_train.user_input import one_line

LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Documents per tokenizer call / per packing step: small enough that a batch of books stays a
# few hundred MB, large enough that the fast tokenizer's threads have work.


class DataError(UserError, ValueError):
    """Unusable input; the message names the file or field and the fix."""


def check_first_rows(kind: str, files: list[Path], source, form: DataForm) -> None:
    """The document field of a local corpus (text, or chat messages), read from as little as possible: the
    first row of the first non-empty .jsonl file, a .parquet file's schema, a saved dataset's features."""
    check_kind_holds_form(kind, source, form)
    field, option, chat = form.field, form.field_option, form.chat
    if kind == "saved":
        try:
            corpus = load_from_disk(str(Path(source).expanduser()))  # memory-mapped: reads no rows
        except Exception as exc:
            raise DataError(f"cannot open the saved dataset {source}: {one_line(exc)}.") from None
        check_field_feature(_pick_split(corpus, source, "train").features, source, field, option, chat)
        return
    files = [path for path in files if os.path.isfile(path) and os.path.getsize(path) > 0]
    if not files:
        return  # load_corpus names the empty corpus
    first = files[0]
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(first)
        except Exception as exc:
            raise DataError(f"cannot read corpus file {first}: {one_line(exc)}.") from None
        check_field_feature({name: schema.field(name).type for name in schema.names}, first, field, option, chat)
    elif kind == "json" and first.suffix.lower() == ".jsonl":
        row = _first_json_row(first)
        if not isinstance(row, dict):
            raise DataError(f"corpus file {first}: its first line is a JSON {type(row).__name__}, not an object "
                            f"{{\"{field}\": ...}}; JSON Lines need one object per line.")
        check_field_feature({key: type(value) for key, value in row.items()}, first, field, option, chat)


def check_kind_holds_form(kind: str, source, form: DataForm) -> None:
    """.txt files hold text only: chat sessions come as rows with a messages column."""
    if kind == "text" and form.chat:
        raise DataError(f"corpus {source} is .txt files, which hold text, but {form.option('format')} is chat: "
                        f"sessions come as rows with a {form.messages_field!r} column of messages (.jsonl, .parquet, "
                        f"a saved or hub dataset). Fix: {form.option('format')} text, or convert the sessions.")


def _first_json_row(path: Path):
    """The first non-empty line as JSON; an error names that line (decoded alone: bad bytes in a later line are
    that line's, which row_checks.py names)."""
    number = 0
    try:
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    return json.loads(line.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read line {number} (the first row) of corpus file {path}: {one_line(exc)}.") from None
    return {}


def resolve_source(source: str | os.PathLike) -> tuple[str, list[Path]]:
    """What kind of corpus ``source`` is and which files it consists of.

    Kinds: "text", "json", "parquet" (files by extension; one kind per folder), "saved" (a
    ``save_to_disk`` folder) and "hub" (a name that is not a local path). Hidden files and
    folders are ignored, so a cache folder placed inside the corpus folder is not read as data.
    """
    text = str(source)
    path = Path(text).expanduser()
    if not path.exists():
        if path.is_symlink():
            raise DataError(f"corpus {text!r} is a symbolic link that loops or points nowhere; point it at the data.")
        if text.startswith(("/", ".", "~")) or path.suffix.lower() in LOADERS:
            raise DataError(f"corpus {text!r} does not exist.")
        return "hub", []
    if path.is_file():
        kind = LOADERS.get(path.suffix.lower())
        if kind is None:
            raise DataError(
                f"corpus file {path} has an unsupported extension; use one of "
                f"{', '.join(sorted(LOADERS))}, or a folder of them."
            )
        return kind, [path]
    if not path.is_dir():
        raise DataError(f"corpus {text!r} is {special_file_kind(path)}, not a file or a folder. Fix: a corpus file "
                        f"({', '.join(sorted(LOADERS))}) or a folder of them.")
    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        return "saved", _visible_files(path)
    files = [p for p in _visible_files(path) if p.suffix.lower() in LOADERS]
    kinds = sorted({LOADERS[p.suffix.lower()] for p in files})
    if not files:
        raise DataError(
            f"corpus folder {path} is empty: no {', '.join(sorted(LOADERS))} files in it."
        )
    if len(kinds) > 1:
        raise DataError(
            f"corpus folder {path} mixes file kinds ({', '.join(kinds)}); put one kind per folder."
        )
    return kinds[0], files


def special_file_kind(path: Path) -> str:
    """What a path that is neither a regular file nor a folder is, in a word."""
    import stat

    mode = path.stat().st_mode
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
             (stat.S_ISSOCK, "a socket"))
    return next((word for test, word in kinds if test(mode)), "not a regular file")


def load_corpus(
    source: str | os.PathLike,
    form: DataForm = DataForm(),
    split: str = "train",
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
) -> Dataset:
    """The corpus as a ``Dataset``, one document per row in the column ``form.field``: a string (text) or a
    list of messages (chat)."""
    kind, files = resolve_source(source)
    check_kind_holds_form(kind, source, form)
    text_field = form.text_field
    names = [str(p) for p in files]
    cache = str(cache_dir) if cache_dir is not None else None
    try:
        if kind == "text":
            corpus = Dataset.from_generator(
                _read_text_files,
                gen_kwargs={"paths": names, "text_field": text_field},
                features=Features({text_field: Value("large_string")}),
                cache_dir=cache,
                num_proc=useful_procs(num_proc, len(names)),
            )
        elif kind in ("json", "parquet"):
            corpus = _load_files(kind, _non_empty_files(names, source), cache, num_proc)
        elif kind == "saved":
            corpus = load_from_disk(str(source))
        else:
            corpus = load_dataset(str(source), split=split, num_proc=num_proc)
    except DataError:
        raise
    except Exception as exc:
        cause = data_error_in(exc)
        if cause is not None:
            raise cause from None
        raise DataError(f"cannot read corpus {source}: {type(exc).__name__}: {exc}") from exc
    corpus = _pick_split(corpus, source, split)
    check_field_feature(corpus.features, source, form.field, form.field_option, form.chat)
    if len(corpus) == 0:
        raise DataError(f"corpus {source} is empty: 0 documents.")
    return corpus


def _read_text_files(paths: list[str], text_field: str) -> Iterator[dict]:
    """One document per file, strict UTF-8: a wrong encoding is reported, not silently replaced."""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except UnicodeDecodeError as exc:
            with open(path, "rb") as handle:
                line = handle.read(exc.start).count(b"\n") + 1
            raise DataError(f"corpus file {path}, line {line}: bytes that are not UTF-8 text ({one_line(exc)}); a "
                            f"binary file, or text in another encoding. Fix: re-encode it as UTF-8, or remove it.") from exc
        except OSError as exc:
            raise DataError(f"cannot read corpus file {path}: {exc}") from exc
        yield {text_field: text}


def _load_files(kind: str, names: list[str], cache: str | None, num_proc: int | None) -> Dataset:
    """JSON / Parquet files through ``datasets``; on failure, find and name the bad file."""
    try:
        return load_dataset(
            kind, data_files=names, split="train", cache_dir=cache,
            num_proc=useful_procs(num_proc, len(names)),
        )
    except Exception as exc:
        if len(names) > 1:
            for name in names:
                try:
                    load_dataset(kind, data_files=[name], split="train", cache_dir=cache)
                except Exception as single:
                    raise DataError(f"cannot read corpus file {name}: {root_cause(single)}") from exc
        raise DataError(f"cannot read corpus file {names[0]}: {root_cause(exc)}") from exc


def _non_empty_files(names: list[str], source) -> list[str]:
    """Zero-byte JSON/Parquet files hold no documents (and make ``datasets`` fail obscurely)."""
    try:
        kept = [name for name in names if os.path.getsize(name) > 0]
    except OSError as exc:
        raise DataError(f"cannot read corpus file {exc.filename}: {exc.strerror}") from exc
    if not kept:
        raise DataError(f"corpus {source} is empty: all {len(names)} files have 0 bytes.")
    return kept


def _pick_split(corpus, source, split: str) -> Dataset:
    if not isinstance(corpus, DatasetDict):
        return corpus
    if split not in corpus:
        raise DataError(f"corpus {source} has no split {split!r}; it has {', '.join(corpus)}.")
    return corpus[split]


def _set_option(option: str, value: str) -> str:
    """How to set ``option``: ``--text-field NAME`` for a flag, ``data.text_field: NAME`` for a config key."""
    return f"{option} {value}" if option.startswith("-") else f"{option}: {value}"


def check_field_feature(features: dict, source, field: str, option: str, chat: bool = False) -> None:
    """``features``: column name -> ``datasets`` feature (or a pyarrow type, or a Python type for JSON).
    ``option``: the setting the user changes (``data.text_field`` in a config, ``--text-field`` as a flag);
    ``chat``: the field must hold lists of messages, else text."""
    what = "messages field" if chat else "text field"
    if field not in features:
        names = ", ".join(features) or "(none)"
        raise DataError(
            f"corpus {source} has no {what} {field!r}; its fields are {names}. "
            f"Fix: {_set_option(option, 'NAME')} naming the {what}."
        )
    feature = features[field]
    fits = _is_message_list(feature) if chat else _is_text(feature)
    if not fits:
        shown = feature.__name__ if isinstance(feature, type) else feature
        wanted = "a list of {role, content} messages" if chat else "text"
        raise DataError(
            f"field {field!r} of corpus {source} holds {shown}, not {wanted}. "
            f"Fix: {_set_option(option, 'NAME')} naming a field that holds {wanted}."
        )


def _is_text(feature) -> bool:
    if isinstance(feature, Value):
        return feature.dtype in ("string", "large_string")
    if isinstance(feature, pa.DataType):
        return pa.types.is_string(feature) or pa.types.is_large_string(feature)
    return feature in (str, type(None))  # a Python type, from a JSON row (null: no text in this row, read as empty)


def _is_message_list(feature) -> bool:
    if isinstance(feature, (List, LargeList, Sequence)):
        return True
    if isinstance(feature, pa.DataType):
        return pa.types.is_list(feature) or pa.types.is_large_list(feature)
    return feature is list  # a Python type, from a JSON row


def corpus_identity(source: str | os.PathLike, split: str = "train") -> dict:
    """Path and (relative name, size, mtime) of every file read; a hub dataset by name and split.

    Editing, adding or removing a file changes the identity, so the cache is rebuilt. A hub
    dataset is trusted to stay the same under its name (``datasets`` caches its download).
    """
    kind, files = resolve_source(source)
    if kind == "hub":
        return {"hub": str(source), "split": split}
    root = Path(source).expanduser().absolute()
    listing = []
    for path in files:
        name = path.name if root.is_file() else os.path.relpath(path.absolute(), root)
        try:
            stat = path.stat()
            listing.append([name, stat.st_size, stat.st_mtime_ns])
        except OSError:
            listing.append([name, None, None])  # unreadable; load_corpus reports it
    return {"path": str(root), "kind": kind, "split": split, "files": listing}


def content_hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _visible_files(folder: Path) -> list[Path]:
    """Files under ``folder`` in sorted path order, skipping hidden names (broken links included)."""
    found = []
    for path in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if not hidden and not path.is_dir():
            found.append(path)
    return found


def useful_procs(num_proc: int | None, items: int) -> int | None:
    """No more processes than items to share out; None when only one is useful.

    None, not 1: ``datasets`` runs ``num_proc=1`` in a forked worker, where the fast tokenizer
    turns its own threads off, so one process in place is faster than one worker.
    """
    if not num_proc or num_proc <= 1 or items <= 1:
        return None
    return min(num_proc, items)


def data_error_in(exc: BaseException) -> DataError | None:
    """A DataError raised inside ``datasets`` (e.g. by our text reader) wrapped in its own error."""
    while exc is not None:
        if isinstance(exc, DataError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"
