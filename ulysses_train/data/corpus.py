"""Corpus -> tokens -> long packed sequences, cached on disk as arrow.

Long-context training reads a few very long sequences per step, built from a corpus of long
documents (such as PG-19's books): documents glued end to end, each followed by the tokenizer's EOS, cut into sequences of
exactly ``seq_length`` tokens. Nothing may be lost or duplicated on the way, so packing is one
sequential pass over one token stream, and the last partial sequence is padded (labels -100 on
the padding) or dropped, by choice. ``seq_length`` must be a multiple of the sequence-parallel
size (``pad_multiple``) because every sp rank holds an equal slice.

Two cache stages, each in a folder named by a hash of what decides its content:

- ``tokens-<hash>``: one row of ``input_ids`` per document; keyed by the corpus (path, file
  sizes and mtimes, text field, split) and the tokenizer (name and a hash of its full definition).
  Re-packing at another length reuses it.
- ``packed-<hash>``: ``input_ids`` and ``labels`` of exactly ``seq_length``; keyed by the tokens
  stage, ``seq_length``, ``drop_last`` and the pad id; ``summary.json`` holds the counts.

Each stage is written into a private temporary folder and renamed into place when complete, so
an interrupted run never leaves a half-written cache that a later run would trust.

Entry points: ``build_packed_dataset`` (one process), ``prepare_or_wait`` (one rank prepares,
the others wait), ``sample_order`` / ``iterate_samples`` (deterministic, resumable order).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, Features, List, Value, concatenate_datasets, load_dataset, load_from_disk
from datasets.arrow_writer import ArrowWriter
from tqdm.auto import tqdm

from ulysses_train.errors import UserError
from ulysses_train.config import missing_local_path, nearest_multiples, one_line, partial_local_path_note
from ulysses_train.constants import IGNORE_INDEX

CACHE_FORMAT = 1  # bump when the cached layout or packing rule changes
DEFAULT_CACHE_DIR = Path("~/.cache/ulysses_train/data").expanduser()
LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Documents per tokenizer call / per packing step: small enough that a batch of books stays a
# few hundred MB, large enough that the fast tokenizer's threads have work.
TOKENIZE_BATCH_DOCUMENTS = 64
PACK_BATCH_DOCUMENTS = 256


class DataError(UserError, ValueError):
    """Unusable input; the message names the file or field and the fix."""


@dataclass
class PackingSummary:
    """What went in and what came out; printed after preparation and saved with the cache."""

    source: str
    seq_length: int
    documents: int
    empty_documents: int
    document_tokens: int
    separator_tokens: int
    sequences: int
    padding_tokens: int
    dropped_tokens: int
    tokenize_seconds: float
    pack_seconds: float
    cache_path: str = ""
    reused: bool = field(default=False, compare=False)

    @property
    def padding_share(self) -> float:
        """Share of the packed tokens that are padding (0 when nothing was packed)."""
        total = self.sequences * self.seq_length
        return self.padding_tokens / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Document tokens per second of preparation (reading, tokenizing and packing)."""
        seconds = self.tokenize_seconds + self.pack_seconds
        return self.document_tokens / seconds if seconds > 0 else float("nan")

    def __str__(self) -> str:
        rows = [
            ("source", self.source),
            ("documents", f"{self.documents:,} ({self.empty_documents:,} empty, skipped)"),
            ("document tokens", f"{self.document_tokens:,}"),
            ("EOS separators", f"{self.separator_tokens:,}"),
            ("sequences", f"{self.sequences:,} x {self.seq_length:,} tokens"),
            ("padding", f"{self.padding_tokens:,} tokens ({self.padding_share:.2%})"),
            ("dropped (drop_last)", f"{self.dropped_tokens:,} tokens"),
            (
                "preparation",
                f"{self.tokenize_seconds:.1f} s tokenize + {self.pack_seconds:.1f} s pack, "
                f"{self.tokens_per_second:,.0f} tokens/s",
            ),
            ("cache", f"{self.cache_path}{' (reused)' if self.reused else ''}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)

    def save(self, path: Path) -> None:
        data = asdict(self)
        data.pop("reused")
        path.write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: Path) -> "PackingSummary":
        return cls(**json.loads(path.read_text()))


# ---------------------------------------------------------------------------------------------
# Entry points


def build_packed_dataset(
    source: str | os.PathLike,
    tokenizer,
    seq_length: int,
    pad_multiple: int = 1,
    text_field: str = "text",
    drop_last: bool = False,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    num_proc: int | None = None,
    split: str = "train",
    text_field_option: str = "data.text_field",
) -> tuple[Dataset, PackingSummary]:
    """Packed sequences of ``seq_length`` tokens from ``source``, prepared once and cached.

    ``source``: a folder of .txt files (one document per file, sorted by path), a .jsonl/.json or
    .parquet file or a folder of them (``text_field`` names the column), a folder written by
    ``Dataset.save_to_disk``, or a hub dataset name such as ``deepmind/pg19`` (``split``).
    ``tokenizer``: a name/path for ``AutoTokenizer`` or a tokenizer object; it must have an EOS.
    ``pad_multiple``: the sequence-parallel size (or 2*sp); ``seq_length`` must be a multiple.
    ``num_proc``: processes for reading and tokenizing (``None``: one process, whose fast
    tokenizer still uses several threads).
    ``text_field_option``: how the caller's user sets ``text_field``, named in the error when the field is
    missing (``data.text_field`` for train.py's config, ``--text-field`` for prepare_data.py).

    Returns the dataset (numpy format, rows in storage order; use ``iterate_samples`` for the
    shuffled, resumable order) and its summary. Raises ``DataError`` on unusable input.
    """
    return _build(
        source, tokenizer, seq_length, pad_multiple, text_field, drop_last, cache_dir, num_proc,
        split, text_field_option, may_prepare=True,
    )


def prepare_or_wait(
    source: str | os.PathLike,
    tokenizer,
    seq_length: int,
    *,
    is_main_process: bool,
    barrier: Callable[[], None] | None = None,
    **options,
) -> tuple[Dataset, PackingSummary]:
    """In a multi-process run: the main process prepares, the others wait and open the cache.

    Every process must call this (it contains a barrier). ``barrier`` defaults to
    ``torch.distributed.barrier`` when a process group is initialised, else no waiting. If the
    processes do not share a filesystem, pass ``is_main_process=(local_rank == 0)`` so each node
    prepares its own copy. A failure on the main process is re-raised there after the barrier,
    so the others do not hang; they then fail with a message pointing at it. ``options`` are
    those of ``build_packed_dataset``.
    """
    barrier = barrier or _distributed_barrier
    error = None
    result = None
    if is_main_process:
        try:
            result = build_packed_dataset(source, tokenizer, seq_length, **options)
        except Exception as exc:  # re-raised below, after the others were released
            error = exc
    barrier()
    if error is not None:
        raise error
    if result is not None:
        return result
    return _build(source, tokenizer, seq_length, may_prepare=False, **_build_options(options))


def check_data_inputs(data_cfg, model_name_or_path: str, pad_multiple: int, eval_lengths=()) -> None:
    """Cheap checks of a run's data settings, before any model is built or any text tokenized.

    ``data_cfg``: the run config's ``data`` section (``config.DataConfig``); ``model_name_or_path``: the
    model, whose tokenizer is used when ``data.tokenizer`` is empty; ``pad_multiple``: the sequence-parallel
    size; ``eval_lengths``: ``train.eval_lengths`` (packed from the corpus too). Checks that ``data.seq_length``
    and each evaluation length is a multiple of it, that a local corpus exists, that its text field
    is there (from the first row of a .jsonl file, the schema of a .parquet file, or the features of a saved
    dataset; .json files and hub datasets are checked when loaded), and that the tokenizer loads and has an
    EOS token. The demo source needs none of this. Raises ``DataError`` naming the setting and the fix.
    """
    if data_cfg.source == "demo":
        return
    _check_lengths(data_cfg.seq_length, pad_multiple, names=("data.seq_length", "parallel.sequence_parallel_size"))
    for length in eval_lengths:
        if length % pad_multiple:
            raise DataError(
                f"train.eval_lengths holds {length:,}, not a multiple of parallel.sequence_parallel_size="
                f"{pad_multiple} (corpus sequences are packed to exactly each length). Fix: "
                f"{nearest_multiples(length, pad_multiple)}."
            )
    kind, files = resolve_source(data_cfg.source)
    _check_first_rows(kind, files, data_cfg.source, data_cfg.text_field)
    if data_cfg.tokenizer:
        tokenizer = load_tokenizer(data_cfg.tokenizer, option="data.tokenizer")
    else:
        try:
            tokenizer = load_tokenizer(model_name_or_path, option="model.name_or_path")
        except DataError as exc:
            raise DataError(f"{exc} (data.tokenizer is empty, so the model's tokenizer is used; set data.tokenizer "
                            f"to load another.)") from None
    _eos_id(tokenizer)


def _check_first_rows(kind: str, files: list[Path], source, text_field: str) -> None:
    """The text field of a local corpus, read from as little as possible: the first row of the first
    non-empty .jsonl file, a .parquet file's schema, a saved dataset's features."""
    option = "data.text_field"
    if kind == "saved":
        try:
            corpus = load_from_disk(str(Path(source).expanduser()))  # memory-mapped: reads no rows
        except Exception as exc:
            raise DataError(f"cannot open the saved dataset {source}: {one_line(exc)}.") from None
        _check_text_feature(_pick_split(corpus, source, "train").features, source, text_field, option)
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
        _check_text_feature({name: schema.field(name).type for name in schema.names}, first, text_field, option)
    elif kind == "json" and first.suffix.lower() == ".jsonl":
        row = _first_json_row(first)
        if not isinstance(row, dict):
            raise DataError(f"corpus file {first}: its first line is a JSON {type(row).__name__}, not an object "
                            f"{{\"{text_field}\": \"...\"}}; JSON Lines need one object per line.")
        _check_text_feature({key: type(value) for key, value in row.items()}, first, text_field, option)


def _first_json_row(path: Path):
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    return json.loads(line)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read the first row of corpus file {path}: {one_line(exc)}.") from None
    return {}


def sample_order(num_samples: int, seed: int, epoch: int = 0) -> np.ndarray:
    """Order in which to read the samples in ``epoch``: a permutation fixed by (seed, epoch).

    A pure function, so a resumed run recomputes exactly the order it was in, and each epoch
    gets a different order.
    """
    if num_samples < 0:
        raise DataError(f"num_samples must be >= 0, got {num_samples}.")
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


# ---------------------------------------------------------------------------------------------
# The two cached stages


def _build(
    source, tokenizer, seq_length, pad_multiple=1, text_field="text", drop_last=False,
    cache_dir=DEFAULT_CACHE_DIR, num_proc=None, split="train", text_field_option="data.text_field", *,
    may_prepare: bool,
) -> tuple[Dataset, PackingSummary]:
    """Find the packed cache for these inputs, preparing whatever stage is missing if allowed."""
    _check_lengths(seq_length, pad_multiple)
    corpus = corpus_identity(source, split)  # before the tokenizer: a wrong path fails at once
    tokenizer = load_tokenizer(tokenizer)
    eos_id = _eos_id(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    cache_dir = Path(cache_dir).expanduser()
    tokens_key = _hash(
        {
            "format": CACHE_FORMAT,
            "corpus": corpus,
            "text_field": text_field,
            "tokenizer": tokenizer_identity(tokenizer),
        }
    )
    packed_key = _hash(
        {"tokens": tokens_key, "seq_length": seq_length, "drop_last": drop_last, "pad_id": pad_id}
    )
    tokens_dir = cache_dir / f"tokens-{tokens_key}"
    packed_dir = cache_dir / f"packed-{packed_key}"
    reused = packed_dir.exists()
    if not reused:
        if not may_prepare:
            raise DataError(
                f"no prepared data at {packed_dir} after waiting for the main process. If the "
                f"main process failed, its error says why; if processes run on different nodes, "
                f"cache_dir must be shared or is_main_process must be true on each node's "
                f"local rank 0."
            )
        tokens, tokenize_seconds = _tokenized_documents(
            source, tokenizer, text_field, split, num_proc, tokens_dir, text_field_option
        )
        _pack(tokens, str(source), seq_length, eos_id, pad_id, drop_last, tokenize_seconds, packed_dir)
    summary = PackingSummary.load(packed_dir / "summary.json")
    summary.cache_path = str(packed_dir)
    summary.reused = reused
    return _load_arrow_folder(packed_dir).with_format("numpy"), summary


def _tokenized_documents(source, tokenizer, text_field, split, num_proc, stage_dir,
                         text_field_option="data.text_field"):
    """The tokens stage: load it if cached, else read and tokenize the corpus into it."""
    if not stage_dir.exists():
        started = time.perf_counter()
        with _staging(stage_dir) as tmp:
            corpus = load_corpus(source, text_field, split, cache_dir=tmp / "raw", num_proc=num_proc,
                                 text_field_option=text_field_option)
            tokenize_documents(
                corpus, tokenizer, text_field, tmp / "tokens.arrow", num_proc, stage_dir.name
            )
            del corpus
            shutil.rmtree(tmp / "raw", ignore_errors=True)
            elapsed = time.perf_counter() - started
            (tmp / "meta.json").write_text(json.dumps({"tokenize_seconds": elapsed}))
    meta = json.loads((stage_dir / "meta.json").read_text())
    return _load_arrow_folder(stage_dir), meta["tokenize_seconds"]


def tokenize_documents(
    corpus: Dataset, tokenizer, text_field: str, path: Path, num_proc=None, fingerprint=None
) -> Dataset:
    """One row of int32 ``input_ids`` per document, without special tokens (EOS comes at packing).

    ``fingerprint`` (our cache key) spares ``datasets`` from hashing the whole tokenizer.
    """
    return corpus.map(
        partial(_tokenize_batch, tokenizer=tokenizer, text_field=text_field),
        batched=True,
        batch_size=TOKENIZE_BATCH_DOCUMENTS,
        writer_batch_size=TOKENIZE_BATCH_DOCUMENTS,
        new_fingerprint=fingerprint,
        num_proc=_useful_procs(num_proc, len(corpus)),
        remove_columns=corpus.column_names,
        features=Features({"input_ids": List(Value("int32"))}),
        cache_file_name=str(path),
        desc="Tokenizing",
    )


def _tokenize_batch(batch: dict, tokenizer, text_field: str) -> dict:
    texts = [text if text is not None else "" for text in batch[text_field]]
    # verbose=False: books exceed model_max_length by design; the warning would be noise.
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return {"input_ids": encoded["input_ids"]}


def _pack(tokens, source, seq_length, eos_id, pad_id, drop_last, tokenize_seconds, stage_dir):
    """The packed stage: one pass over the token stream, cut into rows of ``seq_length``."""
    started = time.perf_counter()
    with _staging(stage_dir) as tmp:
        path = str(tmp / "packed.arrow")
        with ArrowWriter(features=_packed_features(seq_length), path=path) as writer:
            counts = _write_sequences(writer, tokens, seq_length, eos_id, pad_id, drop_last, source)
            writer.finalize()
        summary = PackingSummary(
            source=source,
            seq_length=seq_length,
            tokenize_seconds=tokenize_seconds,
            pack_seconds=time.perf_counter() - started,
            **counts,
        )
        summary.save(tmp / "summary.json")


def _write_sequences(writer, tokens, seq_length, eos_id, pad_id, drop_last, source) -> dict:
    """Cut the stream into full rows as it arrives; then pad or drop the remainder."""
    counts = {"documents": 0, "empty_documents": 0, "document_tokens": 0, "sequences": 0}
    pieces, held = [], 0  # joined only once a full row is there, so each token is copied ~twice
    for stream in _documents_with_eos(tokens, eos_id, counts):
        pieces.append(stream)
        held += len(stream)
        if held >= seq_length:
            joined = np.concatenate(pieces)
            full = len(joined) // seq_length
            _write_rows(writer, joined[: full * seq_length].reshape(full, seq_length), 0)
            pieces = [joined[full * seq_length :]]
            held = len(pieces[0])
            counts["sequences"] += full
    tail = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int32)
    if counts["documents"] == 0:
        raise DataError(
            f"corpus {source} has no text: all {counts['empty_documents']:,} documents are "
            f"empty after tokenization."
        )
    padding, dropped = _finish_tail(writer, tail, seq_length, pad_id, drop_last, counts)
    if counts["sequences"] == 0:
        raise DataError(
            f"corpus {source} has {len(tail):,} tokens, fewer than seq_length={seq_length:,}, "
            f"and drop_last is set, so no sequence is left. Fix: drop_last=False (pad it) or "
            f"a shorter seq_length."
        )
    counts.update(
        separator_tokens=counts["documents"], padding_tokens=padding, dropped_tokens=dropped
    )
    return counts


def _documents_with_eos(tokens: Dataset, eos_id: int, counts: dict) -> Iterator[np.ndarray]:
    """The token stream, a batch of documents at a time: each non-empty document then EOS."""
    batches = tokens.with_format("arrow").iter(batch_size=PACK_BATCH_DOCUMENTS)
    total = -(-len(tokens) // PACK_BATCH_DOCUMENTS)
    for table in tqdm(batches, total=total, desc="Packing", unit="batch"):
        column = table["input_ids"]
        lengths = pc.list_value_length(column).to_numpy()
        values = pc.list_flatten(column).to_numpy().astype(np.int32, copy=False)
        non_empty = lengths > 0
        counts["documents"] += int(non_empty.sum())
        counts["empty_documents"] += int((~non_empty).sum())
        counts["document_tokens"] += len(values)
        yield np.insert(values, np.cumsum(lengths)[non_empty], eos_id)


def _finish_tail(writer, tail, seq_length, pad_id, drop_last, counts) -> tuple[int, int]:
    """Pad the last partial sequence (labels -100 on padding) or drop it; returns (padding, dropped)."""
    if len(tail) == 0:
        return 0, 0
    if drop_last:
        return 0, len(tail)
    padding = seq_length - len(tail)
    row = np.concatenate([tail, np.full(padding, pad_id, dtype=np.int32)])
    _write_rows(writer, row.reshape(1, seq_length), padding)
    counts["sequences"] += 1
    return padding, 0


def _write_rows(writer: ArrowWriter, rows: np.ndarray, padding_in_last_row: int) -> None:
    """Append rows of token ids; labels equal them except the last row's trailing padding."""
    labels = rows.copy()
    if padding_in_last_row:
        labels[-1, -padding_in_last_row:] = IGNORE_INDEX
    width = rows.shape[1]
    table = pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), width),
            "labels": pa.FixedSizeListArray.from_arrays(pa.array(labels.ravel()), width),
        }
    )
    writer.write_table(table)


def _packed_features(seq_length: int) -> Features:
    return Features(
        {
            "input_ids": List(Value("int32"), length=seq_length),
            "labels": List(Value("int32"), length=seq_length),
        }
    )


# ---------------------------------------------------------------------------------------------
# Reading the corpus


def resolve_source(source: str | os.PathLike) -> tuple[str, list[Path]]:
    """What kind of corpus ``source`` is and which files it consists of.

    Kinds: "text", "json", "parquet" (files by extension; one kind per folder), "saved" (a
    ``save_to_disk`` folder) and "hub" (a name that is not a local path). Hidden files and
    folders are ignored, so a cache folder placed inside the corpus folder is not read as data.
    """
    text = str(source)
    path = Path(text).expanduser()
    if not path.exists():
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


def load_corpus(
    source: str | os.PathLike,
    text_field: str = "text",
    split: str = "train",
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    text_field_option: str = "data.text_field",
) -> Dataset:
    """The corpus as a ``Dataset`` with a string column ``text_field``, one document per row.

    ``text_field_option``: the name of the setting to fix when the field is missing (see
    ``build_packed_dataset``)."""
    kind, files = resolve_source(source)
    names = [str(p) for p in files]
    cache = str(cache_dir) if cache_dir is not None else None
    try:
        if kind == "text":
            corpus = Dataset.from_generator(
                _read_text_files,
                gen_kwargs={"paths": names, "text_field": text_field},
                features=Features({text_field: Value("large_string")}),
                cache_dir=cache,
                num_proc=_useful_procs(num_proc, len(names)),
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
        cause = _data_error_in(exc)
        if cause is not None:
            raise cause from None
        raise DataError(f"cannot read corpus {source}: {type(exc).__name__}: {exc}") from exc
    corpus = _pick_split(corpus, source, split)
    _check_text_column(corpus, source, text_field, text_field_option)
    return corpus


def _read_text_files(paths: list[str], text_field: str) -> Iterator[dict]:
    """One document per file, strict UTF-8: a wrong encoding is reported, not silently replaced."""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read corpus file {path}: {exc}") from exc
        yield {text_field: text}


def _load_files(kind: str, names: list[str], cache: str | None, num_proc: int | None) -> Dataset:
    """JSON / Parquet files through ``datasets``; on failure, find and name the bad file."""
    try:
        return load_dataset(
            kind, data_files=names, split="train", cache_dir=cache,
            num_proc=_useful_procs(num_proc, len(names)),
        )
    except Exception as exc:
        if len(names) > 1:
            for name in names:
                try:
                    load_dataset(kind, data_files=[name], split="train", cache_dir=cache)
                except Exception as single:
                    raise DataError(f"cannot read corpus file {name}: {_root_cause(single)}") from exc
        raise DataError(f"cannot read corpus file {names[0]}: {_root_cause(exc)}") from exc


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


def _check_text_column(corpus: Dataset, source, text_field: str, option: str = "data.text_field") -> None:
    """``option``: the setting the user changes, ``data.text_field`` (config) or ``--text-field`` (flag)."""
    _check_text_feature(corpus.features, source, text_field, option)
    if len(corpus) == 0:
        raise DataError(f"corpus {source} is empty: 0 documents.")


def _set_option(option: str, value: str) -> str:
    """How to set ``option``: ``--text-field NAME`` for a flag, ``data.text_field: NAME`` for a config key."""
    return f"{option} {value}" if option.startswith("-") else f"{option}: {value}"


def _check_text_feature(features: dict, source, text_field: str, option: str) -> None:
    """``features``: column name -> ``datasets`` feature (or a pyarrow type, or a Python type for JSON)."""
    if text_field not in features:
        names = ", ".join(features) or "(none)"
        raise DataError(
            f"corpus {source} has no text field {text_field!r}; its fields are {names}. "
            f"Fix: {_set_option(option, 'NAME')} naming the text field."
        )
    feature = features[text_field]
    if isinstance(feature, Value):
        text = feature.dtype in ("string", "large_string")
    elif isinstance(feature, pa.DataType):
        text = pa.types.is_string(feature) or pa.types.is_large_string(feature)
    else:  # a Python type, from a JSON row (null: no text in this row, read as empty)
        text = feature in (str, type(None))
    if not text:
        shown = feature.__name__ if isinstance(feature, type) else feature
        raise DataError(
            f"field {text_field!r} of corpus {source} holds {shown}, not text. "
            f"Fix: {_set_option(option, 'NAME')} naming a string field."
        )


# ---------------------------------------------------------------------------------------------
# Tokenizer and identities


def load_tokenizer(tokenizer, option: str = "tokenizer"):
    """A tokenizer object as given, or ``AutoTokenizer.from_pretrained`` of a name or path (never running a
    repository's custom code). ``option``: the setting named in errors (``data.tokenizer``, ``--tokenizer``)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    name = os.fspath(tokenizer)
    problem = missing_local_path(name)
    if problem:
        raise DataError(f"{option}={name!r}: {problem}. Fix: point it to a folder with the tokenizer files "
                        f"(usually the model's folder) or a hub name such as Qwen/Qwen3-8B.")
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        raise DataError(f"{option}={name!r} is a file; give the folder that holds tokenizer.json / "
                        f"tokenizer_config.json (usually the model's folder).")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as exc:
        text = one_line(exc)
        if os.path.isdir(path):
            reason = ("it asks for custom tokenizer code, which is never run (trust_remote_code stays off)"
                      if "trust_remote_code" in text else f"the folder holds no usable tokenizer ({text})")
        else:
            reason = text + "." + partial_local_path_note(name)
        raise DataError(f"cannot load {option}={name!r}: {reason}. Fix: point it to the model's own tokenizer "
                        f"(a folder with tokenizer.json, or a hub name).") from None


def _eos_id(tokenizer) -> int:
    eos_id = getattr(tokenizer, "eos_token_id", None)
    if eos_id is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"tokenizer {name!r} has no EOS token; packing puts EOS after every document so the "
            f"model sees where one ends. Fix: use the model's own tokenizer, or set "
            f"tokenizer.eos_token to a token of its vocabulary."
        )
    return int(eos_id)


def tokenizer_identity(tokenizer) -> dict:
    """Name plus a hash of the full tokenizer definition (vocab, merges, normalizer, ...).

    ``truncation`` and ``padding`` are left out: they are call-time state that changes when the
    tokenizer is used elsewhere, and they do not change the ids produced here.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("truncation", None)
        definition.pop("padding", None)
    else:
        definition = sorted(tokenizer.get_vocab().items())
    return {
        "name_or_path": getattr(tokenizer, "name_or_path", ""),
        "class": type(tokenizer).__name__,
        "definition_sha256": _hash(definition),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
    }


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


# ---------------------------------------------------------------------------------------------
# Small helpers


def _check_lengths(seq_length, pad_multiple, names=("seq_length", "pad_multiple")) -> None:
    """``names``: what the caller's user calls the two (``data.seq_length`` and
    ``parallel.sequence_parallel_size`` in a run config)."""
    for name, value in zip(names, (seq_length, pad_multiple)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise DataError(f"{name} must be a positive whole number, got {value!r}.")
    if seq_length % pad_multiple:
        raise DataError(
            f"{names[0]}={seq_length:,} is not a multiple of {names[1]}={pad_multiple} (the "
            f"sequence-parallel size, or 2x it): every sp rank must hold an equal slice. Fix: "
            f"{names[0]}={nearest_multiples(seq_length, pad_multiple)}."
        )


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _visible_files(folder: Path) -> list[Path]:
    """Files under ``folder`` in sorted path order, skipping hidden names (broken links included)."""
    found = []
    for path in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if not hidden and not path.is_dir():
            found.append(path)
    return found


def _useful_procs(num_proc: int | None, items: int) -> int | None:
    """No more processes than items to share out; None when only one is useful.

    None, not 1: ``datasets`` runs ``num_proc=1`` in a forked worker, where the fast tokenizer
    turns its own threads off, so one process in place is faster than one worker.
    """
    if not num_proc or num_proc <= 1 or items <= 1:
        return None
    return min(num_proc, items)


@contextmanager
def _staging(final: Path):
    """Yield a private temp folder next to ``final``; rename it to ``final`` when the block ends.

    Rename is atomic, so ``final`` existing means complete. If another process renamed its own
    copy first, ours is discarded.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; others sharing the cache must read it
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_arrow_folder(folder: Path) -> Dataset:
    """All ``*.arrow`` files of a stage folder, in name order (shard order when num_proc > 1)."""
    files = sorted(folder.glob("*.arrow"))
    parts = [Dataset.from_file(str(path)) for path in files]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _data_error_in(exc: BaseException) -> DataError | None:
    """A DataError raised inside ``datasets`` (e.g. by our text reader) wrapped in its own error."""
    while exc is not None:
        if isinstance(exc, DataError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def _distributed_barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _build_options(options: dict) -> dict:
    """``build_packed_dataset`` keyword options, checked so a typo fails on every rank alike."""
    allowed = {"pad_multiple", "text_field", "drop_last", "cache_dir", "num_proc", "split", "text_field_option"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"unknown options {unknown}; allowed: {sorted(allowed)}")
    return options
