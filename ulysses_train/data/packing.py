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


def pack(tokens, source, seq_length, eos_id, pad_id, drop_last, tokenize_seconds, stage_dir):
    """The packed stage: one pass over the token stream, cut into rows of ``seq_length``."""
    started = time.perf_counter()
    with staging(stage_dir) as tmp:
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
