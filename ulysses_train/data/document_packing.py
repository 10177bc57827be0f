"""Document packing (`data.packing: documents`): whole documents share a sequence of `seq_length` tokens without
attending to each other.

A packed row holds ``input_ids``, ``labels`` and ``document_lengths``: the lengths of its documents in order,
then its padding as one more segment, so they sum to ``seq_length``. The trainer turns them into position ids
that restart at 0 in every document and into the cumulative lengths of variable-length attention
(``parallel.layout.slice_sequence``), so each document sees only itself, exactly as if it ran alone.

Labels: a document's first token carries IGNORE_INDEX. The trainer shifts labels by one, so without that the
last token of a document would learn to predict the first token of the next one, across the boundary.
Nothing inside a document predicts its own first token, so this is what a model run on each document
separately learns. A text document ends with EOS (as in glue packing); a chat session ends where its
template ends it.

A document longer than ``seq_length`` (``too_long``): ``split`` into pieces of ``seq_length`` tokens, each its
own document (the first token of each later piece loses its label: counted); ``truncate`` to its first
``seq_length`` tokens (the rest counted); ``drop`` (counted).

Placement: best-fit decreasing. Pieces are taken longest first (ties in corpus order), each into the open
sequence whose free space fits it most tightly, else a new one. Deterministic, and close to optimal: the
padding share is printed in the summary.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
from datasets.arrow_writer import ArrowWriter
from tqdm.auto import tqdm

from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.data.packing import (PackingSummary, packed_features, raise_no_documents, staging,
                                        unlabelled_count, write_rows)
from ulysses_train.data.sources import DataError

WRITE_BATCH_TOKENS = 1 << 24  # tokens per arrow write: ~128 MB of ids and labels


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, start + length)`` of document ``document`` (its stream: ids, then EOS for text)."""

    document: int
    start: int
    length: int


def pack_documents(tokens, source, seq_length, pad_id, too_long, tokenize_seconds, stage_dir, eos_id=None,
                   format: str = "text") -> None:
    """The packed stage of document packing. ``tokens``: one row per document (``input_ids``, and ``labels`` for
    chat sessions); ``eos_id``: appended to every document (text), or None (chat sessions end themselves)."""
    started = time.perf_counter()
    lengths = _stream_lengths(tokens, eos_id is not None)
    counts = _document_counts(tokens, lengths, eos_id is not None)
    if counts["documents"] == 0:
        raise_no_documents(source, counts["empty_documents"], "labels" in tokens.column_names,
                           counts["unlabelled_sessions"])
    pieces = cut_long_documents(lengths, seq_length, too_long, counts)
    if not pieces:
        raise DataError(f"corpus {source}: all {counts['documents']:,} documents are longer than seq_length="
                        f"{seq_length:,} and too_long is drop, so nothing is left. Fix: too_long split or truncate, "
                        f"or a longer seq_length.")
    sequences = best_fit_decreasing([piece.length for piece in pieces], seq_length)
    with staging(stage_dir) as tmp:
        with ArrowWriter(features=packed_features(seq_length, documents=True), path=str(tmp / "packed.arrow")) as w:
            _write_sequences(w, tokens, pieces, sequences, seq_length, pad_id, eos_id, counts)
            w.finalize()
        PackingSummary(source=source, seq_length=seq_length, tokenize_seconds=tokenize_seconds,
                       pack_seconds=time.perf_counter() - started, packing="documents", format=format,
                       **counts).save(tmp / "summary.json")


def _stream_lengths(tokens, with_eos: bool) -> np.ndarray:
    """Each document's length as packed: its tokens, plus EOS for a non-empty text document."""
    lengths = pc.list_value_length(tokens.with_format("arrow").data.column("input_ids")).to_numpy().astype(np.int64)
    return lengths + ((lengths > 0) if with_eos else 0)


def _document_counts(tokens, lengths: np.ndarray, with_eos: bool) -> dict:
    non_empty = int((lengths > 0).sum())
    return {"documents": non_empty, "empty_documents": len(lengths) - non_empty,
            "document_tokens": int(lengths.sum()) - (non_empty if with_eos else 0),
            "separator_tokens": non_empty if with_eos else 0, "sequences": 0, "padding_tokens": 0,
            "dropped_tokens": 0, "label_tokens": 0, "split_documents": 0, "split_lost_labels": 0,
            "truncated_documents": 0, "truncated_tokens": 0, "dropped_documents": 0,
            "unlabelled_sessions": unlabelled_count(tokens.with_format("arrow").data.table)}


def cut_long_documents(lengths, seq_length: int, too_long: str, counts: dict) -> list[Piece]:
    """The pieces to place: every non-empty document whole, and the long ones split, truncated or dropped by
    ``too_long``, counted into ``counts`` (truncated and dropped tokens include a text document's EOS)."""
    pieces = []
    for document, length in enumerate(int(n) for n in lengths):
        if length == 0:
            continue
        if length <= seq_length:
            pieces.append(Piece(document, 0, length))
        elif too_long == "split":
            counts["split_documents"] += 1
            pieces += [Piece(document, start, min(seq_length, length - start))
                       for start in range(0, length, seq_length)]
        elif too_long == "truncate":
            counts["truncated_documents"] += 1
            counts["truncated_tokens"] += length - seq_length
            pieces.append(Piece(document, 0, seq_length))
        else:
            counts["dropped_documents"] += 1
            counts["dropped_tokens"] += length
    return pieces


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``: longest first, each into the bin with
    the least free space that still fits it. Bins in the order they were opened."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin), sorted; full bins leave it
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[item]
        at = bisect.bisect_left(free, (length, -1))
        if at < len(free):
            space, target = free.pop(at)
        else:
            space, target = capacity, len(bins)
            bins.append([])
        bins[target].append(item)
        if space > length:
            bisect.insort(free, (space - length, target))
    return bins


def _write_sequences(writer, tokens, pieces, sequences, seq_length, pad_id, eos_id, counts) -> None:
    rows_per_write = max(1, WRITE_BATCH_TOKENS // seq_length)
    documents = _DocumentColumns(tokens, eos_id)
    for first in tqdm(range(0, len(sequences), rows_per_write), desc="Packing documents", unit="batch"):
        batch = [_sequence([pieces[i] for i in members], documents, seq_length, pad_id, counts)
                 for members in sequences[first:first + rows_per_write]]
        ids, labels, lengths = zip(*batch)
        counts["label_tokens"] += write_rows(writer, np.stack(ids), np.stack(labels), lengths)
    counts["sequences"] = len(sequences)


def _sequence(pieces, documents, seq_length, pad_id, counts):
    """One packed row: its pieces' ids and labels end to end (each piece's first label IGNORE_INDEX), then
    padding (labels IGNORE_INDEX); and the segment lengths."""
    ids, labels = np.full(seq_length, pad_id, dtype=np.int32), np.full(seq_length, IGNORE_INDEX, dtype=np.int32)
    at = 0
    for piece in pieces:
        ids[at:at + piece.length], labels[at:at + piece.length] = documents.piece(piece)
        if piece.start > 0 and labels[at] != IGNORE_INDEX:
            counts["split_lost_labels"] += 1
        labels[at] = IGNORE_INDEX
        at += piece.length
    counts["padding_tokens"] += seq_length - at
    segments = [piece.length for piece in pieces] + ([seq_length - at] if at < seq_length else [])
    return ids, labels, segments


class _DocumentColumns:
    """A piece's ids and labels (labels are the ids for text; a text document's stream ends with EOS), read as a
    slice of the arrow columns: only the piece's own tokens. Reading the whole document row for every piece made
    a long document's packing quadratic (a 10 MB session split into thousands of pieces read thousands of times)."""

    def __init__(self, tokens, eos_id):
        table = tokens.with_format("arrow").data  # the rows as rendered (no indices mapping: _stream_lengths)
        self.ids = table.column("input_ids")
        self.labels = table.column("labels") if "labels" in tokens.column_names else self.ids
        self.eos_id = eos_id

    def piece(self, piece: Piece) -> tuple[np.ndarray, np.ndarray]:
        return self._slice(self.ids, piece), self._slice(self.labels, piece)

    def _slice(self, column, piece: Piece) -> np.ndarray:
        values = column[piece.document].values
        stored = max(0, min(piece.length, len(values) - piece.start))  # the rest of a text piece is its EOS
        out = values.slice(piece.start, stored).to_numpy(zero_copy_only=False).astype(np.int32)
        return out if stored == piece.length else np.append(out, np.int32(self.eos_id))
