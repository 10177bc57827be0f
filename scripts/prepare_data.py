"""Tokenize and pack a corpus into long sequences once, before training (cached on disk).

Launch (after ``pip install -e .``), e.g. PG-19 books glued into 1M-token sequences for sp=8:

    python scripts/prepare_data.py --source deepmind/pg19 --tokenizer Qwen/Qwen3-8B \\
        --seq-length 1048576 --pad-multiple 8 --num-proc 16 --cache-dir /shared/ulysses_data

    python scripts/prepare_data.py --source ./books --tokenizer ./my_model --seq-length 131072

Agent sessions (rows of {"messages": [...]}) packed whole, loss on the assistant turns:

    python scripts/prepare_data.py --source sessions.jsonl --tokenizer Qwen/Qwen3-8B --format chat \\
        --packing documents --seq-length 1048576 --pad-multiple 8

``--source``: a folder of .txt files, a .jsonl/.json/.parquet file or folder of them, a folder
written by ``Dataset.save_to_disk``, or a hub dataset name. Training with the same options and
``--cache-dir`` (default: the trainer's, ~/.cache/ulysses_train/data) finds the result without
re-tokenizing. Prints the summary (documents, tokens, sequences, padding share, tokens/s). Unusable input: one-line message on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import time

from ulysses_train.cli import report_user_errors, run_script
from ulysses_train.config import DATA_FORMATS, LOSS_ON, PACKING_MODES, TOO_LONG_RULES
from ulysses_train.data.corpus import (CACHE_ENV, DataError, build_packed_dataset, check_corpus_rows,
                                       default_cache_dir)
from ulysses_train.data.tokenizer import load_tokenizer
from ulysses_train.data.form import DataForm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Tokenize a corpus and pack it into sequences of --seq-length tokens.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--source", required=True,
                        help="folder of .txt, .jsonl/.json/.parquet file or folder, a save_to_disk "
                             "folder, or a hub dataset name (e.g. deepmind/pg19)")
    parser.add_argument("--tokenizer", required=True,
                        help="tokenizer name or path for AutoTokenizer (usually the model's)")
    parser.add_argument("--seq-length", type=int, required=True,
                        help="tokens per packed sequence; a multiple of --pad-multiple")
    parser.add_argument("--pad-multiple", type=int, default=1,
                        help="sequence-parallel size (or 2x it) that --seq-length must divide by")
    parser.add_argument("--text-field", default="text",
                        help="column holding the document text (JSON, Parquet, saved, hub)")
    parser.add_argument("--format", default="text", choices=DATA_FORMATS,
                        help="text: one document per row; chat: rows of messages rendered with the chat template")
    parser.add_argument("--messages-field", default="messages", help="--format chat: column holding the messages")
    parser.add_argument("--loss-on", default="auto", choices=LOSS_ON,
                        help="auto: assistant for chat, all for text; assistant: labels on assistant turns only")
    parser.add_argument("--packing", default="glue", choices=PACKING_MODES,
                        help="glue: documents end to end with EOS; documents: whole documents per sequence, "
                             "each attending only to itself (train with attn_implementation fa4/flash_attention_2)")
    parser.add_argument("--too-long", default="split", choices=TOO_LONG_RULES,
                        help="--packing documents: what happens to a document longer than --seq-length")
    parser.add_argument("--split", default="train", help="split of a hub or saved DatasetDict")
    parser.add_argument("--num-proc", type=int, default=None,
                        help="processes for reading and tokenizing; unset: one process, "
                             "which still uses the fast tokenizer's threads")
    parser.add_argument("--cache-dir", default=str(default_cache_dir()),
                        help=f"where the tokenized and packed arrow files are kept (the trainer's default too; "
                             f"${CACHE_ENV} moves it)")
    parser.add_argument("--drop-last", action="store_true",
                        help="drop the last partial sequence instead of padding it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return report_user_errors(lambda: prepare(args))


def prepare(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        form = DataForm(format=args.format, text_field=args.text_field, messages_field=args.messages_field,
                        loss_on=args.loss_on, packing=args.packing, too_long=args.too_long,
                        drop_last=args.drop_last, flags=True)
        tokenizer = load_tokenizer(args.tokenizer, option="--tokenizer")
        check_corpus_rows(args.source, form, tokenizer, args.seq_length)  # the trainer's checks: file and line
        _, summary = build_packed_dataset(args.source, tokenizer, args.seq_length,
                                          pad_multiple=args.pad_multiple, form=form, cache_dir=args.cache_dir,
                                          num_proc=args.num_proc, split=args.split)
    except OSError as exc:  # reading is reported as DataError; this is the cache folder
        raise DataError(f"cannot write the cache under --cache-dir {args.cache_dir}: {exc.strerror or exc} "
                        f"({exc.filename}). Fix: a --cache-dir you can write to.") from None
    elapsed = time.perf_counter() - started
    print(summary)
    if summary.reused:
        print(f"reused the cache in {elapsed:.1f} s (tokens/s above: when it was prepared)")
    else:
        rate = summary.document_tokens / elapsed if elapsed > 0 else float("nan")
        print(f"prepared in {elapsed:.1f} s: {rate:,.0f} tokens/s end to end")
    return 0


if __name__ == "__main__":
    run_script(main)
