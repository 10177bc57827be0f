"""One sequential pass that glues tokenized documents, each followed by EOS, into rows of exactly `seq_length`
tokens, pads or drops the tail, and counts every token (`PackingSummary`); stages are written into a private
folder and renamed into place when complete."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, Features, List, Value
from datasets.arrow_writer import ArrowWriter
from tqdm.auto import tqdm

from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.data.sources import DataError

PACK_BATCH_DOCUMENTS = 256


@dataclass
class PackingSummary:
    """What went in and what came out; printed after preparation and saved with the cache.

    Every token of the corpus is accounted for: ``document_tokens`` = tokens packed + ``dropped_tokens`` +
    ``truncated_tokens`` (the separators and padding are added on top). For chat sessions ``empty_documents``
    counts the sessions skipped: those without an assistant turn and the ``unlabelled_sessions``."""

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
    packing: str = "glue"
    format: str = "text"
    label_tokens: int = 0
    """Labels (tokens learned) in the packed sequences."""
    split_documents: int = 0
    """packing documents: documents longer than seq_length cut into pieces (too_long: split)."""
    split_lost_labels: int = 0
    """Labels lost where a document was split: a piece's first token has no earlier token to predict it from."""
    truncated_documents: int = 0
    truncated_tokens: int = 0
    dropped_documents: int = 0
    """packing documents: documents longer than seq_length left out (too_long: drop); their tokens are in
    dropped_tokens."""
    unlabelled_sessions: int = 0
    """Chat sessions skipped because their assistant turns could not be located (sessions.UnlabelledSession)."""

    @property
    def padding_share(self) -> float:
        """Share of the packed tokens that are padding (0 when nothing was packed)."""
        total = self.sequences * self.seq_length
        return self.padding_tokens / total if total else 0.0

    def repeats_notice(self, sequences_per_step: int, steps: int) -> str | None:
        """One line when the whole corpus is less than one sequence (its tokens, and how often the run trains that
        one padded sequence again), else None: a run on 5 tokens should not pass for training on a corpus."""
        held = self.document_tokens + self.separator_tokens - self.dropped_tokens - self.truncated_tokens
        if self.sequences != 1 or held >= self.seq_length:
            return None
        return (f"note: corpus {self.source} holds {held:,} tokens, less than one sequence of {self.seq_length:,} "
                f"({self.padding_tokens:,} tokens of it padding): every step trains that one sequence again, "
                f"{sequences_per_step * steps:,} times in train.steps={steps:,}")

    @property
    def tokens_per_second(self) -> float:
        """Document tokens per second of preparation (reading, tokenizing and packing)."""
        seconds = self.tokenize_seconds + self.pack_seconds
        return self.document_tokens / seconds if seconds > 0 else float("nan")

    def __str__(self) -> str:
        skipped = f"{self.empty_documents:,} empty, skipped"
        if self.format == "chat":
            skipped = f"{self.empty_documents - self.unlabelled_sessions:,} without an assistant turn, skipped"
            if self.unlabelled_sessions:
                skipped += f"; {self.unlabelled_sessions:,} whose turns could not be located, skipped"
        rows = [
            ("source", self.source),
            ("documents", f"{self.documents:,} ({skipped})"),
            ("document tokens", f"{self.document_tokens:,} ({self.label_tokens:,} labels in the sequences)"),
            ("packing", self._packing_row()),
            ("sequences", f"{self.sequences:,} x {self.seq_length:,} tokens"),
            ("padding", f"{self.padding_tokens:,} tokens ({self.padding_share:.2%})"),
            *self._long_document_rows(),
            (
                "preparation",
                f"{self.tokenize_seconds:.1f} s tokenize + {self.pack_seconds:.1f} s pack, "
                f"{self.tokens_per_second:,.0f} tokens/s",
            ),
            ("cache", f"{self.cache_path}{' (reused)' if self.reused else ''}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)

    def _packing_row(self) -> str:
        if self.packing == "glue":
            return f"glued end to end, {self.separator_tokens:,} EOS separators"
        return "whole documents per sequence, each attending only to itself"

    def _long_document_rows(self) -> list[tuple[str, str]]:
        if self.packing == "glue":
            return [("dropped (drop_last)", f"{self.dropped_tokens:,} tokens")]
        return [
            ("longer than seq_length", f"{self.split_documents:,} split ({self.split_lost_labels:,} labels lost at "
                                       f"the cuts), {self.truncated_documents:,} truncated ({self.truncated_tokens:,} "
                                       f"tokens cut), {self.dropped_documents:,} dropped ({self.dropped_tokens:,} "
                                       f"tokens)"),
        ]

    def save(self, path: Path) -> None:
        data = asdict(self)
        data.pop("reused")
        path.write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: Path) -> "PackingSummary":
        return cls(**json.loads(path.read_text()))


def pack(tokens, source, seq_length, eos_id, pad_id, drop_last, tokenize_seconds, stage_dir,
         separator_label: int | None = None, format: str = "text"):
    """The packed stage: one pass over the token stream, cut into rows of ``seq_length``.

    ``tokens``: one row per document, ``input_ids`` and, for chat sessions, ``labels``. ``separator_label``:
    the label of the EOS after each document (default: EOS itself, learned; IGNORE_INDEX when only assistant
    turns are learned). ``format``: text or chat, for the summary."""
    started = time.perf_counter()
    separator_label = eos_id if separator_label is None else separator_label
    with staging(stage_dir) as tmp:
        path = str(tmp / "packed.arrow")
        with ArrowWriter(features=packed_features(seq_length), path=path) as writer:
            counts = _write_sequences(writer, tokens, seq_length, (eos_id, separator_label), pad_id, drop_last,
                                      source)
            writer.finalize()
        summary = PackingSummary(
            source=source,
            seq_length=seq_length,
            tokenize_seconds=tokenize_seconds,
            pack_seconds=time.perf_counter() - started,
            format=format,
            **counts,
        )
        summary.save(tmp / "summary.json")


def _write_sequences(writer, tokens, seq_length, separator, pad_id, drop_last, source) -> dict:
    """Cut the stream into full rows as it arrives; then pad or drop the remainder."""
    counts = {"documents": 0, "empty_documents": 0, "document_tokens": 0, "sequences": 0, "label_tokens": 0,
              "unlabelled_sessions": 0}
    pieces, held = [], 0  # joined only once a full row is there, so each token is copied ~twice
    for stream in _documents_with_eos(tokens, separator, counts):
        pieces.append(stream)
        held += stream.shape[1]
        if held >= seq_length:
            joined = np.concatenate(pieces, axis=1)
            full = joined.shape[1] // seq_length
            rows = joined[:, : full * seq_length].reshape(2, full, seq_length)
            counts["label_tokens"] += write_rows(writer, rows[0], rows[1])
            pieces = [joined[:, full * seq_length:]]
            held = pieces[0].shape[1]
            counts["sequences"] += full
    tail = np.concatenate(pieces, axis=1) if pieces else np.empty((2, 0), dtype=np.int32)
    if counts["documents"] == 0:
        raise_no_documents(source, counts["empty_documents"], "labels" in tokens.column_names,
                           counts["unlabelled_sessions"])
    padding, dropped = _finish_tail(writer, tail, seq_length, pad_id, drop_last, counts)
    if counts["sequences"] == 0:
        raise_too_short(source, tail.shape[1], seq_length)
    counts.update(separator_tokens=counts["documents"], padding_tokens=padding, dropped_tokens=dropped)
    return counts


def raise_no_documents(source, empty: int, chat: bool, unlabelled: int = 0) -> None:
    """Nothing to train on: every row empty (text) or without an assistant turn or unlabelled (chat sessions)."""
    if chat and unlabelled:
        raise DataError(f"corpus {source}: no session could be labelled ({empty:,} sessions skipped, {unlabelled:,} "
                        f"of them because this chat template's assistant turns could not be located), so nothing "
                        f"would be learned. Fix: loss_on: all, or a template with {{% generation %}} markers.")
    if chat:
        raise DataError(f"corpus {source} has no session with an assistant turn ({empty:,} sessions, all skipped), "
                        f"so nothing would be learned. Fix: sessions with assistant turns, or loss_on: all.")
    raise DataError(f"corpus {source} has no text: all {empty:,} documents are empty after tokenization.")


def raise_too_short(source, tokens: int, seq_length: int) -> None:
    """drop_last with fewer tokens than one sequence: nothing is left."""
    raise DataError(f"corpus {source} has {tokens:,} tokens, fewer than seq_length={seq_length:,}, and drop_last is "
                    f"set, so no sequence is left. Fix: drop_last=False (pad it) or a shorter seq_length.")


def _document_batches(tokens: Dataset, counts: dict) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(lengths, input ids, labels) of the tokenized documents, a batch at a time (flattened ids; labels are
    the ids when the stage has no labels column), with a progress bar. Counts documents, empty ones and
    their tokens into ``counts``."""
    batches = tokens.with_format("arrow").iter(batch_size=PACK_BATCH_DOCUMENTS)
    total = -(-len(tokens) // PACK_BATCH_DOCUMENTS)
    for table in tqdm(batches, total=total, desc="Packing", unit="batch"):
        lengths = pc.list_value_length(table["input_ids"]).to_numpy()
        ids = pc.list_flatten(table["input_ids"]).to_numpy().astype(np.int32, copy=False)
        labels = (pc.list_flatten(table["labels"]).to_numpy().astype(np.int32, copy=False)
                  if "labels" in table.column_names else ids)
        counts["documents"] += int((lengths > 0).sum())
        counts["empty_documents"] += int((lengths == 0).sum())
        counts["unlabelled_sessions"] += unlabelled_count(table)
        counts["document_tokens"] += len(ids)
        yield lengths, ids, labels


def unlabelled_count(table: pa.Table) -> int:
    """Sessions of a tokens-stage batch skipped as unlabelled (stages written before the column: none)."""
    if "unlabelled" not in table.column_names:
        return 0
    return int(pc.sum(table["unlabelled"]).as_py() or 0)


def _documents_with_eos(tokens: Dataset, separator: tuple[int, int], counts: dict) -> Iterator[np.ndarray]:
    """The token stream as a [2, n] array (ids, labels), a batch of documents at a time: each non-empty
    document followed by the separator (EOS and its label)."""
    for lengths, ids, labels in _document_batches(tokens, counts):
        ends = np.cumsum(lengths)[lengths > 0]
        yield np.stack([np.insert(ids, ends, separator[0]), np.insert(labels, ends, separator[1])])


def _finish_tail(writer, tail, seq_length, pad_id, drop_last, counts) -> tuple[int, int]:
    """Pad the last partial sequence (labels -100 on padding) or drop it; returns (padding, dropped)."""
    if tail.shape[1] == 0:
        return 0, 0
    if drop_last:
        return 0, tail.shape[1]
    padding = seq_length - tail.shape[1]
    ids = np.concatenate([tail[0], np.full(padding, pad_id, dtype=np.int32)])
    labels = np.concatenate([tail[1], np.full(padding, IGNORE_INDEX, dtype=np.int32)])
    counts["label_tokens"] += write_rows(writer, ids.reshape(1, seq_length), labels.reshape(1, seq_length))
    counts["sequences"] += 1
    return padding, 0


def write_rows(writer: ArrowWriter, ids: np.ndarray, labels: np.ndarray, document_lengths=None) -> int:
    """Append rows of token ids and their labels ([rows, seq_length] each), and for document packing each
    row's document lengths (a list of arrays); returns the number of labels written."""
    width = ids.shape[1]
    columns = {
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), width),
        "labels": pa.FixedSizeListArray.from_arrays(pa.array(labels.ravel()), width),
    }
    if document_lengths is not None:
        columns["document_lengths"] = pa.array([np.asarray(row, dtype=np.int32) for row in document_lengths],
                                               type=pa.list_(pa.int32()))
    writer.write_table(pa.table(columns))
    return int(np.count_nonzero(labels != IGNORE_INDEX))


def packed_features(seq_length: int, documents: bool = False) -> Features:
    columns = {
        "input_ids": List(Value("int32"), length=seq_length),
        "labels": List(Value("int32"), length=seq_length),
    }
    if documents:
        columns["document_lengths"] = List(Value("int32"))
    return Features(columns)


@contextmanager
def staging(final: Path):
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
