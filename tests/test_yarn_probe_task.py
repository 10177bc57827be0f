"""benchmarks/yarn_probe_task.py trains the model its --prepare folder describes (not the embedded demo's), in
batches of probe sequences, and exports it with its tokenizer (what scripts/eval_context.py then reads)."""
import importlib.util
import json
import os

import torch
from helpers import REPO, run_workers

SCRIPT = os.path.join(REPO, "benchmarks", "yarn_probe_task.py")


def load_task():
    spec = importlib.util.spec_from_file_location("yarn_probe_task", SCRIPT)
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    return task


def test_batches_stack_the_single_sequences(tmp_path):
    from transformers import AutoTokenizer

    task = load_task()
    folder = task.prepare(str(tmp_path / "model"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    single = task.ProbeTrainingSet(tokenizer, 300, 8)
    batched = task.ProbeTrainingSet(tokenizer, 300, 4, batch=2)[1]  # sequences 2 and 3
    assert batched["input_ids"].shape == (2, 300)
    for row, index in enumerate((2, 3)):
        assert torch.equal(batched["input_ids"][row], single[index]["input_ids"][0])
        assert torch.equal(batched["labels"][row], single[index]["labels"][0])


def test_trains_the_prepared_model_and_exports_its_tokenizer(tmp_path):
    """Regression: with the demo's data.source the trainer built the demo's own config (its vocabulary, smaller
    than the tokenizer's: an index error at the embedding) and exported no tokenizer."""
    task = load_task()
    model, out = task.prepare(str(tmp_path / "model")), str(tmp_path / "run")
    proc = run_workers(1, ["--batch", "2", "--set", f"model.name_or_path={model}", "--set", "model.random_init=true",
                           "--set", f"data.tokenizer={model}", "--set", "data.seq_length=192", "--set",
                           "model.config_overrides={max_position_embeddings: 192, num_hidden_layers: 2}",
                           "--set", "train.steps=2", "--set", f"train.output_dir={out}"], script=SCRIPT)
    assert "exported Hugging Face model" in proc.stdout
    with open(os.path.join(out, "hf_model", "config.json")) as fh:
        config = json.load(fh)
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (512, 256, 2)
    assert config["max_position_embeddings"] == 192
    assert os.path.isfile(os.path.join(out, "hf_model", "tokenizer.json"))
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        steps = [json.loads(line) for line in fh if '"loss"' in line]
    assert [s["num_tokens"] for s in steps] == [16.0, 16.0]  # 2 sequences x 8 answer tokens per step
