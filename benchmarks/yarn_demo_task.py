"""Train the demo model on needle retrieval at every distance (for yarn_demo.sh).

Why not the embedded demo's data (ulysses_train/data/demo.py): its needle is always in the first quarter and
its questions in a block at the very end, so a model trained on it has only seen one range of distances
and has nothing to show about positions.

Here each sequence hides one needle per key (the demo's token layout: a key token followed by its value
token) and asks each key once (the key token; the label after it is the value, the input there is filler);
no answer can be copied, each needs attention back to its own needle, and with several keys per sequence
the model must match keys. The distance from needle to question is log-uniform between 2 and the
question's position, so short distances (learned first) and distances up to the whole sequence both occur:
a uniform distance left the tiny model on a plateau at chance for thousands of steps in CPU trials, the
log-uniform one learned in a few hundred.

With sp=1, `--batch B` packs B sequences into each sample (a [B, L] batch in one micro-step); the
trainer's one-sequence-per-micro-step layout is for long sequences, and a tiny model at a few hundred
tokens needs more sequences per step to learn in minutes. (tokens/s in the log then counts one row.)

Same arguments as scripts/train.py otherwise (the embedded demo config, `--set` overrides):
    torchrun --standalone --nproc_per_node 1 benchmarks/yarn_demo_task.py --batch 16 \
        --set data.seq_length=512 --set parallel.sequence_parallel_size=1 --set train.steps=1500
"""
from __future__ import annotations

import math
import random
import sys

import torch

from ulysses_train.data.demo import BOS, IGNORE_INDEX, RetrievalTask


class EveryAnswerNeedsItsNeedle:
    """`num_samples` samples of `batch` x `seq_length` tokens, deterministic in (seed, index)."""

    def __init__(self, seq_length: int, num_samples: int, seed: int = 0, batch: int = 1):
        self.task = RetrievalTask()
        self.seq_length, self.num_samples, self.seed, self.batch = seq_length, num_samples, seed, batch

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        rows = [self.sequence(index * self.batch + row) for row in range(self.batch)]
        return {key: torch.stack([r[key] for r in rows]) for key in ("input_ids", "labels")}

    def sequence(self, number: int) -> dict:
        t, length = self.task, self.seq_length
        rng = random.Random(self.seed * 1_000_003 + 7 + number)
        ids = torch.tensor([t.filler_base + rng.randrange(t.num_filler) for _ in range(length)])
        ids[0] = BOS
        labels = torch.full_like(ids, IGNORE_INDEX)
        used = {0}
        for key in rng.sample(range(t.num_keys), t.num_keys):
            for _ in range(100):  # a question and its needle where nothing else sits yet
                question = rng.randrange(3, length - 1)
                needle = question - int(math.exp(rng.uniform(math.log(2), math.log(question))))
                if needle >= 1 and not {needle, needle + 1, question, question + 1} & used:
                    break
            else:
                continue
            value = rng.randrange(t.num_values)
            used |= {needle, needle + 1, question, question + 1}
            ids[needle], ids[needle + 1] = t.key_base + key, t.value_base + value
            ids[question] = t.key_base + key
            labels[question + 1] = t.value_base + value
        return {"input_ids": ids, "labels": labels}


def main(argv=None) -> int:
    import argparse

    from ulysses_train.cli import DEMO_DEFAULTS, parse_args, prepare_environment
    from ulysses_train.config import ConfigError, load_config
    from ulysses_train.model.rope import RopeConfigError
    from ulysses_train.training.loop import Trainer

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--batch", type=int, default=1)
    extra, rest = own.parse_known_args(argv)
    args = parse_args(rest)
    prepare_environment()
    try:
        cfg = load_config(args.config, args.set, defaults=None if args.config else DEMO_DEFAULTS)
        if cfg.data.source != "demo":
            raise ConfigError("benchmarks/yarn_demo_task.py trains on its own needle data: keep data.source=demo.")
        if extra.batch > 1 and cfg.parallel.sequence_parallel_size > 1:
            raise ConfigError("--batch > 1 needs parallel.sequence_parallel_size=1 (Ulysses runs one sequence "
                              "per micro-step).")
        dataset = EveryAnswerNeedsItsNeedle(cfg.data.seq_length, cfg.data.num_samples, cfg.train.seed, extra.batch)
        Trainer(cfg, resume=args.resume, overwrite=args.overwrite, dataset=dataset, force=args.force,
                profile_memory=args.profile_memory).train()
    except (ConfigError, RopeConfigError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
