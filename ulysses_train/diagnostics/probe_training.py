"""Retrieval probes during training: the trainer's call for the run config's `eval` section (probe_config.py).

Why in training: a heatmap that only exists after the run cannot say when the model learned to use its context
(or whether it already could: the grid before step 1 is the baseline). Every `eval.every` steps the same small
grid (the same probes each time, so the numbers are comparable) is scored on the training engine between steps
(probe_scoring.score_probes), written to <output_dir>/eval/retrieval_step_<N>/ (heatmaps, CSV, JSON), summarised
in one line, and sent as scalars to the monitors of the DeepSpeed JSON (TensorBoard / W&B / CSV):
`Eval/retrieval_accuracy/<task>` and `Eval/retrieval_logprob/<task>`.
"""
from __future__ import annotations

import os
from typing import Optional

from ulysses_train.errors import ConfigError


class ProbeEvaluator:
    """Built once per run (the probes are generated before step 1, refused early when they cannot be), then
    called after every step; does nothing when `eval.every` is 0."""

    def __init__(self, cfg, output_dir: str):
        self.cfg, self.output_dir, self.sequences = cfg, output_dir, None
        if cfg.eval.every:
            self.sequences = self._probes()

    def _probes(self) -> list:
        from ulysses_train.data.tokenizer import load_tokenizer
        from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences, read_haystack

        from ulysses_train.probe_config import DEMO_TASK
        from ulysses_train.diagnostics.probe_tasks import demo_sequences

        cfg, section = self.cfg, self.cfg.eval
        lengths = section.lengths or [cfg.data.seq_length]
        if (cfg.data.source == "demo") != (section.tasks == [DEMO_TASK]):
            raise ConfigError("eval.tasks=[demo] goes with data.source=demo and only with it (the demo has no "
                              "tokenizer for the text tasks).")
        if section.tasks == [DEMO_TASK]:
            return demo_sequences(lengths, section.depths, section.samples, cfg.train.seed)
        tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.model.name_or_path, "data.tokenizer")
        if section.chat and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("eval.chat=true but the tokenizer has no chat template; set eval.chat=false.")
        text = read_haystack(section.haystack, "eval.haystack") if section.haystack else ""
        return probe_sequences(tokenizer, Haystack(tokenizer, text), section.tasks, lengths, section.depths,
                               section.samples, cfg.train.seed, section.chat)

    def __call__(self, engine, step: int, first_sample: Optional[dict] = None) -> Optional[list]:
        """Score the grid at `step` when due (step 0: the baseline; with `first_sample` also the first-step check
        of a run from pretrained weights); rank 0 writes and reports. Collective."""
        if first_sample is not None and self.cfg.eval.first_step_check and not self.cfg.model.random_init:
            from ulysses_train.diagnostics.evaluation import rope_summary
            from ulysses_train.diagnostics.first_step import first_step_check

            line = first_step_check(engine, first_sample, rope_summary(engine.hf_config)["trained_length"])
            if line and engine.dims.rank == 0:
                print(line, flush=True)
        if self.sequences is None or step % self.cfg.eval.every:
            return None
        from ulysses_train.diagnostics import evaluation, probe_report, probe_scoring

        records = probe_scoring.score_probes(engine, self.sequences, self.cfg.loss.chunk_rows)
        if engine.dims.rank == 0:
            table = probe_scoring.cells(records)
            facts = evaluation.rope_summary(engine.hf_config)
            if self.cfg.model.random_init:  # trained from scratch: at this run's length, whatever RoPE could reach
                facts["trained_length"] = self.cfg.data.seq_length
            record = {"name": f"step {step}", "step": step, "model": self.cfg.model.name_or_path, **facts,
                      "sp": engine.dims.sp, "world_size": engine.dims.world_size, "cells": table,
                      "probes": probe_scoring.records_as_dicts(records)}
            probe_report.write_probe_report(record, os.path.join(self.output_dir, "eval", f"retrieval_step_{step}"))
            print(f"eval step {step}: {probe_scoring.summary_line(table, facts['trained_length'])}", flush=True)
            if engine.deepspeed.monitor.enabled:
                engine.deepspeed.monitor.write_events(monitor_events(table, step))
        return records


def monitor_events(table: list, step: int) -> list:
    """(name, value, step) per task: accuracy and mean answer log-prob over its cells, weighted by their counts."""
    events = []
    for task in sorted({c["task"] for c in table}):
        rows = [c for c in table if c["task"] == task]
        count = sum(c["count"] for c in rows)
        events.append((f"Eval/retrieval_accuracy/{task}", sum(c["accuracy"] * c["count"] for c in rows) / count, step))
        events.append((f"Eval/retrieval_logprob/{task}", sum(c["mean_logprob"] * c["count"] for c in rows) / count,
                       step))
    return events
