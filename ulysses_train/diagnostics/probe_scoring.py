"""Retrieval probes scored teacher-forced, without generation, through the trainer's own engine.

Why no generation: greedy decoding of an answer of k tokens is k forwards of the whole context; teacher forcing
reads every answer token's log-probability and argmax from one forward of the sequence with the answers in it.
An answer is an exact match when each of its tokens is the argmax given the true prefix: what greedy decoding
would produce (for the tokenization the probe uses). Several probes share one forward (questions follow the
whole haystack), so one long sequence scores many depths.

How it runs, per sequence (probe_tasks.ProbeSequence):
- each sp rank takes its slice exactly as in training (`slice_sequence`: labels shifted before slicing, global
  positions) and runs the decoder (Ulysses all-to-all inside attention: evaluation.slice_hidden_states);
- the head is applied only to the rows whose label is an answer token, after ZeRO-3 gathers its weight once, with
  the model's own logit scale and soft-cap: no `seq x vocab` logits ever exist;
- the answer tokens' log-probs and hits are summed over the sp group (each token lives on exactly one rank);
  the group's sp rank 0 keeps one record per probe;
- dp groups take every dp-th sequence (ranks with fewer run a blank sequence, so ZeRO-3's collective gathers stay
  in step); at the end every rank receives every record. Cells (task, length, depth) are built from the
  records alone, so nothing is scaled by sp or dp, whatever the probe count on each rank.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.diagnostics.evaluation import _gathered, slice_hidden_states
from ulysses_train.parallel.layout import slice_sequence
from ulysses_train.model.loss import transform_logits


@dataclass(frozen=True)
class ProbeResult:
    """One probe's score: the sum of its answer tokens' log-probs, and whether every token was the argmax."""

    task: str
    length: int
    depth: int
    sequence: int
    probe: int
    tokens: int
    logprob: float
    hits: int  # answer tokens that were the argmax given the true prefix
    exact: bool  # hits == tokens: greedy decoding would have produced the answer


@torch.no_grad()
def answer_token_scores(module, piece: dict, chunk_rows: int = 1024) -> tuple:
    """(log-prob, argmax hit) of every labelled row of this rank's slice, [valid rows] each, and the rows' global
    target positions (the position of the token predicted). Collective under ZeRO-3 (one weight gather)."""
    hidden = slice_hidden_states(module, piece)
    labels = piece["shift_labels"].reshape(-1)
    valid = labels != IGNORE_INDEX
    rows, targets = hidden[valid], labels[valid]
    logprob = torch.zeros(targets.shape, dtype=torch.float64, device=hidden.device)
    hit = torch.zeros(targets.shape, dtype=torch.float64, device=hidden.device)
    head = module.causal_lm.get_output_embeddings()
    with _gathered(head.weight):
        for start in range(0, rows.shape[0], chunk_rows):
            end = min(start + chunk_rows, rows.shape[0])
            logits = transform_logits((rows[start:end] @ head.weight.t()).float(), head.logit_transform)
            picked = torch.log_softmax(logits, dim=-1).gather(1, targets[start:end, None])[:, 0]
            logprob[start:end] = picked.double()
            hit[start:end] = (logits.argmax(dim=-1) == targets[start:end]).double()
    return logprob, hit, piece["position_ids"].reshape(-1)[valid] + 1


def _sequence_records(run, index: int, sequence, chunk_rows: int) -> list:
    """Score one sequence on this rank's slice, summed over the sp group; one ProbeResult per probe."""
    dims, device = run.dims, run.device
    piece = slice_sequence(sequence.input_ids, sequence.labels, dims.sp, dims.sp_rank, run.pad_token_id)
    piece = {k: v.to(device) for k, v in piece.items()}
    from ulysses_train.model.attention import sdpa_priority

    with sdpa_priority():
        logprob, hit, positions = answer_token_scores(run.module, piece, chunk_rows)
    spans = [range(p.answer_start, p.answer_start + len(p.answer_ids)) for p in sequence.probes]
    where = {pos: i for i, pos in enumerate(pos for span in spans for pos in span)}
    totals = torch.zeros(2, len(where), dtype=torch.float64, device=device)
    index_of = torch.tensor([where[int(p)] for p in positions.tolist()], dtype=torch.long, device=device)
    totals[0].index_add_(0, index_of, logprob)
    totals[1].index_add_(0, index_of, hit)
    totals = run.module.sequence_parallel.sum(totals).cpu()
    out, first = [], 0
    for k, (p, span) in enumerate(zip(sequence.probes, spans)):
        part = totals[:, first:first + len(span)]
        first += len(span)
        hits = int(round(float(part[1].sum())))
        out.append(ProbeResult(p.task, p.length, p.depth, index, k, len(span), float(part[0].sum()), hits,
                               hits == len(span)))
    return out


def score_probes(run, sequences: Sequence, chunk_rows: int = 1024, progress: bool = False, stop=None,
                 into: list | None = None) -> list:
    """Every probe of `sequences` scored (collective: every rank calls it with the same list); every rank gets
    every record, in (sequence, probe) order. The model is put in eval mode and restored, so this can run
    between training steps. `stop` (a StopRequest): all ranks agree after every round whether one was asked to stop,
    and then return the records done so far (a grid of long sequences can take many minutes; SIGTERM must not wait
    for it). `into`: a list that receives this rank's records as each sequence is done, so a stop at once (a second
    signal, mid-sequence) can still write them."""
    dims = run.dims
    mine = list(range(dims.dp_rank, len(sequences), dims.dp))
    rounds = -(-len(sequences) // dims.dp)  # the same on every rank: ZeRO-3 gathers are collective
    records = into if into is not None else []
    was_training = run.module.training
    run.deepspeed.eval()
    try:
        for step in range(rounds):
            if step < len(mine):
                done = _sequence_records(run, mine[step], sequences[mine[step]], chunk_rows)
                records += done if dims.sp_rank == 0 else []
            else:
                _blank_round(run, sequences[0], chunk_rows)
            if progress and dims.rank == 0:
                print(f"  probes: sequence {step + 1}/{rounds} per dp group done", flush=True)
            if stop is not None and stop.agreed():
                break
    finally:
        run.deepspeed.train(was_training)
    if torch.distributed.is_initialized() and dims.world_size > 1:
        gathered = [None] * dims.world_size
        torch.distributed.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    return sorted(records, key=lambda r: (r.sequence, r.probe))


def _blank_round(run, like, chunk_rows: int) -> None:
    """A forward with nothing labelled, for a dp rank that has run out of sequences (keeps ZeRO-3 in step)."""
    blank = slice_sequence(like.input_ids, torch.full_like(like.input_ids, IGNORE_INDEX), run.dims.sp,
                           run.dims.sp_rank, run.pad_token_id)
    from ulysses_train.model.attention import sdpa_priority

    with sdpa_priority():
        answer_token_scores(run.module, {k: v.to(run.device) for k, v in blank.items()}, chunk_rows)


# ---------------------------------------------------------------- cells


def cells(records: Sequence[ProbeResult]) -> list:
    """Per (task, length, depth): count, accuracy (exact matches / count), mean answer log-prob (per probe) and
    mean log-prob per answer token, in sorted order."""
    groups = defaultdict(list)
    for r in records:
        groups[(r.task, r.length, r.depth)].append(r)
    out = []
    for (task, length, depth), rs in sorted(groups.items()):
        out.append({"task": task, "length": length, "depth": depth, "count": len(rs),
                    "accuracy": sum(r.exact for r in rs) / len(rs),
                    "mean_logprob": sum(r.logprob for r in rs) / len(rs),
                    "mean_token_logprob": sum(r.logprob for r in rs) / sum(r.tokens for r in rs)})
    return out


def records_as_dicts(records: Sequence[ProbeResult]) -> list:
    return [asdict(r) for r in records]


def summary_line(table: list, trained_length: Optional[int] = None) -> str:
    """One line: probes and accuracy per task, and within / beyond the trained length where both occur."""
    def accuracy(rows):
        count = sum(c["count"] for c in rows)
        return sum(c["accuracy"] * c["count"] for c in rows) / count if count else None

    tasks = sorted({c["task"] for c in table})
    parts = [f"{sum(c['count'] for c in table)} probes"]
    parts += [f"{t} {100 * accuracy([c for c in table if c['task'] == t]):.1f}%" for t in tasks]
    if trained_length:
        within = accuracy([c for c in table if c["length"] <= trained_length])
        beyond = accuracy([c for c in table if c["length"] > trained_length])
        if within is not None and beyond is not None:
            parts.append(f"within trained length {trained_length:,}: {100 * within:.1f}%, beyond: {100 * beyond:.1f}%")
    return "retrieval accuracy: " + " | ".join(parts)
