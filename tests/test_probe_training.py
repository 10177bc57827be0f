"""Retrieval probes during training (the eval section of a run config: diagnostics/probe_training.py): probes
scored before the first step and every eval_every steps, the first-step check's line (diagnostics/first_step.py)
and its verdict, the section's validation and its refusal for the demo; the GPU YaRN story's probe task
(benchmarks/yarn_probe_task.py). test_retrieval_probes.py: the probes, their scores and eval_context.py."""
import json
import os
import random

import pytest
import torch
from helpers import REPO, load_script, run_workers
from test_retrieval_probes import check_against_reference, tokenizer_of


def check_first_step_line(stdout, cache, probe_model_dir):
    """The first-step check's two numbers against a plain forward of the starting model on the first packed row:
    its last 256 tokens alone, and the same tokens at the end of the 512-token row."""
    import re

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    found = re.search(r"first-step check: the last 256 tokens of the first sample score mean NLL ([0-9.]+) inside "
                      r"the 512-token sequence, ([0-9.]+) on their own: consistent\.", stdout)
    assert found, stdout[-2000:]
    row = next(iter(Dataset.from_file(str(sorted(cache.glob("packed-*/*.arrow"))[0]))))
    ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
    model = AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32, attn_implementation="sdpa")

    def mean_nll(i, lab):
        with torch.no_grad():
            logits = model(input_ids=i).logits[0, :-1]
        target = lab[0, 1:]
        return torch.nn.functional.cross_entropy(logits[target != -100], target[target != -100]).item()

    tail_labels = labels.clone()
    tail_labels[:, :257] = -100
    assert abs(float(found.group(1)) - mean_nll(ids, tail_labels)) < 1.5e-3
    assert abs(float(found.group(2)) - mean_nll(ids[:, 256:], labels[:, 256:])) < 1.5e-3


def test_first_step_verdict_names_the_causes_only_when_context_hurts():
    from ulysses_train.diagnostics.first_step import verdict

    assert verdict(2.0, 1.8, 4096, 65536).endswith(": consistent.")
    assert verdict(2.0, 2.4, 4096, 65536).endswith(": consistent.")  # within the margin
    worse = verdict(2.0, 9.5, 4096, 65536)
    assert "7.50 nats WORSE with more context" in worse and "RoPE" in worse and "\n" not in worse
    assert "skipped" in verdict(None, None, 4096, 65536)


def test_eval_section_probes_before_and_during_training(probe_model_dir, tmp_path):
    """eval.every=2 over 2 steps of a corpus run (sp=2): the step-0 grid equals a plain forward of the starting
    model, the step-2 grid one of the exported model (and the two differ: the weights moved); the CSV monitor
    gets one accuracy row per evaluation; the first-step check's two losses equal a plain forward."""
    from conftest import generated_words

    from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences

    words = generated_words(seed=2)
    rng = random.Random(0)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n"
                              for _ in range(40)))
    with open(os.path.join(REPO, "ds_configs", "zero3.json")) as fh:
        ds = json.load(fh)
    ds["optimizer"]["params"]["lr"] = 1e-3
    ds["csv_monitor"] = {"enabled": True}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    settings = [f"model.name_or_path={probe_model_dir}", "model.dtype=float32", "model.attn_implementation=sdpa",
                "parallel.sequence_parallel_size=2", f"data.source={corpus}", f"data.tokenizer={probe_model_dir}",
                "data.seq_length=512", f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={out}",
                "train.steps=2", f"train.deepspeed_config={tmp_path / 'ds.json'}", "eval.every=2",
                "eval.tasks=[passkey]", "eval.depths=[0, 100]", "eval.lengths=[700]"]
    proc = run_workers(2, [arg for s in settings for arg in ("--set", s)],
                       script=os.path.join(REPO, "scripts", "train.py"))
    assert "eval step 0: retrieval accuracy: " in proc.stdout and "eval step 2: retrieval accuracy: " in proc.stdout
    check_first_step_line(proc.stdout, tmp_path / "cache", probe_model_dir)
    tokenizer = tokenizer_of(probe_model_dir)
    sequences = probe_sequences(tokenizer, Haystack(tokenizer), ["passkey"], [700], [0, 100], 1, 0)
    results = {}
    for step, reference in ((0, probe_model_dir), (2, str(out / "hf_model"))):
        with open(out / "eval" / f"retrieval_step_{step}" / "retrieval.json") as fh:
            results[step] = json.load(fh)["probes"]
        check_against_reference({"records": results[step]}, sequences, reference)
    assert max(abs(a["logprob"] - b["logprob"]) / abs(b["logprob"]) for a, b in zip(results[0], results[2])) > 1e-4
    rows = (out / "monitor" / "run" / "Eval_retrieval_accuracy_passkey.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2


def test_eval_section_is_validated_and_the_demo_is_refused(tmp_path):
    from ulysses_train.config import ConfigError, load_config
    from ulysses_train.diagnostics.probe_training import ProbeEvaluator, monitor_events

    cfg = load_config(None, ["eval.every=5", "eval.tasks=[vartrack]", "eval.lengths=[4096]"])
    assert (cfg.eval.every, cfg.eval.tasks, cfg.eval.lengths, cfg.eval.depths) == (5, ["vartrack"], [4096],
                                                                                  [0, 25, 50, 75, 100])
    for bad, message in (("eval.every=-1", "eval.every=-1 must be an integer >= 0"),
                         ("eval.depths=[0, 101]", "must be a list of percentages, 0 to 100"),
                         ("eval.tasks=[needle]", "must be a list of tasks from passkey"),
                         ("eval.haystack=/no/such/file", "is not a file")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            load_config(None, [bad])
    demo = load_config(None, ["eval.every=1"], defaults={"data": {"source": "demo"}})
    with pytest.raises(ConfigError, match=r"eval.tasks=\[demo\] goes with data.source=demo and only with it"):
        ProbeEvaluator(demo, str(tmp_path))
    demo = load_config(None, ["eval.every=1", "eval.tasks=[demo]", "eval.depths=[0, 50, 100]"],
                       defaults={"data": {"source": "demo", "seq_length": 128}})
    sequences = ProbeEvaluator(demo, str(tmp_path)).sequences
    assert [(s.probes[0].depth, s.probes[0].needle_start) for s in sequences] == [(0, 1), (50, 51), (100, 101)]
    for s in sequences:  # the needle's key and value; the key asked in a block at the end; the value answered last
        ids, p = s.input_ids[0], s.probes[0]
        assert ids[p.needle_start + 1] == ids[-1] == p.answer_ids[0] and (ids[-25:-1] == ids[p.needle_start]).all()
        assert (s.labels[0] != -100).nonzero().reshape(-1).tolist() == [127] and p.answer_start == 127
    with pytest.raises(ConfigError, match="or \\[demo\\] alone"):
        load_config(None, ["eval.tasks=[demo, passkey]"])
    table = [{"task": "passkey", "count": 3, "accuracy": 1 / 3, "mean_logprob": -3.0},
             {"task": "passkey", "count": 1, "accuracy": 1.0, "mean_logprob": -1.0}]
    assert monitor_events(table, 7) == [("Eval/retrieval_accuracy/passkey", 0.5, 7),
                                        ("Eval/retrieval_logprob/passkey", -2.5, 7)]


def test_yarn_probe_task_prepares_a_tokenizer_and_trains_on_labelled_answers(tmp_path):
    """benchmarks/yarn_probe_task.py (the GPU YaRN story): its tokenizer splits digits one per token; its training
    samples label exactly the answer tokens, differ by index and repeat for the same one."""
    task = load_script("benchmarks/yarn_probe_task.py")
    folder = task.prepare(str(tmp_path / "model"))
    tokenizer = tokenizer_of(folder)
    assert tokenizer.tokenize(" 4821937")[-7:] == list("4821937")
    data = task.ProbeTrainingSet(tokenizer, 900, 4, tasks=("passkey", "multikey"))
    first, again, second = data[0], data[0], data[1]
    assert torch.equal(first["input_ids"], again["input_ids"]) and first["input_ids"].shape == (1, 900)
    answer = tokenizer.decode(first["labels"][first["labels"] != -100].tolist())  # " 4821937": a space, 7 digits
    assert answer[0] == " " and len(answer) == 8 and answer[1:].isdigit()
    assert answer in tokenizer.decode(first["input_ids"][0, :-8].tolist())  # at the needle
    assert (second["labels"] != -100).sum() == 4 * 8  # multikey: four asked keys
