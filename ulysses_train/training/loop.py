"""The training loop: data in a resumable order, steps, progress, metrics, checkpoints, export.

Reads top to bottom: `Trainer.__init__` prepares the output folder and builds the engine,
`Trainer.train` runs the steps. The step itself (exact global loss, ZeRO-3, Ulysses) is step.py's.

Data order: every sp rank of a dp group reads the same sample and keeps its own slice; dp groups read
different samples. The sample of (step, micro-step, dp group) is a pure function of the seed, so a
resumed run reads exactly what the uninterrupted run would have.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch

from ulysses_train.config import Config
from ulysses_train.device import cuda_training
from ulysses_train.parallel.layout import init_distributed, rank_from_environment
from ulysses_train.parallel.launch import check_op_build_locks
from ulysses_train.training import checkpoint, checkpoint_read, export, run_folder, run_identity
from ulysses_train.model.flops import model_flops_per_sequence, non_embedding_params
from ulysses_train.training.metrics import (MetricsLog, log_line, monitor_events, reset_peak_gpu, step_record,
                                            sum_over_ranks)
from ulysses_train.training.first_use_kernels import FIRST_STEP_DESC, trainer_notice
from ulysses_train.training.resolved_run import resolve_run
from ulysses_train.training.step import build_engine, train_step
from ulysses_train.training.step_costs import first_step_line, measured_step
from ulysses_train.training.stopping import StopRequest, TrainingStopped

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, overwrite: bool = False, hf_config=None,
                 dataset=None, optimizer_factory=None, force: bool = False, profile_memory: bool = False,
                 stop_request: StopRequest | None = None, resume_if_present: bool = False):
        self.cfg = cfg
        self.profile_memory = profile_memory
        self.stop_request = stop_request or StopRequest()
        self.output_dir = cfg.train.output_dir
        run_folder.check_output_dir(self.output_dir, resume, overwrite, resume_if_present)  # files only, before all
        resume = resume or resume_if_present
        corpus = cfg.data.source != "demo" and dataset is None
        if corpus:   # data mistakes named before minutes of model loading (or a model config from the hub)
            from ulysses_train.data.corpus import check_data_lengths, check_data_sources

            run_folder.check_writable(self.cache_dir, "data.cache_dir")
            tokens = check_data_sources(cfg.data, cfg.model.name_or_path)
        hf_config, self.dataset = self._model_config_and_data(hf_config, dataset)
        self.run = resolve_run(cfg, hf_config)  # sp, kernels, RoPE, the DeepSpeed dict: decided once, checked
        self.cfg = cfg = self.run.cfg
        if corpus:
            from ulysses_train.data.tokenizer import check_vocabulary_fits

            check_data_lengths(cfg.data, cfg.parallel.sequence_parallel_size, cfg.train.eval_lengths)
            option = f"data.tokenizer={cfg.data.tokenizer!r}" if cfg.data.tokenizer else "the model's tokenizer"
            check_vocabulary_fits(tokens, getattr(self.run.hf_config, "vocab_size", None), option)
        # which run the folder holds, and which checkpoint is intact, from files only: before the model is built
        # (reads only: a refusal leaves the folder as it was)
        self.identity = self._identity(self.run.hf_config, corpus, resume)
        check_op_build_locks()  # a stale lock would hold the process group's start forever
        tag, passed_over, changes = self._checkpoint_to_resume(resume)
        from ulysses_train.diagnostics.probe_training import ProbeEvaluator

        self.probes = ProbeEvaluator(cfg, self.output_dir)  # retrieval probes: made (or refused) before the model
        self.engine = build_engine(run=self.run, optimizer_factory=optimizer_factory, check_memory=not force)
        self.cfg = cfg = self.engine.cfg  # `auto` levers as chosen (what run_config.json records)
        self.rank = self.engine.dims.rank
        self.resume_layout = checkpoint.saved_layout(self.output_dir, tag, self.layout) if tag else None
        if self.dataset is None:
            self.dataset = self._load_corpus()
        self._prepare_output_dir(overwrite, tag, passed_over, changes)
        self.start_step = self._resume_from(tag)
        causal_lm = self.engine.module.causal_lm
        self.matmul_params = non_embedding_params(causal_lm)
        self.flops_per_sequence = model_flops_per_sequence(self.engine.hf_config, self.matmul_params,
                                                           self.sequence_length)

    # ------------------------------------------------------------------ setup

    def _model_config_and_data(self, hf_config, dataset):
        """The demo builds its own tiny model config and data; real runs read both from the config."""
        cfg = self.cfg
        if cfg.data.source == "demo":
            from ulysses_train.data.demo import RetrievalDataset, RetrievalTask, demo_model_config

            task = RetrievalTask(seq_length=cfg.data.seq_length, seed=cfg.train.seed)
            self.chance_loss = task.chance_loss
            hf_config = hf_config or demo_model_config(task.vocab_size)
            return hf_config, dataset or RetrievalDataset(task, cfg.data.num_samples)
        self.chance_loss = None
        return hf_config, dataset  # real corpora: loaded after the process group exists (see _load_corpus)

    def _load_corpus(self):
        """Tokenize and pack the corpus once (rank 0 of each node), the other ranks wait and read the cache."""
        from ulysses_train.data.corpus import prepare_run_data

        cfg = self.cfg
        dataset, summary = prepare_run_data(cfg.data, cfg.model.name_or_path, cfg.data.seq_length, self.engine.dims.sp)
        if self.rank == 0:
            print(summary, flush=True)
            notice = summary.repeats_notice(self.samples_per_step, cfg.train.steps)
            if notice:
                print(notice, flush=True)
        return dataset

    @property
    def cache_dir(self) -> str:
        from ulysses_train.data.corpus import cache_dir_for

        return str(cache_dir_for(self.cfg.data))

    @property
    def sequence_length(self) -> int:
        return int(self.dataset[0]["input_ids"].shape[-1]) if self.dataset is not None else self.cfg.data.seq_length

    @property
    def layout(self) -> dict:
        """What a checkpoint's optimizer partitions depend on; recorded in its manifest."""
        return {"world_size": self.engine.dims.world_size, "sp": self.engine.dims.sp}

    def _identity(self, hf_config, corpus: bool, resume: bool) -> dict | None:
        """This run's identity (run_identity.py), where it is needed: to check a resume, and on rank 0 to record."""
        if not resume and rank_from_environment()[0] != 0:
            return None
        if corpus:
            from ulysses_train.data.fingerprint import data_identity

            data = data_identity(self.cfg.data, self.cfg.model.name_or_path, self.cache_dir)
        else:   # the demo's data follow from seq_length and the seed; a dataset given in code is the caller's
            data = {"source": "demo" if self.cfg.data.source == "demo" else "given in code"}
        return run_identity.run_identity(self.cfg, hf_config, data)

    def _checkpoint_to_resume(self, resume: bool) -> tuple[str | None, list[str], list[str]]:
        """The newest intact checkpoint, the damaged newer ones passed over and the data changes accepted, after
        checking the folder holds this run (run_identity.py). The ranks share the checkpoint's hashing through the
        process group, started here for that (build_engine adopts it)."""
        if not resume:
            return None, [], []
        changes = run_identity.check_resume(self.output_dir, self.identity, self.cfg.train.resume_data_change)
        if not checkpoint.complete_tags(self.output_dir):
            return None, [], changes
        init_distributed(self.cfg.train.timeout_minutes)
        tag, passed_over = checkpoint_read.choose_for_resume(self.output_dir)
        return tag, passed_over, changes

    def _prepare_output_dir(self, overwrite: bool, tag: str | None, passed_over: list[str], changes: list[str]) -> None:
        """--overwrite clears the old run; a resume past damaged checkpoints sets them aside; data changes accepted
        are said; then remember what this run is."""
        torch.distributed.barrier()
        if self.rank == 0:
            if overwrite:
                run_folder.clear_run(self.output_dir)
            for line in passed_over:
                print(f"warning: passed over damaged checkpoint {line}; resuming from {tag}, the newest intact "
                      f"one (the damaged folder is renamed {checkpoint.DAMAGED_PREFIX}<tag>).", flush=True)
            if passed_over:
                checkpoint_read.set_aside_damaged(self.output_dir, tag)
            for line in changes:
                print(line, flush=True)
            os.makedirs(self.output_dir, exist_ok=True)
            with open(os.path.join(self.output_dir, run_folder.RUN_CONFIG), "w") as fh:
                levers = self.engine.levers.to_dict() if self.engine.levers is not None else None
                json.dump({"identity": self.identity, "config": self.cfg.to_dict(), "layout": self.layout,
                           "auto_levers": levers, "deepspeed_config": self.engine.ds_config}, fh, indent=2,
                          default=str)
        torch.distributed.barrier()

    def _resume_from(self, tag: str | None) -> int:
        """Load `tag` (through the universal format when another layout wrote it) and return its step; the
        samples it had consumed set where the data order continues (`samples_for_step`)."""
        self.samples_at_start = 0
        if tag is None:
            return 0
        changed = self.resume_layout
        if changed and self.rank == 0:
            step = checkpoint.step_size_words(changed, self.layout, self.cfg.train.gradient_accumulation_steps,
                                              self.sequence_length)
            print(f"checkpoint {tag} was written by {checkpoint.layout_words(changed)}; this run has "
                  f"{checkpoint.layout_words(self.layout)}: resuming through DeepSpeed's universal checkpoint "
                  f"(converted anew from {tag} into {checkpoint.UNIVERSAL_PREFIX}{tag}); {step}.", flush=True)
        state = checkpoint_read.load(self.engine.deepspeed, self.output_dir, tag, self.rank, universal=bool(changed))
        step = int(state["step"])
        # checkpoints from before samples were recorded were written by this layout (another one was refused)
        self.samples_at_start = int(state.get("samples_consumed", step * self.samples_per_step))
        if self.rank == 0:
            print(f"resumed from {tag} (step {step})", flush=True)
        return step

    @property
    def samples_per_step(self) -> int:
        return self.cfg.train.gradient_accumulation_steps * self.engine.dims.dp

    # ------------------------------------------------------------------ data

    def samples_for_step(self, step: int) -> tuple[list[dict], float]:
        """This dp group's micro-batches of `step`, and the epoch position after the step."""
        from ulysses_train.data.corpus import sample_order

        gas, dims = self.cfg.train.gradient_accumulation_steps, self.engine.dims
        size = len(self.dataset)
        samples = []
        for micro in range(gas):
            position = self._samples_before(step) + micro * dims.dp + dims.dp_rank
            epoch, offset = divmod(position, size)
            index = int(sample_order(size, self.cfg.train.seed, epoch)[offset])
            samples.append(self._as_tensors(self.dataset[index]))
        return samples, self._samples_before(step + 1) / size

    def _samples_before(self, step: int) -> int:
        """Samples consumed by all dp groups before `step`: those the resumed checkpoint had consumed, then
        samples_per_step per step of this run. On the layout that wrote the checkpoint this is step x samples per
        step; on another one (universal resume) the order continues where the checkpoint left it."""
        return self.samples_at_start + (step - self.start_step) * self.samples_per_step

    @staticmethod
    def _as_tensors(sample: dict) -> dict:
        out = {}
        for key in ("input_ids", "labels"):
            value = torch.as_tensor(sample[key], dtype=torch.long)
            out[key] = value.unsqueeze(0) if value.dim() == 1 else value
        if "document_lengths" in sample:  # document packing
            out["document_lengths"] = torch.as_tensor(sample["document_lengths"], dtype=torch.long)
        return out

    # ------------------------------------------------------------------ loop

    def train(self) -> list[dict]:
        cfg, records = self.cfg.train, []
        if self.start_step >= cfg.steps:
            missing = cfg.export_hf and not os.path.isdir(os.path.join(self.output_dir, "hf_model"))
            if self.rank == 0:
                print(f"the run in {self.output_dir} already finished (step {self.start_step} of train.steps="
                      f"{cfg.steps}); raise train.steps to train further."
                      + (" Its Hugging Face export is missing (an earlier export failed): exporting it now from the "
                         "last checkpoint." if missing else ""), flush=True)
            if missing:
                self.export()
            return records
        metrics = MetricsLog(self.output_dir, self.start_step) if self.rank == 0 else None
        progress = self._progress_bar()
        if self.start_step == 0:
            self.probes(self.engine, 0, first_sample=self._as_tensors(self.dataset[0]))  # baselines, before training
        for step in range(self.start_step, cfg.steps):
            samples, epoch = self.samples_for_step(step)
            reset_peak_gpu()
            started = time.perf_counter()
            with self._memory_profile(step), self._first_step_costs(step) as costs:
                result = train_step(self.engine, samples)
            seconds = time.perf_counter() - started
            record = step_record(step + 1, result, seconds, epoch, self._step_flops(samples), self.engine.dims,
                                 self.cfg.train.gradient_accumulation_steps * self.sequence_length)
            records.append(record)
            if self.engine.deepspeed.monitor.enabled:  # TensorBoard / W&B / CSV from the DeepSpeed JSON (rank 0 writes)
                self.engine.deepspeed.monitor.write_events(monitor_events(record))
            if metrics is not None:
                metrics.write(record)
                progress.update(1)
                progress.set_description("train")
                progress.set_postfix(loss=f"{record['loss']:.4f}")
                if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                    progress.write(log_line(record))
                if costs is not None:
                    progress.write(first_step_line(costs))
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                self.evaluate(step + 1)
            self.probes(self.engine, step + 1)
            self._save_or_stop(step + 1)
        if progress is not None:
            progress.close()
            self._summarize(records)
        if cfg.export_hf:
            self.export()
        return records

    def _save_or_stop(self, step: int) -> None:
        """Save when due; on an agreed stop request save (unless just saved) and raise TrainingStopped."""
        cfg = self.cfg.train
        due = step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)
        if due:
            self.save(step)
        if step < cfg.steps and self.stop_request.agreed():
            tag = checkpoint.tag_for(step)
            if not due:
                self.save(step)
            raise TrainingStopped(step, tag, self.stop_request.reason)

    def _summarize(self, records: list[dict]) -> None:
        if not records:
            return
        window = max(1, min(50, len(records) // 4))
        first = sum(r["loss"] for r in records[:window]) / window
        last = sum(r["loss"] for r in records[-window:]) / window
        line = f"loss: mean of first {window} steps {first:.3f}, of last {window} steps {last:.3f}"
        if self.chance_loss is not None:
            line += f" (answer tokens; chance = ln(values) = {self.chance_loss:.3f})"
        print(line, flush=True)

    def _progress_bar(self):
        if self.rank != 0:
            return None
        from tqdm.auto import tqdm

        notice = trainer_notice(self.run, cuda_training())  # which kernels compile in the first step, and where
        if notice:
            print(notice, flush=True)
        compiling = notice is not None and not notice.startswith("kernels: warmed")
        return tqdm(total=self.cfg.train.steps, initial=self.start_step, desc=FIRST_STEP_DESC if compiling else
                    "train", unit="step", dynamic_ncols=True)

    def _first_step_costs(self, step: int):
        """On GPUs, rank 0's first step measured by cause (training/step_costs.py: kernels compiled on first use,
        the offload's host buffers made), for the line after it; a context yielding None otherwise (the other ranks
        do not walk the kernel caches, which may sit on a shared filesystem)."""
        if step != self.start_step or self.rank != 0 or not cuda_training():
            return contextlib.nullcontext()
        return measured_step(self.engine.module, torch.cuda.synchronize)

    def _step_flops(self, samples: list[dict]) -> float:
        """Model FLOPs of the whole step (every dp group). With document packing they depend on each
        sequence's documents, which only its dp group knows: summed over ranks, once per sp group."""
        if not any("document_lengths" in sample for sample in samples):
            return self.cfg.train.gradient_accumulation_steps * self.engine.dims.dp * self.flops_per_sequence
        local = sum(model_flops_per_sequence(self.engine.hf_config, self.matmul_params, self.sequence_length,
                                             sample.get("document_lengths")) for sample in samples)
        return sum_over_ranks(local) / self.engine.dims.sp

    def _memory_profile(self, step: int):
        """--profile-memory records this run's second step (the first warms up kernels and the allocator)."""
        import contextlib

        if not self.profile_memory or step != min(self.start_step + 1, self.cfg.train.steps - 1):
            return contextlib.nullcontext()
        from ulysses_train.diagnostics.profiling import MemoryProfile

        return MemoryProfile(os.path.join(self.output_dir, "memory"), tag=f"step_{step + 1:08d}",
                             module=self.engine.module, optimizer=self.engine.deepspeed.optimizer, rank=self.rank)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, step: int) -> list:
        """Loss by position at train.eval_lengths (evaluation.py); rank 0 writes eval/step_<N>.json and redraws
        eval/loss_by_position.png with the last few evaluations."""
        from ulysses_train.diagnostics import evaluation, plots

        cfg, results = self.cfg, []
        for length in cfg.train.eval_lengths or [cfg.data.seq_length]:
            same = cfg.data.source != "demo" and length == self.sequence_length
            sequences = evaluation.eval_sequences(cfg, length, cfg.train.eval_sequences, self.engine.dims.sp,
                                                  dataset=self.dataset if same else None)
            results.append(evaluation.evaluate_positions(self.engine, sequences, cfg.train.eval_bucket))
        if self.rank == 0:
            folder = os.path.join(self.output_dir, "eval")
            os.makedirs(folder, exist_ok=True)
            record = evaluation.run_record(f"step {step}", results, model=cfg.model.name_or_path,
                                           hf_config=self.engine.hf_config, step=step,
                                           references=evaluation.reference_lines(cfg))
            with open(os.path.join(folder, f"step_{step:08d}.json"), "w") as fh:
                json.dump(record, fh, indent=1)
            names = sorted(n for n in os.listdir(folder) if n.startswith("step_") and n.endswith(".json"))
            runs = [plots.read_run(os.path.join(folder, n))[0] for n in names[-6:]]
            plots.write_loss_by_position(runs, folder, title="Loss by position during training")
            for result in results:
                print(evaluation.format_summary(f"eval step {step}", result, record.get("trained_length")), flush=True)
        return results

    # ------------------------------------------------------------------ saving

    def save(self, step: int) -> None:
        client_state = {"step": step, "seed": self.cfg.train.seed, "samples_consumed": self._samples_before(step)}
        tag = checkpoint.save(self.engine.deepspeed, self.output_dir, step, client_state, self.rank,
                              keep_last=self.cfg.train.keep_last, layout=self.layout)
        if self.rank == 0:
            print(f"saved checkpoint {tag}", flush=True)

    def export(self) -> str:
        """hf_model/: the consolidated weights and config, and the tokenizer the run read its data with (its chat
        template included), so the folder is a complete Hugging Face model. The demo has no tokenizer."""
        export_dir = os.path.join(self.output_dir, "hf_model")
        staged = export.staging_dir(export_dir)   # written whole, then swapped in: never a mix of two models
        export.export_hf_model(self.engine.deepspeed, self.engine.module.causal_lm, staged, self.rank, self.cfg.model)
        if self.rank == 0:
            if self.cfg.data.source != "demo":
                from ulysses_train.data.tokenizer import load_tokenizer

                load_tokenizer(self.cfg.data.tokenizer or self.cfg.model.name_or_path).save_pretrained(staged)
            previous = export.swap_in(staged, export_dir)
            moved = f" (the folder that was there is now {previous})" if previous else ""
            print(f"exported Hugging Face model to {export_dir}{moved}", flush=True)
        return export_dir
