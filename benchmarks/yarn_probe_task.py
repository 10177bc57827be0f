"""Train a small model on the retrieval probes themselves, for the YaRN story as heatmaps (scripts/eval_context.py).

Why: the story (trained at L; at 4L without YaRN, with YaRN zero-shot, and after a short YaRN fine-tune at 4L)
needs a model that can retrieve at all and has a tokenizer, on a machine with no hub access. This script makes
both locally: `--prepare DIR` writes a byte-level BPE tokenizer (digits as single tokens, trained on the probes'
own templates and filler) and the config.json of a small Qwen3 over it (no weights: train with
model.random_init=true); training then reads probe sequences (diagnostics/probe_tasks.py: a task per sample, its
depths drawn at random, only answer tokens labelled), seeded apart from the evaluation's probes.

    python benchmarks/yarn_probe_task.py --prepare outputs/probe_model
    torchrun --standalone --nproc_per_node 1 benchmarks/yarn_probe_task.py --tasks passkey,multikey \
        --set model.name_or_path=outputs/probe_model --set model.random_init=true \
        --set data.tokenizer=outputs/probe_model --set data.seq_length=2048 --set train.steps=3000 \
        --set train.output_dir=outputs/probe_2k
Other arguments as scripts/train.py (the embedded demo's config with `--set` overrides; data.source is not the
demo's, so the model is the one model.name_or_path names, exported with its tokenizer). With sp=1, `--batch B` puts
B sequences in each sample ([B, L] in one micro-step): a small model at a few hundred tokens learns in minutes
only with more sequences per step (benchmarks/yarn_heatmaps.sh; tokens/s in the log then counts one row).
"""
from __future__ import annotations

import os
import random
import sys

import torch

from ulysses_train.diagnostics.probe_tasks import (ADJECTIVES, BUILTIN_FILLER, INSTRUCTION, NOUNS, TASKS, Haystack,
                                                   build_sequence)


class ProbeTrainingSet:
    """`num_samples` samples of `batch` probe sequences of `length` tokens ([batch, length]), deterministic in
    (seed, index), tasks in turn."""

    def __init__(self, tokenizer, length: int, num_samples: int, seed: int = 0, tasks=("passkey",), batch: int = 1):
        self.tokenizer, self.length, self.num_samples = tokenizer, length, num_samples
        self.seed, self.tasks, self.batch = seed, tasks, batch
        self.haystack = Haystack(tokenizer)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        rows = [self.sequence(index * self.batch + row) for row in range(self.batch)]
        return {key: torch.cat([r[key] for r in rows]) for key in ("input_ids", "labels")}

    def sequence(self, index: int) -> dict:
        rng = random.Random(f"train/{self.seed}/{index}")
        task = self.tasks[index % len(self.tasks)]
        depths = [rng.randint(0, 100)] if task == "passkey" else sorted(rng.sample(range(101), 4))
        sequence = build_sequence(self.tokenizer, self.haystack, task, self.length, depths, rng)
        return {"input_ids": sequence.input_ids, "labels": sequence.labels}


def prepare(folder: str) -> str:
    """A byte-level BPE over the probes' vocabulary (digits split, one token each) and a small Qwen3's config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    texts = [BUILTIN_FILLER * 4, INSTRUCTION, " ".join(ADJECTIVES + NOUNS), "VAR ABCDE = VAR FGHIJ. Answer: 0123456789",
             "What is the special magic number for mentioned in the text, in order? One of the special magic numbers "
             "for is: The pass key is Remember it. Find all variables that are assigned the value directly or "
             "through other variables."]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=32, vocab_size=len(tokenizer), max_position_embeddings=2048,
                tie_word_embeddings=True, rope_theta=10_000.0, eos_token_id=1, pad_token_id=2).save_pretrained(folder)
    return folder


def main(argv=None) -> int:
    import argparse

    from ulysses_train.cli import DEMO_DEFAULTS, parse_args, prepare_environment, report_user_errors
    from ulysses_train.config import ConfigError, load_config

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--prepare", default="")
    own.add_argument("--tasks", default="passkey")
    own.add_argument("--batch", type=int, default=1)
    extra, rest = own.parse_known_args(argv)
    if extra.prepare:
        print(f"wrote tokenizer and config.json to {prepare(extra.prepare)}")
        return 0
    args = parse_args(rest)
    prepare_environment()

    def train() -> int:
        from ulysses_train.data.tokenizer import load_tokenizer
        from ulysses_train.training.loop import Trainer

        # not the demo's data: with data.source=demo the trainer would build the demo's own model config (its
        # vocabulary, not this tokenizer's) and export no tokenizer
        defaults = {**DEMO_DEFAULTS, "data": {**DEMO_DEFAULTS["data"], "source": "probe_tasks"}}
        cfg = load_config(args.config, args.set, defaults=None if args.config else defaults)
        tasks = tuple(t.strip() for t in extra.tasks.split(","))
        if not cfg.data.tokenizer or any(t not in TASKS for t in tasks):
            raise ConfigError(f"set data.tokenizer (a --prepare folder) and --tasks from {', '.join(TASKS)}.")
        sp, world = cfg.parallel.sequence_parallel_size, int(os.environ.get("WORLD_SIZE", "1"))
        if extra.batch > 1 and sp != 1 and not (sp == "auto" and world == 1):
            raise ConfigError("--batch > 1 needs parallel.sequence_parallel_size=1 (Ulysses runs one sequence "
                              "per micro-step).")
        tokenizer = load_tokenizer(cfg.data.tokenizer, "data.tokenizer")
        dataset = ProbeTrainingSet(tokenizer, cfg.data.seq_length, cfg.data.num_samples, cfg.train.seed, tasks,
                                   extra.batch)
        Trainer(cfg, resume=args.resume, overwrite=args.overwrite, dataset=dataset, force=args.force).train()
        return 0

    return report_user_errors(train)


if __name__ == "__main__":
    sys.exit(main())
