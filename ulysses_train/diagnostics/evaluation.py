"""Loss by position over long sequences, through the trainer's own model loading and sp path.

The question this answers: does the model still predict well at position 100K, 500K, 1M? A model asked
for positions it never trained on degrades quietly (the loss climbs towards, then past, the unigram
entropy); YaRN is meant to stop that (ulysses_train/DESIGN.md, 'Positions past the trained length').

How it is computed, per sequence:
- every sp rank reads the same sequence and keeps its slice (`parallel.slice_sequence`: labels shifted
  before slicing, global position ids), exactly as in training;
- the decoder runs to the last hidden state of the slice (Ulysses all-to-all inside attention);
- the per-token NLL of the slice is computed chunk by chunk from the hidden states and the `lm_head`
  weight (gathered once under ZeRO-3), under `no_grad`, so `seq x vocab` logits never exist at once;
- each rank adds its tokens' NLL into position buckets by their *global* position; one all-reduce
  over all ranks sums the buckets of every slice (sp) and every sequence (dp groups read different
  sequences). That equals gathering the per-token NLL across the sp group and bucketing it there.

"Position" p is the position of the token that makes the prediction: the loss at p is
-log P(token p+1 | tokens 0..p), and bucket b holds positions [b*bucket, (b+1)*bucket).

The reference line is the unigram entropy of the scored tokens: the loss of a model that knows only
how often each token occurs, and ignores the context entirely.

Entry points: `evaluate_positions` (any built `Engine`, also from the training loop),
`eval_sequences` (what to evaluate, from the run config); `eval_engine.build_eval_engine` loads a model for
evaluation only (no optimizer states).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ulysses_train.config import Config, ConfigError
from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.model.architecture import decoder_of
from ulysses_train.parallel.layout import slice_sequence
from ulysses_train.model.loss import transform_logits

LABEL_MODES = ("data", "all")
DEMO_EVAL_INDEX = 1_000_000_000  # demo samples past any training index: held out from training


# ---------------------------------------------------------------- results


@dataclass
class PositionLoss:
    """Mean NLL per position bucket over `sequences` sequences of `length` tokens."""

    length: int
    bucket: int
    sequences: int
    nll_sum: list = field(default_factory=list)
    count: list = field(default_factory=list)
    unigram_entropy: float = float("nan")
    nll_sq_sum: list = field(default_factory=list)  # for the standard error of each bucket's mean

    @property
    def bucket_start(self) -> list[int]:
        return [i * self.bucket for i in range(len(self.count))]

    @property
    def mean_nll(self) -> list[Optional[float]]:
        return [s / c if c else None for s, c in zip(self.nll_sum, self.count)]

    @property
    def standard_error(self) -> list[Optional[float]]:
        """Standard error of each bucket's mean (None below 2 tokens): how far apart two runs must be."""
        out = []
        for s, q, c in zip(self.nll_sum, self.nll_sq_sum or [0.0] * len(self.count), self.count):
            out.append(math.sqrt(max(q / c - (s / c) ** 2, 0.0) / (c - 1)) if c > 1 and self.nll_sq_sum else None)
        return out

    @property
    def tokens(self) -> int:
        return int(sum(self.count))

    @property
    def overall(self) -> Optional[float]:
        return sum(self.nll_sum) / self.tokens if self.tokens else None

    def mean_over(self, start: int, end: int) -> Optional[float]:
        """Mean NLL over the buckets that start in [start, end), token-weighted."""
        pairs = [(s, c) for b, s, c in zip(self.bucket_start, self.nll_sum, self.count) if start <= b < end]
        total = sum(c for _, c in pairs)
        return sum(s for s, _ in pairs) / total if total else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(bucket_start=self.bucket_start, mean_nll=self.mean_nll, standard_error=self.standard_error,
                   tokens=self.tokens, mean_nll_all=self.overall)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "PositionLoss":
        return cls(length=data["length"], bucket=data["bucket"], sequences=data["sequences"],
                   nll_sum=list(data["nll_sum"]), count=list(data["count"]),
                   unigram_entropy=data["unigram_entropy"], nll_sq_sum=list(data.get("nll_sq_sum") or []))


def unigram_entropy(labels: Sequence[torch.Tensor]) -> float:
    """Entropy (nats) of the empirical token distribution of the valid labels (not -100)."""
    valid = torch.cat([t.reshape(-1) for t in labels])
    valid = valid[valid != IGNORE_INDEX]
    if valid.numel() == 0:
        return float("nan")
    counts = torch.bincount(valid).double()
    p = counts[counts > 0] / valid.numel()
    return float(-(p * p.log()).sum())


def scored_labels(sample: dict) -> torch.Tensor:
    """The labels the loss scores: the next token of every position (labels shifted by one)."""
    return sample["labels"][..., 1:]


# ---------------------------------------------------------------- per-token loss


def _gathered(weight: torch.nn.Parameter):
    """Gather a ZeRO-3 partitioned weight once for the block (a no-op for a parameter ZeRO does not manage)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight])


def slice_hidden_states(module, piece: dict) -> torch.Tensor:
    """The decoder's last hidden states of this rank's slice, [rows, hidden] (Ulysses all-to-all inside
    attention): what every evaluation reads before its own slice of the head."""
    hidden = decoder_of(module.causal_lm)(input_ids=piece["input_ids"], position_ids=piece["position_ids"],
                                            use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


@torch.no_grad()
def per_token_nll(module, piece: dict, chunk_rows: int = 1024) -> torch.Tensor:
    """NLL of every label of this rank's slice ([rows] fp32, 0 where the label is -100).

    `module` is the `LongContextCausalLM` (e.g. `Engine.module`). The logits exist one chunk of
    `chunk_rows` rows at a time, in fp32 after the matmul in the parameters' dtype, as in training.
    Under ZeRO-3 every rank must call this the same number of times (the weights are gathered collectively).
    """
    hidden = slice_hidden_states(module, piece)
    labels = piece["shift_labels"].reshape(-1)
    out = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
    head = module.causal_lm.get_output_embeddings()
    weight = head.weight
    with _gathered(weight):
        for start in range(0, hidden.shape[0], chunk_rows):
            end = min(start + chunk_rows, hidden.shape[0])
            logits = transform_logits((hidden[start:end] @ weight.t()).float(), head.logit_transform)
            out[start:end] = F.cross_entropy(logits, labels[start:end], ignore_index=IGNORE_INDEX, reduction="none")
    return out


def evaluate_positions(run, sequences: Sequence[dict], bucket: int, chunk_rows: Optional[int] = None,
                       progress: bool = False) -> PositionLoss:
    """Mean NLL per position bucket over `sequences` ([1, T] `input_ids` and `labels`, one length T).

    Collective: every rank of the world calls it with the same `sequences`. dp groups take every dp-th
    sequence; each sp rank scores its slice. The model is put in eval mode and restored afterwards, so
    this can run between training steps.
    """
    if not sequences:
        raise ValueError("evaluate_positions needs at least one sequence.")
    if bucket < 1:
        raise ValueError(f"bucket={bucket} must be >= 1.")
    length = int(sequences[0]["input_ids"].shape[-1])
    if any(int(s["input_ids"].shape[-1]) != length for s in sequences):
        raise ValueError("evaluate_positions: all sequences must have the same length; evaluate each length apart.")
    dims, device = run.dims, run.device
    chunk_rows = chunk_rows or 1024
    buckets = -(-length // bucket)
    sums = torch.zeros(buckets, dtype=torch.float64, device=device)
    squares = torch.zeros(buckets, dtype=torch.float64, device=device)
    counts = torch.zeros(buckets, dtype=torch.float64, device=device)
    mine = list(sequences[dims.dp_rank::dims.dp])
    rounds = -(-len(sequences) // dims.dp)  # the same on every rank: ZeRO-3 gathers are collective
    blank = {"input_ids": sequences[0]["input_ids"], "labels": torch.full_like(sequences[0]["labels"], IGNORE_INDEX)}

    from ulysses_train.model.attention import sdpa_priority

    was_training = run.module.training
    run.deepspeed.eval()
    try:
        for index in range(rounds):
            sample = mine[index] if index < len(mine) else blank
            piece = slice_sequence(sample["input_ids"], sample["labels"], dims.sp, dims.sp_rank, run.pad_token_id)
            piece = {k: v.to(device) for k, v in piece.items()}
            with sdpa_priority():
                nll = per_token_nll(run.module, piece, chunk_rows)
            valid = piece["shift_labels"].reshape(-1) != IGNORE_INDEX
            which = (piece["position_ids"].reshape(-1) // bucket).clamp(max=buckets - 1)[valid]
            sums.index_add_(0, which, nll[valid].double())
            squares.index_add_(0, which, nll[valid].double() ** 2)
            counts.index_add_(0, which, torch.ones_like(which, dtype=torch.float64))
            if progress and dims.rank == 0 and ((index + 1) % max(1, rounds // 5) == 0 or index + 1 == rounds):
                print(f"  length {length:,}: sequence {index + 1}/{rounds} per dp group done", flush=True)
    finally:
        run.deepspeed.train(was_training)
    totals = torch.stack([sums, counts, squares])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals, op=torch.distributed.ReduceOp.SUM)
    totals = totals.cpu()
    return PositionLoss(length=length, bucket=bucket, sequences=len(sequences),
                        nll_sum=totals[0].tolist(), count=[int(c) for c in totals[1].tolist()],
                        unigram_entropy=unigram_entropy([scored_labels(s) for s in sequences]),
                        nll_sq_sum=totals[2].tolist())


# ---------------------------------------------------------------- what to evaluate


def parse_tokens(text: str, minimum: int = 2) -> int:
    """4096, 16K, 1M (K = 1024, M = 1024*1024)."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ConfigError(f"{text!r} is not a token count (examples: 4096, 16K, 1M).") from None
    if value < minimum:
        raise ConfigError(f"{text!r}: must be at least {minimum} tokens.")
    return value



def demo_probe_sequences(length: int, count: int, seed: int = 0, task=None) -> list[dict]:
    """Needle probes for the demo model (tokens of `demo.RetrievalTask`), one answer per sequence.

    Training samples ask many questions in a block at the end; a probe asks exactly once: the needle (a key
    token and its value token) sits at positions 1..17, filler follows, and probe i asks the key once at a
    position spread evenly over the sequence, (i + 0.5) / count; the value is the label after it, as in training.
    Only the answer is scored, so the loss at position p is the loss of retrieving across ~p tokens.
    Chance (a model that knows an answer is one of the values) is ln(num_values). `task` gives the token
    layout (a `RetrievalTask`; default the demo's own).
    """
    from ulysses_train.data.demo import BOS, RetrievalTask

    task = task or RetrievalTask()
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + DEMO_EVAL_INDEX + i)
        ids = torch.randint(0, task.num_filler, (length,), generator=gen) + task.filler_base
        ids[0] = BOS
        key = int(torch.randint(0, task.num_keys, (1,), generator=gen))
        value = int(torch.randint(0, task.num_values, (1,), generator=gen))
        place = 1 + int(torch.randint(0, max(1, min(16, length // 4)), (1,), generator=gen))
        ids[place], ids[place + 1] = task.key_base + key, task.value_base + value
        start = place + 2
        q = start + int((i + 0.5) * (length - 2 - start) / count)
        ids[q] = task.key_base + key
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[q + 1] = task.value_base + value
        out.append({"input_ids": ids.unsqueeze(0), "labels": labels.unsqueeze(0)})
    return out


def _as_sample(row) -> dict:
    out = {}
    for key in ("input_ids", "labels"):
        value = torch.as_tensor(row[key], dtype=torch.long)
        out[key] = value.unsqueeze(0) if value.dim() == 1 else value
    return out


def eval_sequences(cfg: Config, length: int, count: int, sp: int = 1, labels: str = "data",
                   tokens_file: str = "", dataset=None) -> list[dict]:
    """`count` sequences of `length` tokens to evaluate, from the run config's data section.

    - `tokens_file` (.pt or .npy, [N, T] token ids, T >= length): the first `length` tokens of each row;
    - `data.source: demo`: needle probes, one scored answer each (`demo_probe_sequences`);
    - a corpus: glued at this length like training data (data/corpus.py, cached; document packing would
      restart positions), rows spread over the corpus.
      These are training sequences unless the source is a held-out corpus: point `--set data.source=` at one.
    `dataset`: an already packed dataset of this length (the trainer passes its own).
    `labels`: `data` scores what the data labels (demo: answers only; corpora: every real token),
    `all` scores every next token.
    """
    if labels not in LABEL_MODES:
        raise ConfigError(f"labels={labels!r} is not valid; choose one of {', '.join(LABEL_MODES)}.")
    if tokens_file:
        rows = _load_token_rows(tokens_file, length)[:count]
        samples = [{"input_ids": r.unsqueeze(0), "labels": r.unsqueeze(0).clone()} for r in rows]
    elif cfg.data.source == "demo":
        samples = demo_probe_sequences(length, count, seed=cfg.train.seed)
    else:
        if dataset is None:
            dataset = _glued_sequences(cfg, length, sp)
        if len(dataset) == 0:
            raise ConfigError(f"data.source={cfg.data.source!r} has fewer than {length:,} tokens; nothing to "
                              f"evaluate at that length.")
        picks = sorted({int(i * len(dataset) / count) for i in range(min(count, len(dataset)))})
        samples = [_as_sample(dataset[i]) for i in picks]
    if labels == "all":
        samples = [{"input_ids": s["input_ids"], "labels": s["input_ids"].clone()} for s in samples]
    return samples


def _glued_sequences(cfg: Config, length: int, sp: int):
    """The run's corpus packed at `length` for a loss by position: always glued and without a padded tail (a
    position means the same context length in every sequence; document packing would restart it)."""
    import dataclasses

    from ulysses_train.data.corpus import prepare_run_data
    from ulysses_train.data.form import DataForm

    form = dataclasses.replace(DataForm.from_config(cfg.data), packing="glue", drop_last=True)
    dataset, _ = prepare_run_data(cfg.data, cfg.model.name_or_path, length, sp, form=form)
    return dataset


def _load_token_rows(path: str, length: int) -> torch.Tensor:
    if not os.path.isfile(path):
        raise ConfigError(f"--tokens {path!r} does not exist.")
    if path.endswith(".npy"):
        import numpy as np

        rows = torch.from_numpy(np.load(path))
    else:
        rows = torch.as_tensor(torch.load(path, weights_only=True))
    rows = rows.long().reshape(-1, rows.shape[-1]) if rows.dim() > 1 else rows.long().unsqueeze(0)
    if rows.shape[-1] < length:
        raise ConfigError(f"--tokens {path!r} holds rows of {rows.shape[-1]:,} tokens; length {length:,} asks for more.")
    return rows[:, :length]


def reference_lines(cfg: Config, labels: str = "data", tokens_file: str = "") -> dict:
    """Extra horizontal lines for the plot. The demo probes' answers: chance is ln(num_values) (the unigram
    entropy of the answers of a few probes is lower: a small sample of a uniform distribution)."""
    if cfg.data.source != "demo" or labels != "data" or tokens_file:
        return {}
    from ulysses_train.data.demo import RetrievalTask

    task = RetrievalTask()
    return {f"chance, ln({task.num_values})": task.chance_loss}


def rope_summary(hf_config) -> dict:
    """What the plot's reader needs to know about positions: the RoPE dict and the trained length."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    trained = rope.get("original_max_position_embeddings") or getattr(hf_config, "max_position_embeddings", None)
    return {"rope_parameters": rope, "trained_length": int(trained) if trained else None}


def format_summary(name: str, result: PositionLoss, trained_length: Optional[int] = None) -> str:
    """One line: overall mean, first and last bucket, last quarter, and the reference."""
    means = [m for m in result.mean_nll if m is not None]
    quarter = result.mean_over(result.length * 3 // 4, result.length)
    parts = [f"{name}: length {result.length:,} x {result.sequences}",
             f"mean NLL {result.overall:.4f}" if result.overall is not None else "no scored tokens"]
    if means:
        parts.append(f"first bucket {means[0]:.4f}, last bucket {means[-1]:.4f}")
    if quarter is not None:
        parts.append(f"last quarter {quarter:.4f}")
    if trained_length and trained_length < result.length:
        beyond = result.mean_over(trained_length, result.length)
        within = result.mean_over(0, trained_length)
        if beyond is not None and within is not None:
            parts.append(f"within trained length {within:.4f}, beyond {beyond:.4f}")
    parts.append(f"unigram entropy {result.unigram_entropy:.4f}" if not math.isnan(result.unigram_entropy)
                 else "unigram entropy n/a")
    return " | ".join(parts)


def run_record(name: str, results: Sequence[PositionLoss], model: str = "", hf_config=None, **extra) -> dict:
    """The JSON of one evaluated run, as plots.py reads it."""
    record = {"name": name, "model": model, "results": [r.to_dict() for r in results]}
    if hf_config is not None:
        record.update(rope_summary(hf_config))
    record.update(extra)
    return record
