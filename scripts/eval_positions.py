"""Mean loss per position bucket over long sequences, plotted against other runs and the unigram entropy.

    # the pretrained model (trained to 40,960 positions) on PG-19 at 160K, with YaRN (auto: factor 4) and without
    deepspeed --num_gpus 8 scripts/eval_positions.py --config configs/qwen3_8b_1m_8gpu.yaml \
        --checkpoint-or-model Qwen/Qwen3-8B --lengths 160K --bucket 4K --name yarn --out evals/
    deepspeed --num_gpus 8 scripts/eval_positions.py --config configs/qwen3_8b_1m_8gpu.yaml \
        --checkpoint-or-model Qwen/Qwen3-8B --lengths 160K --bucket 4K --name no_yarn \
        --set model.rope_scaling=none --compare yarn=evals/yarn.json --out evals/
    # a fine-tuned run: its exported model (YaRN is in its config.json) at its training length
    deepspeed --num_gpus 8 scripts/eval_positions.py --config configs/qwen3_8b_1m_8gpu.yaml \
        --checkpoint-or-model outputs/qwen3_8b_1m --lengths 1M --bucket 16K --name finetuned \
        --compare yarn=evals/yarn.json --out evals/
    # the embedded demo on CPU (2 processes, sp=2): needle probes (one answer each) at 4x its length
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 scripts/eval_positions.py \
        --checkpoint-or-model outputs/demo --lengths 768 --bucket 64 --num-sequences 128 --out outputs/demo/eval

The model is loaded as training loads it (ZeRO-3 partitions, Ulysses sp, `parallel.sequence_parallel_size`
from the config), without optimizer states. `data.seq_length` becomes the longest of --lengths, so
`model.rope_scaling: auto` applies YaRN exactly when that exceeds the model's trained length; pass
`--set model.rope_scaling=none` for the run without (a model whose config.json already holds YaRN, e.g. one
exported by train.py, keeps it either way). Sequences come from `data.source` (packed like training
data at each length; the demo gets needle probes with one scored answer each), or from --tokens.

Writes to --out: `<name>.json` (this run), and `loss_by_position.{png,csv,json}` for this run plus every
--compare NAME=FILE.json (an earlier run's `<name>.json`). Bad input exits with code 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import logging
import os

from ulysses_train.config import ConfigError
from ulysses_train.diagnostics.evaluation import parse_tokens


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="the run's YAML config (default: the embedded demo)")
    ap.add_argument("--checkpoint-or-model", default="", dest="model",
                    help="HF model folder, training output_dir (uses its hf_model/) or hub name; default model.name_or_path")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--lengths", required=True, help="comma-separated sequence lengths, e.g. 32K,128K")
    ap.add_argument("--bucket", default="1024", help="tokens per position bucket (default 1024)")
    ap.add_argument("--num-sequences", type=int, default=4, help="sequences per length (default 4)")
    ap.add_argument("--labels", default="data", choices=["data", "all"],
                    help="data: what the data labels (demo: answers only); all: every next token")
    ap.add_argument("--tokens", default="", help=".pt/.npy of [N, T] token ids to evaluate instead of data.source")
    ap.add_argument("--chunk-rows", type=int, default=1024, help="rows of logits per chunk (default 1024)")
    ap.add_argument("--name", default="run", help="this run's name in the plot and its JSON file name")
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=FILE.json",
                    help="add an earlier run's JSON to the plot (repeatable)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ulysses_train.cli import prepare_environment, report_user_errors

    prepare_environment()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return report_user_errors(lambda: run(args))


def run(args) -> int:
    from ulysses_train.cli import run_config

    lengths = [parse_tokens(x) for x in args.lengths.split(",") if x.strip()]
    bucket = parse_tokens(args.bucket, minimum=1)
    compare = []
    for item in args.compare:
        name, sep, path = item.partition("=")
        if not sep or not os.path.isfile(path):
            raise ConfigError(f"--compare {item!r} must be NAME=FILE.json naming an existing file.")
        compare.append((name, path))
    if args.num_sequences < 1:
        raise ConfigError(f"--num-sequences={args.num_sequences} must be >= 1.")
    cfg = run_config(args.config, args.set)  # the demo's defaults only for the demo, as scripts/train.py
    return evaluate(args, cfg, lengths, bucket, compare)


def evaluate(args, cfg, lengths, bucket, compare) -> int:
    import json

    from ulysses_train.diagnostics import evaluation, plots
    from ulysses_train.training.eval_engine import build_eval_engine

    run, eval_cfg = build_eval_engine(cfg, args.model, max(lengths))
    rank = run.dims.rank
    if rank == 0:
        print(f"evaluating {args.model or cfg.model.name_or_path} ({args.name}) on {run.dims.world_size} process(es), "
              f"sp={run.dims.sp}; "
              f"RoPE {evaluation.rope_summary(run.hf_config)['rope_parameters'] or 'none'}", flush=True)
    results = []
    for length in lengths:
        sequences = evaluation.eval_sequences(eval_cfg, length, args.num_sequences, run.dims.sp, args.labels,
                                              args.tokens)
        result = evaluation.evaluate_positions(run, sequences, bucket, args.chunk_rows, progress=True)
        results.append(result)
        if rank == 0:
            trained = evaluation.rope_summary(run.hf_config)["trained_length"]
            print(evaluation.format_summary(args.name, result, trained), flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        record = evaluation.run_record(args.name, results, model=args.model or cfg.model.name_or_path,
                                       hf_config=run.hf_config, labels=args.labels, sp=run.dims.sp,
                                       world_size=run.dims.world_size,
                                       references=evaluation.reference_lines(eval_cfg, args.labels, args.tokens))
        own = os.path.join(args.out, f"{args.name}.json")
        with open(own, "w") as fh:
            json.dump(record, fh, indent=1)
        runs = [record]
        for name, path in compare:
            runs.extend(plots.read_run(path, name))
        paths = plots.write_loss_by_position(runs, args.out, title=args.title)
        print(f"wrote {own}, {', '.join(paths.values())}", flush=True)
    import torch

    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    from ulysses_train.cli import run_script

    run_script(main)
