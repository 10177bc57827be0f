"""Corpus -> tokens -> long packed sequences, cached on disk as arrow.

Long-context training reads a few very long sequences per step, built from a corpus of long
documents (such as PG-19's books): documents glued end to end, each followed by the tokenizer's EOS, cut into sequences of
exactly ``seq_length`` tokens. Nothing may be lost or duplicated on the way, so packing is one
sequential pass over one token stream, and the last partial sequence is padded (labels -100 on
the padding) or dropped, by choice. ``seq_length`` must be a multiple of the sequence-parallel
size (``pad_multiple``) because every sp rank holds an equal slice.

Two cache stages, each in a folder named by a hash of what decides its content:

- ``tokens-<hash>``: one row of ``input_ids`` per document; keyed by the corpus (path, file
  sizes and content digests, text field, split: ``fingerprint.py``) and the tokenizer (name and a hash of its
  full definition).
  Re-packing at another length reuses it.
- ``packed-<hash>``: ``input_ids`` and ``labels`` of exactly ``seq_length``; keyed by the tokens
  stage, ``seq_length``, ``drop_last`` and the pad id; ``summary.json`` holds the counts.

Each stage is written into a private temporary folder and renamed into place when complete, so
an interrupted run never leaves a half-written cache that a later run would trust.

Entry points: ``build_packed_dataset`` (one process), ``prepare_or_wait`` (one rank prepares,
the others wait), ``sample_order`` (the deterministic, resumable order), ``check_data_inputs`` (cheap checks
before anything is built). Reading sources is ``sources.py``'s, the tokenizer ``tokenizer.py``'s, the packing
pass ``packing.py``'s.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from datasets import Dataset, Features, List, Value, concatenate_datasets

from ulysses_train.user_input import nearest_multiples
from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.data.document_packing import pack_documents
from ulysses_train.data.fingerprint import content_identity
from ulysses_train.data.form import DataForm
from ulysses_train.data.packing import PackingSummary, pack, staging
from ulysses_train.data.row_checks import bad_bytes_error, check_rows
from ulysses_train.data.sessions import check_chat_template, render_sessions
from ulysses_train.data.sources import (DataError, check_first_rows, content_hash, corpus_identity, load_corpus,
                                        resolve_source, useful_procs)
from ulysses_train.data.tokenizer import eos_token_id, load_tokenizer, tokenizer_identity

CACHE_FORMAT = 1  # bump when the cached layout or packing rule changes


CACHE_ENV = "ULYSSES_TRAIN_DATA_CACHE"


def default_cache_dir() -> Path:
    """Where prepared data lives unless data.cache_dir / --cache-dir say otherwise: one place, so what
    prepare_data.py prepares the trainer finds. $ULYSSES_TRAIN_DATA_CACHE moves it (e.g. to a shared filesystem);
    read when asked, not at import, so a process that imported the package before its environment was set (a
    forked worker) still follows it."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/ulysses_train/data").expanduser()


TOKENIZE_BATCH_DOCUMENTS = 64


def build_packed_dataset(
    source: str | os.PathLike,
    tokenizer,
    seq_length: int,
    pad_multiple: int = 1,
    form: DataForm = DataForm(),
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    split: str = "train",
) -> tuple[Dataset, PackingSummary]:
    """Packed sequences of ``seq_length`` tokens from ``source``, prepared once and cached.

    ``source``: a folder of .txt files (one document per file, sorted by path), a .jsonl/.json or
    .parquet file or a folder of them, a folder written by ``Dataset.save_to_disk``, or a hub dataset name
    such as ``deepmind/pg19`` (``split``).
    ``tokenizer``: a name/path for ``AutoTokenizer`` or a tokenizer object; it must have an EOS (and, for
    chat sessions, a chat template).
    ``pad_multiple``: the sequence-parallel size (or 2*sp); ``seq_length`` must be a multiple.
    ``form``: which column holds the documents (text or chat messages), what is learned, and how documents
    are packed (``data/form.py``).
    ``num_proc``: processes for reading and tokenizing (``None``: one process, whose fast
    tokenizer still uses several threads).

    Returns the dataset (numpy format, rows in storage order; use ``sample_order`` for the
    shuffled, resumable order) and its summary. Raises ``DataError`` on unusable input.
    """
    return _build(source, tokenizer, seq_length, pad_multiple, form, cache_dir, num_proc, split, may_prepare=True)


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
    and each evaluation length is a multiple of it, that a local corpus exists, that its text (or messages)
    field is there (from the first row of a .jsonl file, the schema of a .parquet file, or the features of a
    saved dataset; .json files and hub datasets are checked when loaded), that the tokenizer loads and has
    an EOS token (and a chat template for chat data), and the rows themselves as far as that is cheap
    (row_checks.py: every row of a small corpus, the first and last rows of a large one, chat sessions rendered).
    The demo source needs none of this. Raises ``DataError`` naming the setting and the fix.
    """
    check_data_lengths(data_cfg, pad_multiple, eval_lengths)
    check_data_sources(data_cfg, model_name_or_path)


def check_data_lengths(data_cfg, pad_multiple: int, eval_lengths=()) -> None:
    """data.seq_length and every evaluation length a multiple of the sequence-parallel size (a corpus only)."""
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


def check_data_sources(data_cfg, model_name_or_path: str) -> int:
    """The corpus, its document field and the tokenizer (see check_data_inputs), without the lengths; the tokenizer's
    token count (len: its vocabulary and added tokens), for check_vocabulary_fits once the model's config is read."""
    if data_cfg.source == "demo":
        return 0
    form = DataForm.from_config(data_cfg)
    kind, files = resolve_source(data_cfg.source)
    check_first_rows(kind, files, data_cfg.source, form)
    if data_cfg.tokenizer:
        tokenizer = load_tokenizer(data_cfg.tokenizer, option="data.tokenizer")
    else:
        try:
            tokenizer = load_tokenizer(model_name_or_path, option="model.name_or_path")
        except DataError as exc:
            raise DataError(f"{exc} (data.tokenizer is empty, so the model's tokenizer is used; set data.tokenizer "
                            f"to load another.)") from None
    check_corpus_rows(data_cfg.source, form, tokenizer, data_cfg.seq_length, checked=(kind, files))
    return len(tokenizer)


def check_corpus_rows(source, form: DataForm, tokenizer, seq_length: int, checked=None) -> None:
    """The tokenizer's EOS (and chat template) and the corpus's rows (row_checks.check_rows), as the trainer checks
    them before its process group and prepare_data.py before preparing: both name the same file and line (1-based)
    for a row's mistake. `checked`: (kind, files) whose first rows check_first_rows has read already."""
    kind, files = checked or resolve_source(source)
    if checked is None:
        check_first_rows(kind, files, source, form)
    eos_token_id(tokenizer)
    if form.chat:
        check_chat_template(tokenizer, form.option("format"))
    check_rows(kind, files, source, form, tokenizer, seq_length)


def cache_dir_for(data_cfg) -> Path:
    """The cache folder of a run's data: data.cache_dir, else default_cache_dir() (prepare_data.py's default too)."""
    return Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()


def prepare_run_data(data_cfg, model_name_or_path: str, seq_length: int, pad_multiple: int, **overrides):
    """A run's packed data (prepare_or_wait with the run config's data section): the trainer's and the
    evaluation's one way to it, so both find the same cache. ``overrides``: e.g. ``form`` for evaluation."""
    options = {"form": DataForm.from_config(data_cfg), "cache_dir": cache_dir_for(data_cfg),
               "num_proc": data_cfg.num_proc, **overrides}
    return prepare_or_wait(data_cfg.source, data_cfg.tokenizer or model_name_or_path, seq_length,
                           is_main_process=int(os.environ.get("LOCAL_RANK", 0)) == 0, pad_multiple=pad_multiple,
                           **options)


def sample_order(num_samples: int, seed: int, epoch: int = 0) -> np.ndarray:
    """Order in which to read the samples in ``epoch``: a permutation fixed by (seed, epoch).

    A pure function, so a resumed run recomputes exactly the order it was in, and each epoch
    gets a different order.
    """
    if num_samples < 0:
        raise DataError(f"num_samples must be >= 0, got {num_samples}.")
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def _build(source, tokenizer, seq_length, pad_multiple=1, form=DataForm(), cache_dir=None,
           num_proc=None, split="train", *, may_prepare: bool) -> tuple[Dataset, PackingSummary]:
    """Find the packed cache for these inputs, preparing whatever stage is missing if allowed (`cache_dir` None:
    default_cache_dir())."""
    _check_lengths(seq_length, pad_multiple)
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    # before the tokenizer: a wrong path fails at once; keyed on content, not mtimes (fingerprint.py)
    corpus = content_identity(corpus_identity(source, split), Path(cache_dir).expanduser())
    tokenizer = load_tokenizer(tokenizer)
    eos_id = eos_token_id(tokenizer)
    if form.chat:
        check_chat_template(tokenizer, form.option("format"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    cache_dir = Path(cache_dir).expanduser()
    tokens_dir = cache_dir / f"tokens-{content_hash(_tokens_identity(corpus, tokenizer, form))}"
    packed_key = content_hash({"tokens": tokens_dir.name.removeprefix("tokens-"), "seq_length": seq_length,
                               "pad_id": pad_id, **form.packing_identity()})
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
        tokens, tokenize_seconds = _tokenized_documents(source, tokenizer, form, split, num_proc, tokens_dir)
        _pack(tokens, str(source), seq_length, eos_id, pad_id, form, tokenize_seconds, packed_dir)
    summary = PackingSummary.load(packed_dir / "summary.json")
    summary.cache_path = str(packed_dir)
    summary.reused = reused
    return _load_arrow_folder(packed_dir).with_format("numpy"), summary


def _tokens_identity(corpus: dict, tokenizer, form: DataForm) -> dict:
    """What decides the tokens stage: the corpus, the tokenizer (and its chat template for sessions), the form.
    Text corpora keep the key they had before chat data existed, so their caches stay valid."""
    identity = {"format": CACHE_FORMAT, "corpus": corpus, "text_field": form.text_field,
                "tokenizer": tokenizer_identity(tokenizer)}
    if form.chat:
        identity.update(form.tokens_identity(), chat_template=content_hash(tokenizer.chat_template))
    return identity


def _pack(tokens, source, seq_length, eos_id, pad_id, form: DataForm, tokenize_seconds, packed_dir) -> None:
    """The packed stage, glued or by documents; the summary records the form."""
    if form.packing == "documents":
        pack_documents(tokens, source, seq_length, pad_id, form.too_long, tokenize_seconds, packed_dir,
                       eos_id=None if form.chat else eos_id, format=form.format)
    else:
        separator_label = IGNORE_INDEX if form.learned == "assistant" else eos_id
        pack(tokens, source, seq_length, eos_id, pad_id, form.drop_last, tokenize_seconds, packed_dir,
             separator_label=separator_label, format=form.format)


def _tokenized_documents(source, tokenizer, form: DataForm, split, num_proc, stage_dir):
    """The tokens stage: load it if cached, else read and tokenize (or render, for chat) the corpus into it."""
    if not stage_dir.exists():
        started = time.perf_counter()
        with staging(stage_dir) as tmp:
            corpus = load_corpus(source, form, split, cache_dir=tmp / "raw", num_proc=num_proc)
            try:
                if form.chat:
                    render_sessions(corpus, tokenizer, form.messages_field, form.learned, tmp / "tokens.arrow",
                                    num_proc, stage_dir.name, source)
                else:
                    tokenize_documents(corpus, tokenizer, form.text_field, tmp / "tokens.arrow", num_proc,
                                       stage_dir.name)
            except UnicodeDecodeError as err:  # the JSON reader keeps bad bytes; decoding a row meets them
                raise bad_bytes_error(source, err) from None
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
        num_proc=useful_procs(num_proc, len(corpus)),
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


def _load_arrow_folder(folder: Path) -> Dataset:
    """All ``*.arrow`` files of a stage folder, in name order (shard order when num_proc > 1)."""
    files = sorted(folder.glob("*.arrow"))
    parts = [Dataset.from_file(str(path)) for path in files]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _distributed_barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _build_options(options: dict) -> dict:
    """``build_packed_dataset`` keyword options, checked so a typo fails on every rank alike."""
    allowed = {"pad_multiple", "form", "cache_dir", "num_proc", "split"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"unknown options {unknown}; allowed: {sorted(allowed)}")
    return options
