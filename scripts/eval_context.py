"""Does the model use its whole context? Retrieval probes across lengths and depths, scored under sp, as heatmaps.

    # a fine-tuned run (its exported model) on 8 GPUs: sp from the world size as in training
    deepspeed --num_gpus 8 scripts/eval_context.py --config configs/qwen3_8b_1m_8gpu.yaml \
        --model outputs/qwen3_8b_1m --lengths 32K,128K,512K,1M --depths 0,10,...,100 --out evals/context
    # the pretrained model past its trained length with YaRN (rope_scaling auto) and without (--beyond-trained)
    deepspeed --num_gpus 8 scripts/eval_context.py --model Qwen/Qwen3-8B --lengths 32K,64K,128K --out evals/yarn
    deepspeed --num_gpus 8 scripts/eval_context.py --model Qwen/Qwen3-8B --lengths 32K,64K,128K \
        --set model.rope_scaling=none --beyond-trained --out evals/no_yarn

Tasks (--tasks, default all): passkey, multikey, multivalue, vartrack (ulysses_train/diagnostics/probe_tasks.py),
or `demo` alone for a model trained by the embedded demo (its own tokens, no tokenizer);
--chat renders them with the tokenizer's chat template; --haystack FILE hides them in your own text instead of the
built-in filler. Every probe is scored teacher-forced in one forward (probe_scoring.py): exact match = every
answer token is the argmax given the true prefix. The model is loaded as training loads it (ZeRO-3, Ulysses,
`parallel.sequence_parallel_size` from the config, auto by default), the planner's preflight for the evaluation
forward (planner/forward_only.py) runs on GPUs, and `data.seq_length` becomes the longest length, so
`model.rope_scaling: auto` applies YaRN exactly as the trainer would for it.

Writes to --out: retrieval.json (run facts, cells, every probe, the scoring time, the measured peak GPU memory
`peak_gpu_gib` and the planner's estimate for the forward at the longest length `planned_eval_gpu_gib`, both as
torch's allocator counts), retrieval.csv (per task, length, depth: count, accuracy, mean answer log-prob),
retrieval_<task>.png; prints one summary line. Bad input exits with code 2 and a one-line message, before any
model is built. SIGTERM or Ctrl-C (or the launcher's death) ends the grid after the probe sequence being scored:
the scores done so far are written (retrieval.json `complete: false`, `scored_sequences`) and the exit code is 75
(before the model is built: exit 75 at once, nothing written). A second SIGTERM or Ctrl-C stops at once, mid-sequence:
rank 0's scores so far are written (`complete: false`, `interrupted: true`) and the exit code is 130.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ulysses_train.config import ConfigError, load_config
from ulysses_train.diagnostics.evaluation import parse_tokens

DEFAULT_DEPTHS = "0,10,...,100"
EVAL_DEFAULTS = {"parallel": {"sequence_parallel_size": "auto"}}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder, training output_dir (its hf_model/) or hub name")
    ap.add_argument("--config", help="the run's YAML config (dtype, attention, DeepSpeed JSON, sp, rope_scaling)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override (repeatable)")
    ap.add_argument("--lengths", required=True, help="comma-separated context lengths, e.g. 8K,32K,128K")
    ap.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"needle depths in percent (default {DEFAULT_DEPTHS})")
    ap.add_argument("--tasks", default="passkey,multikey,multivalue,vartrack", help="comma-separated tasks")
    ap.add_argument("--samples", type=int, default=1, help="sequences per (task, length, depth group), default 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="render probes with the tokenizer's chat template")
    ap.add_argument("--haystack", default="", help="a text file to hide the facts in (default: built-in filler)")
    ap.add_argument("--tokenizer", default="", help="tokenizer folder or hub name (default: the model's)")
    ap.add_argument("--beyond-trained", action="store_true",
                    help="allow lengths past what the model's RoPE addresses (to measure a model without YaRN there)")
    ap.add_argument("--random-init", action="store_true",
                    help="random weights of the model's shape (--model: a folder with config.json): time and "
                         "memory only")
    ap.add_argument("--chunk-rows", type=int, default=1024, help="answer rows of the head per chunk")
    ap.add_argument("--name", default="run")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def parse_depths(text: str) -> list:
    """0,25,50 or an arithmetic run written 0,10,...,100; each in 0..100, duplicates dropped."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        if "..." in items:
            i = items.index("...")
            first, second, last = int(items[i - 2]), int(items[i - 1]), int(items[i + 1])
            items = items[:i - 2] + [str(d) for d in range(first, last + 1, second - first)] + items[i + 2:]
        depths = sorted({int(x) for x in items})
    except (ValueError, IndexError):
        raise ConfigError(f"--depths {text!r} is not a list of percentages (e.g. 0,50,100 or 0,10,...,100).") from None
    if not depths or depths[0] < 0 or depths[-1] > 100:
        raise ConfigError(f"--depths {text!r}: depths are percentages of the context, 0 to 100.")
    return depths


YARN_FACTOR_LIMIT = 32.0
"""The largest YaRN factor evaluated without --beyond-trained: the largest any release ships (GPT-OSS: 32) and above
what this package trains with (Qwen3-8B at 1M tokens: 25.6). Past it the scores say little and a grid at such lengths
can take hours."""
ASSUMED_TFLOPS = {"cpu": 0.1, "gpu": 400.0}
"""Throughput per process assumed for the time estimate of a refusal (the planner's GPU default; a CPU process)."""


def check_length_reach(model_path: str, cfg, longest: int, beyond: bool, random_init: bool = False) -> None:
    """Refuse lengths past the positions the model addresses under the run's rope setting, naming the YaRN factor
    that would reach them (the trainer's own rule: model/rope.py; what it cannot apply is refused here in
    eval_context's own flags), and a YaRN factor past YARN_FACTOR_LIMIT unless --beyond-trained, with the time."""
    import dataclasses
    import warnings

    from ulysses_train.model.loading import load_model_config
    from ulysses_train.model.rope import RopeConfigError, apply_rope_scaling, position_free

    trial = load_model_config(dataclasses.replace(cfg.model, name_or_path=model_path, random_init=random_init))
    supported = int(getattr(trial, "max_position_embeddings", 0) or 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            decision = apply_rope_scaling(trial, longest, cfg.model.rope_scaling, cfg.model.rope_factor)
        except RopeConfigError:
            nope = position_free(trial)
            way = (" (--set model.rope_scaling=none --beyond-trained measures it there as it is)" if nope else "")
            raise ConfigError(f"--lengths up to {longest:,} are past the {supported:,} positions the model "
                              f"addresses, and YaRN cannot reach them: it has "
                              f"{'no positions (NoPE)' if nope else 'no rotary position embeddings'} to scale. Fix: "
                              f"--lengths up to {supported:,}{way}.") from None
    if decision.applied == "none" and longest > decision.max_position_embeddings and not beyond:
        if position_free(trial):  # no RoPE: nothing for YaRN to reach them with
            raise ConfigError(f"--lengths up to {longest:,} exceed the {decision.max_position_embeddings:,} positions "
                              f"the model was trained to, and it has no rotary position embeddings (NoPE) for YaRN "
                              f"to extend. Pass --beyond-trained to measure the model there as it is.")
        factor = longest / decision.original_max_position_embeddings
        raise ConfigError(f"--lengths up to {longest:,} exceed the {decision.max_position_embeddings:,} positions the "
                          f"model addresses with model.rope_scaling={cfg.model.rope_scaling}; YaRN factor {factor:g} "
                          f"would reach them (--set model.rope_scaling=auto). Pass --beyond-trained to measure the "
                          f"model there without it.")
    if decision.applied == "yarn" and (decision.factor or 0) > YARN_FACTOR_LIMIT and not beyond:
        original = decision.original_max_position_embeddings
        raise ConfigError(f"--lengths up to {longest:,} need YaRN factor {decision.factor:,.0f} on a model trained to "
                          f"{original:,} positions, past the factor {YARN_FACTOR_LIMIT:g} this package trains and "
                          f"evaluates with; {forward_time_words(trial, longest)}. Fix: --lengths up to "
                          f"{int(original * YARN_FACTOR_LIMIT):,}, or pass --beyond-trained to run it anyway.")


def forward_time_words(hf_config, length: int) -> str:
    """The estimated time of one probe forward at `length`, in words (attention and 2 FLOPs per weight per token,
    at ASSUMED_TFLOPS per process)."""
    import torch

    from ulysses_train.model.architecture import text_config
    from ulysses_train.model.mixers import layer_windows
    from ulysses_train.model.flops import attention_forward_flops, attention_width

    text = text_config(hf_config)
    layers, hidden = text.num_hidden_layers, text.hidden_size
    flops = attention_forward_flops(length, attention_width(hf_config), layers, windows=layer_windows(hf_config))
    flops += 2 * 12 * layers * hidden * hidden * length
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    seconds = flops / (ASSUMED_TFLOPS[kind] * 1e12)
    when = f"{seconds / 3600:,.1f} hours" if seconds >= 3600 else f"{seconds / 60:,.1f} minutes"
    rate = f"{ASSUMED_TFLOPS[kind]:g} TFLOP/s per {kind.upper()} process"
    return f"each probe sequence would take about {when} (at {rate})"


def main(argv=None) -> int:
    args = parse_args(argv)
    from ulysses_train.cli import prepare_environment, report_user_errors

    from ulysses_train.training.stopping import StopRequest

    prepare_environment()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    stop = StopRequest(after="this probe sequence", keeping="writing the scores done so far").install()
    try:
        return report_user_errors(lambda: run(args, stop))
    finally:
        stop.close()


def prepare(args):
    """Every check that needs no model: inputs, tokenizer, chat template, haystack, lengths, the probes."""
    from ulysses_train.data.tokenizer import load_tokenizer
    from ulysses_train.training.eval_engine import resolve_model_path
    from ulysses_train.probe_config import DEMO_TASK
    from ulysses_train.diagnostics.probe_tasks import (TASKS, Haystack, demo_sequences, probe_sequences,
                                                        read_haystack)
    from ulysses_train.training.run_folder import check_writable

    check_writable(args.out, "--out")  # a file there, or a folder this process cannot write: named before the model
    lengths = sorted({parse_tokens(x) for x in args.lengths.split(",") if x.strip()})
    depths = parse_depths(args.depths)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if (unknown and tasks != [DEMO_TASK]) or not tasks or args.samples < 1:
        raise ConfigError(f"--tasks {args.tasks!r} / --samples {args.samples}: tasks are {', '.join(TASKS)} (or "
                          f"demo alone, for the embedded demo's model); samples >= 1.")
    model_path = resolve_model_path(args.model)
    cfg = load_config(args.config, args.set, defaults=None if args.config else EVAL_DEFAULTS)
    check_length_reach(model_path, cfg, lengths[-1], args.beyond_trained, args.random_init)
    if tasks == [DEMO_TASK]:
        return cfg, model_path, lengths, depths, tasks, demo_sequences(lengths, depths, args.samples, args.seed), []
    tokenizer = load_tokenizer(args.tokenizer or model_path, "--tokenizer")
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"--chat: the tokenizer of {args.tokenizer or args.model!r} has no chat template; drop "
                          f"--chat "
                          f"for raw-text probes, or pass --tokenizer with one that has a template.")
    text = ""
    if args.haystack:
        if not os.path.isfile(args.haystack):
            raise ConfigError(f"--haystack {args.haystack!r} is not a file; give a text file or drop the option.")
        text = read_haystack(args.haystack, "--haystack")
    haystack = Haystack(tokenizer, text)
    sequences = probe_sequences(tokenizer, haystack, tasks, lengths, depths, args.samples, args.seed, args.chat)
    notes = []
    if haystack.repeated:
        notes.append(f"note: --haystack {args.haystack!r} has {len(haystack.ids):,} tokens, fewer than the longest "
                     f"length {lengths[-1]:,}: it is repeated to fill the context.")
    return cfg, model_path, lengths, depths, tasks, sequences, notes


def run(args, stop) -> int:
    import time

    import torch

    from ulysses_train.constants import GIB
    from ulysses_train.diagnostics import probe_scoring
    from ulysses_train.training.metrics import max_over_ranks, peak_gpu_gib, reset_peak_gpu
    from ulysses_train.training.eval_engine import build_eval_engine, planned_forward
    from ulysses_train.model.rope import rope_description
    from ulysses_train.training.stopping import EXIT_STOPPED

    grid = prepare(args)
    cfg, model_path, lengths, depths, tasks, sequences, notes = grid
    engine, _ = build_eval_engine(cfg, model_path, lengths[-1], check_memory=True, random_init=args.random_init)
    done, started = [], time.perf_counter()
    if engine.dims.rank == 0:  # a second signal: this rank's scores so far written from the watcher thread
        stop.at_once = lambda: write_done(args, engine, grid, done, started)
    stop.begin_steps()  # from now on SIGTERM ends the grid after the current sequence (before: at once, exit 75)
    rank = engine.dims.rank
    if rank == 0:
        for note in notes:
            print(note, flush=True)
        print(f"probing {args.model} ({args.name}): {len(sequences)} sequences on {engine.dims.world_size} "
              f"process(es), sp={engine.dims.sp}; RoPE {rope_description(engine.hf_config)}", flush=True)
    reset_peak_gpu()
    started = time.perf_counter()
    records = probe_scoring.score_probes(engine, sequences, args.chunk_rows, progress=True, stop=stop, into=done)
    scored = len({r.sequence for r in records})  # fewer than all: a stop request ended the grid (every rank agreed)
    cost = {"seconds": time.perf_counter() - started, "peak_gpu_gib": max_over_ranks(peak_gpu_gib())}
    cost["seconds_per_sequence"] = cost["seconds"] * engine.dims.dp / max(1, scored)
    planned = planned_forward(engine, args.chunk_rows)  # the longest length's forward, as torch's allocator sees it
    cost["planned_eval_gpu_gib"] = round(planned.gpu_allocated / GIB, 3) if planned is not None else None
    if rank == 0:
        stop.at_once = None  # the full report is being written: a second signal now drops nothing scored
        write_report(args, engine, grid, records, cost)
        if scored < len(sequences):
            print(f"stopped after {scored} of {len(sequences)} probe sequences ({stop.reason}): the scores done so far "
                  f"are written; exiting with code {EXIT_STOPPED}.", file=sys.stderr, flush=True)
    torch.distributed.barrier()
    return EXIT_STOPPED if scored < len(sequences) else 0


def write_report(args, engine, grid, records, cost, say: bool = True) -> dict:
    """retrieval.json / .csv / .png of `records` (rank 0), and (`say`) the summary lines on stdout; the paths."""
    from ulysses_train.diagnostics import evaluation, probe_report, probe_scoring

    _, _, lengths, depths, tasks, sequences, _ = grid
    scored = len({r.sequence for r in records})
    table = probe_scoring.cells(records)
    facts = evaluation.rope_summary(engine.hf_config)
    record = {"name": args.name, "model": args.model, "tasks": tasks, "lengths": lengths, "depths": depths,
              "samples": args.samples, "seed": args.seed, "chat": args.chat, "haystack": args.haystack or "built-in",
              "sp": engine.dims.sp, "world_size": engine.dims.world_size, **facts, **cost,
              "complete": scored == len(sequences), "scored_sequences": scored, "cells": table,
              "probes": probe_scoring.records_as_dicts(records)}
    paths = probe_report.write_probe_report(record, args.out)
    if not say:
        return paths
    print(probe_scoring.summary_line(table, facts["trained_length"]), flush=True)
    planned = cost.get("planned_eval_gpu_gib")
    plan_text = (f" (planned for the evaluation forward at {lengths[-1]:,} tokens: {planned:.2f} GiB)"
                 if planned is not None else "")
    print(f"scoring: {cost['seconds']:.1f} s ({cost['seconds_per_sequence']:.2f} s per sequence per dp group), "
          f"peak GPU memory {cost['peak_gpu_gib']:.2f} GiB{plan_text}", flush=True)
    print(f"wrote {', '.join(paths.values())}", flush=True)
    return paths


def write_done(args, engine, grid, done: list, started: float) -> str:
    """A stop at once (a second signal): rank 0's scores so far, written without a collective (the other ranks may
    be mid-forward); what was kept, in words. With dp > 1 the other dp groups' scores are not on this rank."""
    import time

    from ulysses_train.training.metrics import peak_gpu_gib

    records = sorted(list(done), key=lambda r: (r.sequence, r.probe))
    scored = len({r.sequence for r in records})
    seconds = time.perf_counter() - started
    cost = {"seconds": seconds, "peak_gpu_gib": peak_gpu_gib(), "seconds_per_sequence": seconds / max(1, scored),
            "planned_eval_gpu_gib": None, "interrupted": True}
    paths = write_report(args, engine, grid, records, cost, say=False)  # stdout may be what the main thread waits on
    return f"the {scored} probe sequence(s) scored on rank 0 are written to {paths['json']}"


if __name__ == "__main__":
    from ulysses_train.cli import run_script

    run_script(main)
