"""The embedded demo: a tiny Qwen3 learns needle (key-value) retrieval across sequence-parallel slices.

Each sequence is random filler with `pairs` pair tokens (one token names a key and its value) hidden
at random places in its first quarter, and `queries` questions `key QUERY` at the very end. Only the
answer (the value after a queried key) carries a label, so
the loss is the answer-token loss; guessing among the values gives ln(num_values). The pairs sit in the
first sp slice and the questions in the last, so the answer is reachable only through attention over the
whole sequence, i.e. through the Ulysses all-to-all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
PAD, BOS, QUERY = 0, 1, 2


@dataclass(frozen=True)
class RetrievalTask:
    seq_length: int = 128
    num_keys: int = 4
    num_values: int = 16
    num_filler: int = 32
    pairs: int = 1
    queries: int = 24
    seed: int = 0

    @property
    def key_base(self) -> int:
        return 3

    @property
    def value_base(self) -> int:
        return self.key_base + self.num_keys

    @property
    def pair_base(self) -> int:
        return self.value_base + self.num_values

    @property
    def filler_base(self) -> int:
        return self.pair_base + self.num_keys * self.num_values

    @property
    def vocab_size(self) -> int:
        return self.filler_base + self.num_filler

    @property
    def chance_loss(self) -> float:
        """Answer loss of a model that knows an answer is a value but not which: ln(num_values)."""
        return math.log(self.num_values)

    def __post_init__(self):
        if self.pairs > self.num_keys:
            raise ValueError(f"demo: {self.pairs} pairs need at least as many keys (have {self.num_keys}).")
        if self.pairs >= self.seq_length // 4 - 1 or self.seq_length // 4 + 2 * self.queries > self.seq_length:
            raise ValueError(f"demo: seq_length={self.seq_length} is too short for {self.pairs} pairs and "
                             f"{self.queries} queries.")

    def sample(self, index: int) -> dict:
        """Sample `index` of an endless deterministic stream: [1, seq_length] input_ids and labels."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        keys = torch.randperm(self.num_keys, generator=gen)[: self.pairs]
        values = torch.randint(0, self.num_values, (self.pairs,), generator=gen)
        asked = torch.randint(0, self.pairs, (self.queries,), generator=gen)
        # a question is `key QUERY`: the value is the label of the QUERY slot but never appears in the input,
        # so no answer can be copied from an earlier question; every one needs the needle
        questions = torch.stack([keys[asked] + self.key_base, torch.full_like(asked, QUERY)], 1).reshape(-1)
        answers = values[asked] + self.value_base
        ids = torch.randint(0, self.num_filler, (self.seq_length,), generator=gen) + self.filler_base
        ids[0] = BOS
        # the pairs hide at random places in the first quarter: in the first slice for sp <= 4
        places = torch.randperm(self.seq_length // 4 - 1, generator=gen)[: self.pairs] + 1
        ids[places] = self.pair_base + keys * self.num_values + values
        ids[self.seq_length - questions.numel():] = questions
        labels = torch.full_like(ids, IGNORE_INDEX)
        answer_positions = torch.arange(self.seq_length - questions.numel() + 1, self.seq_length, 2)
        labels[answer_positions] = answers
        return {"input_ids": ids.unsqueeze(0), "labels": labels.unsqueeze(0)}


class RetrievalDataset:
    """A fixed-size view of the stream, indexable like any dataset the trainer reads."""

    def __init__(self, task: RetrievalTask, num_samples: int):
        self.task, self.num_samples = task, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        return self.task.sample(index)


def demo_model_config(vocab_size: int):
    """The demo's tiny Qwen3: real architecture, 2 layers, hidden 128, 4 query and 2 KV heads.
    (Hidden 64 stays at chance for far longer on this task: measured, 800+ steps without progress.)"""
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=vocab_size, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=10_000.0, bos_token_id=BOS, eos_token_id=BOS,
                       pad_token_id=PAD)
