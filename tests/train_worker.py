"""One rank of an end-to-end trainer test: train through `Trainer` (demo data), then rank 0 records the
engine's summed NLL of a fixed sample so the test can compare the exported Hugging Face model with it.

Launched by tests/test_train_script.py via torchrun; extra arguments are --set overrides.
"""
import json
import sys

import torch

from ulysses_train.cli import DEMO_DEFAULTS
from ulysses_train.config import load_config
from ulysses_train.parallel.layout import exit_process, slice_sequence
from ulysses_train.training.loop import Trainer


def main():
    out, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, overrides, defaults=DEMO_DEFAULTS)
    trainer = Trainer(cfg, overwrite=True)
    trainer.train()
    run = trainer.engine
    sample = trainer.dataset[12345]
    piece = slice_sequence(sample["input_ids"], sample["labels"], run.dims.sp, run.dims.sp_rank)
    run.deepspeed.eval()
    with torch.no_grad():
        nll, _ = run.deepspeed(**piece)
    total = nll.detach().clone()
    torch.distributed.all_reduce(total)
    if run.dims.rank == 0:
        with open(out, "w") as fh:
            json.dump({"nll_sum": total.item()}, fh)
        torch.save(sample, out + ".sample.pt")
    exit_process(0)


if __name__ == "__main__":
    main()
