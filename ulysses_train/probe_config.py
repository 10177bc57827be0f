"""The run config's `eval` section: retrieval probes during training (run by probe_training.ProbeEvaluator).

Its own module, importing nothing heavier than errors.py, so config.py can hold the section without importing the
probes, the engine or torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ulysses_train.errors import ConfigError

TASKS = ("passkey", "multikey", "multivalue", "vartrack")
DEMO_TASK = "demo"  # the embedded demo's own tokens (it has no tokenizer): probe_tasks.demo_sequences
DEFAULT_DEPTHS = [0, 25, 50, 75, 100]


@dataclass
class ProbeEvalConfig:
    """The `eval` section of a run config (retrieval probes; the loss by position is train.eval_*)."""

    every: int = 0
    """Score retrieval probes every N steps and before step 1 (0: never); writes <output_dir>/eval/retrieval_step_N/."""
    lengths: list = field(default_factory=list)
    """Context lengths of the probes (default: [data.seq_length])."""
    depths: list = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    """Needle depths in percent of the context."""
    tasks: list = field(default_factory=lambda: ["passkey", "multikey"])
    """passkey | multikey | multivalue | vartrack (diagnostics/probe_tasks.py); [demo] for the embedded demo."""
    samples: int = 1
    """Sequences per (task, length, depth group)."""
    chat: bool = False
    """Render the probes with the tokenizer's chat template."""
    haystack: str = ""
    """A text file to hide the facts in (default: the built-in filler)."""
    first_step_check: bool = True
    """Before step 1 from pretrained weights: score the first sample's tail alone and inside the full sequence,
    and say so when the long form is far worse (diagnostics/first_step.py)."""

    def __post_init__(self):
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 0:
            raise ConfigError(f"eval.every={self.every!r} must be an integer >= 0 (0: never).")
        if not isinstance(self.lengths, list) or any(not isinstance(n, int) or n < 2 for n in self.lengths):
            raise ConfigError(f"eval.lengths={self.lengths!r} must be a list of token counts >= 2 (or [] for "
                              f"data.seq_length).")
        if not isinstance(self.depths, list) or not self.depths or any(
                not isinstance(d, int) or not 0 <= d <= 100 for d in self.depths):
            raise ConfigError(f"eval.depths={self.depths!r} must be a list of percentages, 0 to 100.")
        if not isinstance(self.tasks, list) or not self.tasks or (any(t not in TASKS for t in self.tasks)
                                                                   and self.tasks != [DEMO_TASK]):
            raise ConfigError(f"eval.tasks={self.tasks!r} must be a list of tasks from {', '.join(TASKS)} (or [demo] "
                              f"alone, for the embedded demo).")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ConfigError(f"eval.samples={self.samples!r} must be an integer >= 1.")
        if not isinstance(self.first_step_check, bool):
            raise ConfigError(f"eval.first_step_check={self.first_step_check!r} must be true or false.")
        if self.haystack and not os.path.isfile(self.haystack):
            raise ConfigError(f"eval.haystack={self.haystack!r} is not a file; give a text file or leave it empty.")
