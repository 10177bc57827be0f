"""The first-step sanity check: does the long sequence score its tokens at least as well as a short window does?

Why: a correctly set-up long-context run from pretrained weights starts near the model's usual loss; a subtly
mis-set one (RoPE theta or YaRN factor, position ids, attention masks or the sequence-parallel slicing) starts far
above it, and the training loss alone does not say which. Before step 1 the trainer scores the last W tokens of
its first sample twice, through the training engine (evaluation.evaluate_positions, no gradients):
- on their own, as a W-token sequence (positions 0..W-1: what the model saw in pretraining, W <= its trained
  length);
- at the end of the full sequence (positions L-W..L-1, with the whole sequence before them as context).
More context should not make the same tokens harder to predict; when it does by more than `MARGIN` nats, one
line says so with the likely causes. The check never stops the run.
"""
from __future__ import annotations

from typing import Optional

import torch

from ulysses_train.constants import IGNORE_INDEX

MARGIN = 0.5  # nats of mean NLL; a correct setup measures the long form at or below the short one


def first_step_losses(engine, sample: dict, window: int) -> tuple:
    """(mean NLL of the sample's last `window` labelled tokens on their own, the same inside the full sequence).
    Collective: every rank calls it with the same sample."""
    from ulysses_train.diagnostics.evaluation import evaluate_positions

    ids, labels = sample["input_ids"], sample["labels"]
    length = ids.shape[-1]
    tail = {"input_ids": ids[:, length - window:], "labels": labels[:, length - window:]}
    # the window's first token has no context in the short form (nothing predicts it): scored in neither
    full_labels = torch.full_like(labels, IGNORE_INDEX)
    full_labels[:, length - window + 1:] = labels[:, length - window + 1:]
    short = evaluate_positions(engine, [tail], bucket=window).overall
    long = evaluate_positions(engine, [{"input_ids": ids, "labels": full_labels}], bucket=length).overall
    return short, long


def verdict(short: Optional[float], long: Optional[float], window: int, length: int) -> str:
    """The one line the trainer prints: a plain reading, or what is likely mis-set."""
    if short is None or long is None:
        return f"first-step check: the last {window:,} tokens of the first sample carry no labels; skipped."
    line = (f"first-step check: the last {window:,} tokens of the first sample score mean NLL {long:.3f} inside the "
            f"{length:,}-token sequence, {short:.3f} on their own")
    if long > short + MARGIN:
        return (line + f": {long - short:.2f} nats WORSE with more context. The long-context setup is likely wrong: "
                f"RoPE (theta, YaRN factor: model.rope_scaling / rope_factor), position ids, or attention masks "
                f"(document packing, the sp slicing). Check them before spending the run.")
    return line + ": consistent."


def first_step_check(engine, sample: dict, trained_length: Optional[int]) -> Optional[str]:
    """Run the check on `sample` ([1, L] input_ids / labels) and return the line (rank 0 prints it); None when it
    does not apply (packed documents restart positions; a sequence of fewer than 2 x 16 tokens)."""
    if "document_lengths" in sample:
        return None
    length = int(sample["input_ids"].shape[-1])
    window = min(trained_length or length, length // 2)
    if window < 16:
        return None
    short, long = first_step_losses(engine, sample, window)
    return verdict(short, long, window, length)
