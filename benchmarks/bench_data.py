"""Real-size data preparation: read, tokenize and pack >= 50 MB of text, report tokens/s.

Nothing can be downloaded here, so the text is the Python source that ships with this
interpreter (the standard library, then installed packages, in sorted path order, one file per
document, copied into a folder of .txt files like a book corpus) and the tokenizer is a
byte-level BPE trained on the first part of it. Each setting runs on a fresh cache; a last run
repeats the first setting to time cache reuse.

    python benchmarks/bench_data.py --megabytes 64 --seq-length 131072 --pad-multiple 8 \\
        --num-proc 1 2 --json outputs/bench_data.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from ulysses_train.data import corpus as data
from ulysses_train.data.corpus import build_packed_dataset


def collect_text(folder: Path, megabytes: float) -> tuple[int, int]:
    """Copy .py files (stdlib first, then site-packages) into ``folder`` as .txt until the size
    is reached; returns (files, bytes). Files that are not UTF-8 are skipped."""
    target = int(megabytes * 1e6)
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    folder.mkdir(parents=True)
    copied = total = 0
    seen = set()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if total >= target:
                return copied, total
            real = path.resolve()
            if real in seen or not path.is_file():
                continue
            seen.add(real)
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            (folder / f"{copied:06d}.txt").write_text(text, encoding="utf-8")
            copied += 1
            total += len(text.encode("utf-8"))
    if total < target:
        raise SystemExit(f"only {total / 1e6:.1f} MB of .py text found, wanted {megabytes} MB")
    return copied, total


def train_tokenizer(folder: Path, vocab_size: int, train_megabytes: float, out: Path) -> int:
    """Byte-level BPE trained on the first ``train_megabytes`` of the corpus, with an EOS, saved
    to ``out`` (runs are given the path, like ``--tokenizer``); returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        budget = train_megabytes * 1e6
        for path in sorted(folder.glob("*.txt")):
            if budget <= 0:
                return
            text = path.read_text(encoding="utf-8")
            budget -= len(text)
            yield text

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(out)
    return len(tokenizer)


def in_fresh_process(function, *args):
    """Run ``function(*args)`` in a new interpreter: each run starts like a user's command, with
    no tokenizer thread pool already used (the fast tokenizer turns its threads off in workers
    forked after that) and nothing left in memory from the previous run."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def timed_build(corpus, tokenizer, seq_length, pad_multiple, cache_dir, num_proc) -> dict:
    """One ``build_packed_dataset`` call, timed from loading the tokenizer to the returned data."""
    load_before = os.getloadavg()[0]
    cpu_before = os.times()
    started = time.perf_counter()
    dataset, summary = build_packed_dataset(
        corpus, tokenizer, seq_length, pad_multiple=pad_multiple,
        cache_dir=cache_dir, num_proc=num_proc,
    )
    wall = time.perf_counter() - started
    cpu_after = os.times()
    cpu = sum(after - before for after, before in zip(cpu_after[:4], cpu_before[:4]))
    read_started = time.perf_counter()
    first = dataset[0]["input_ids"]
    read_seconds = time.perf_counter() - read_started
    assert len(first) == seq_length
    return {
        "num_proc": num_proc or 1,
        "reused_cache": summary.reused,
        "wall_seconds": round(wall, 3),
        "tokenize_seconds": round(summary.tokenize_seconds, 3),
        "pack_seconds": round(summary.pack_seconds, 3),
        "tokens_per_second": round(summary.document_tokens / wall),
        "documents": summary.documents,
        "empty_documents": summary.empty_documents,
        "document_tokens": summary.document_tokens,
        "sequences": summary.sequences,
        "padding_share": round(summary.padding_share, 6),
        "read_one_sample_seconds": round(read_seconds, 4),
        "cpu_seconds": round(cpu, 2),  # this process and its workers, user + system
        "tokens_per_cpu_second": round(summary.document_tokens / cpu) if cpu > 0 else None,
        "load_average_before": round(load_before, 2),  # >0.5 means other work shared the cores
    }


def print_table(rows: list[dict]) -> None:
    columns = ["num_proc", "reused_cache", "wall_seconds", "tokenize_seconds", "pack_seconds",
               "tokens_per_second", "documents", "document_tokens", "sequences", "padding_share",
               "read_one_sample_seconds", "cpu_seconds", "tokens_per_cpu_second",
               "load_average_before"]
    widths = [max(len(c), *(len(f"{row[c]:,}" if isinstance(row[c], int) and not isinstance(
        row[c], bool) else str(row[c])) for row in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        cells = [f"{row[c]:,}" if isinstance(row[c], int) and not isinstance(row[c], bool)
                 else str(row[c]) for c in columns]
        print("  ".join(cell.rjust(w) for cell, w in zip(cells, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=64.0, help="text to prepare")
    parser.add_argument("--seq-length", type=int, default=131_072)
    parser.add_argument("--pad-multiple", type=int, default=8)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--train-megabytes", type=float, default=8.0, help="tokenizer training text")
    parser.add_argument("--json", default="outputs/bench_data.json")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder)")
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_"))
    try:
        started = time.perf_counter()
        files, size = collect_text(workdir / "corpus", args.megabytes)
        print(f"corpus: {files:,} files, {size / 1e6:.1f} MB ({time.perf_counter() - started:.1f} s to copy)")
        started = time.perf_counter()
        tokenizer = str(workdir / "tokenizer")
        vocab = in_fresh_process(
            train_tokenizer, workdir / "corpus", args.vocab_size, args.train_megabytes, Path(tokenizer)
        )
        train_seconds = time.perf_counter() - started
        print(f"tokenizer: byte-level BPE, vocab {vocab:,}, trained in {train_seconds:.1f} s")

        rows = []
        settings = [(n, workdir / f"cache_np{n}") for n in args.num_proc]
        settings.append(settings[0])  # the first setting again: cache reuse
        for num_proc, cache in settings:
            rows.append(in_fresh_process(
                timed_build, workdir / "corpus", tokenizer, args.seq_length, args.pad_multiple,
                cache, num_proc,
            ))
        print_table(rows)

        result = {
            "benchmark": "bench_data",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "versions": _versions(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "corpus": {"files": files, "bytes": size, "kind": "python sources as .txt"},
            "tokenizer": {"kind": "byte-level BPE", "vocab_size": vocab,
                          "train_megabytes": args.train_megabytes, "train_seconds": round(train_seconds, 2)},
            "seq_length": args.seq_length,
            "pad_multiple": args.pad_multiple,
            "tokenize_batch_documents": data.TOKENIZE_BATCH_DOCUMENTS,
            "runs": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _versions() -> dict:
    import datasets
    import pyarrow
    import tokenizers
    import transformers

    return {"datasets": datasets.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "pyarrow": pyarrow.__version__}


if __name__ == "__main__":
    main()
