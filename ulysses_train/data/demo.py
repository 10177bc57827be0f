"""The embedded demo: a tiny Qwen3 learns needle retrieval across sequence-parallel slices.

Each sequence is random filler with a needle in its first quarter: a key token followed by a value token.
At the very end the key is asked `queries` times (the key token repeated); the label after each asked key
is the value. The value never appears again after the needle, so no answer can be copied from nearby
tokens: every answer needs attention back to the needle. Only answers carry labels, so the loss is the
answer-token loss; a model that knows an answer is a value but not which one scores ln(num_values).
The needle sits in the first sp slice and the questions in the last, so the answer is reachable only
through attention over the whole sequence, i.e. through the Ulysses all-to-all.

With one pair per sequence (the default) the key adds nothing the needle's presence does not: this tests
long-range attention, not key matching. `pairs > 1` hides several key-value pairs and asks about one of
them per question, which needs key matching (an induction circuit) and trains much more slowly.
The default sizes were chosen so the demo learns on two CPU cores in under three minutes (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ulysses_train.constants import IGNORE_INDEX

PAD, BOS = 0, 1


@dataclass(frozen=True)
class RetrievalTask:
    seq_length: int = 128
    num_keys: int = 4
    num_values: int = 8
    num_filler: int = 32
    pairs: int = 1
    queries: int = 24
    seed: int = 0

    @property
    def key_base(self) -> int:
        return 2

    @property
    def value_base(self) -> int:
        return self.key_base + self.num_keys

    @property
    def filler_base(self) -> int:
        return self.value_base + self.num_values

    @property
    def vocab_size(self) -> int:
        return self.filler_base + self.num_filler

    @property
    def chance_loss(self) -> float:
        """Answer loss of a model that knows an answer is a value but not which: ln(num_values)."""
        return math.log(self.num_values)

    def is_value(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.value_base) & (ids < self.filler_base)

    def __post_init__(self):
        if self.pairs > self.num_keys:
            raise ValueError(f"demo: {self.pairs} pairs need at least as many keys (have {self.num_keys}).")
        if 2 * self.pairs > self.seq_length // 4 - 1 or self.seq_length // 4 + self.queries + 1 > self.seq_length:
            raise ValueError(f"demo: seq_length={self.seq_length} is too short for {self.pairs} pairs and "
                             f"{self.queries} queries.")

    def sample(self, index: int) -> dict:
        """Sample `index` of an endless deterministic stream: [1, seq_length] input_ids and labels.

        Labels follow the Hugging Face convention (label p is predicted at position p - 1), so the label after
        an asked key is its value while the input token there is the next asked key."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        keys = torch.randperm(self.num_keys, generator=gen)[: self.pairs]
        values = torch.randint(0, self.num_values, (self.pairs,), generator=gen)
        asked = torch.randint(0, self.pairs, (self.queries + 1,), generator=gen)
        ids = torch.randint(0, self.num_filler, (self.seq_length,), generator=gen) + self.filler_base
        ids[0] = BOS
        # the pairs sit at random even offsets in the first quarter, which is inside the first slice for sp <= 4
        slots = (self.seq_length // 4 - 1) // 2
        places = torch.randperm(slots, generator=gen)[: self.pairs] * 2 + 1
        ids[places] = keys + self.key_base
        ids[places + 1] = values + self.value_base
        # the last queries + 1 tokens are asked keys; each label after an asked key is that key's value
        ids[self.seq_length - self.queries - 1:] = keys[asked] + self.key_base
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[self.seq_length - self.queries:] = values[asked[:-1]] + self.value_base
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
