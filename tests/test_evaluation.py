"""Loss by position (scripts/eval_positions.py, evaluation.py, plots.py) and the memory profiler, on CPU.

The numbers of record are compared with a plain single-process Hugging Face forward of the same model on
the same tokens, its per-position NLL bucketed here by hand; once in one process (sp=1) and once in two
(sp=2, gloo), and once from inside training (train.eval_every) against the exported model.
"""
import csv
import json
import math
import os
from collections import Counter

import pytest
import torch
from helpers import REPO, launch_ranks, make_samples, save_tiny_model

EVAL = os.path.join(REPO, "scripts", "eval_positions.py")
TRAIN = os.path.join(REPO, "scripts", "train.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


def torchrun(nproc, script, *args, timeout=300):
    """`script` as `nproc` ranks (helpers.launch_ranks: torchrun's variables, forked from the rank server)."""
    proc = launch_ranks(nproc, [script, *args], env(), timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def direct_buckets(model_dir, sequences, bucket):
    """Per-position NLL from a plain HF forward (position p predicts token p+1), bucketed by hand:
    (means, counts, per-token NLL and validity per sequence, standard errors of the means)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    length = sequences[0]["input_ids"].shape[-1]
    buckets = -(-length // bucket)
    sums, counts, values = [0.0] * buckets, [0] * buckets, [[] for _ in range(buckets)]
    per_token = []
    with torch.no_grad():
        for s in sequences:
            logits = model(input_ids=s["input_ids"]).logits[0, :-1].double()
            target = s["labels"][0, 1:]
            nll = torch.nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
            per_token.append((nll, target != -100))
            for p in range(length - 1):
                if target[p] != -100:
                    sums[p // bucket] += nll[p].item()
                    counts[p // bucket] += 1
                    values[p // bucket].append(nll[p].item())
    means = [s / c if c else None for s, c in zip(sums, counts)]
    errors = [torch.tensor(v).std().item() / math.sqrt(len(v)) if len(v) > 1 else None for v in values]
    return means, counts, per_token, errors


def hand_entropy(sequences):
    tokens = [t for s in sequences for t in s["labels"][0, 1:].tolist() if t != -100]
    n = len(tokens)
    return -sum(c / n * math.log(c / n) for c in Counter(tokens).values())


def assert_close_lists(got, want, rel=1e-5, abs_tol=0.0):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert abs(g - w) <= rel * abs(w) + abs_tol, (g, w)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("eval_models") / "tiny"))


# ---------------------------------------------------------------- pure functions


def test_unigram_entropy_matches_hand_computation():
    from ulysses_train.diagnostics.evaluation import scored_labels, unigram_entropy

    samples = make_samples(3, 50, vocab=7, seed=3)
    samples[1]["labels"][0, 10:20] = -100
    got = unigram_entropy([scored_labels(s) for s in samples])
    assert abs(got - hand_entropy(samples)) < 1e-12
    assert unigram_entropy([torch.full((1, 5), 4)]) == 0.0  # one token type: no uncertainty
    uniform = torch.arange(8).repeat(100).unsqueeze(0)
    assert abs(unigram_entropy([uniform]) - math.log(8)) < 1e-12


def test_position_loss_arithmetic_and_round_trip():
    from ulysses_train.diagnostics.evaluation import PositionLoss

    r = PositionLoss(length=40, bucket=16, sequences=1, nll_sum=[8.0, 3.0, 0.0], count=[4, 1, 0], unigram_entropy=1.5)
    assert r.bucket_start == [0, 16, 32] and r.mean_nll == [2.0, 3.0, None]
    assert r.tokens == 5 and r.overall == 11.0 / 5 and r.mean_over(16, 40) == 3.0
    assert r.standard_error == [None] * 3  # no squares recorded
    r.nll_sq_sum = [1 + 1 + 9 + 9, 9.0, 0.0]  # values 1, 1, 3, 3 in bucket 0
    assert abs(r.standard_error[0] - math.sqrt(4 / 3 / 4)) < 1e-12 and r.standard_error[1:] == [None, None]
    assert PositionLoss.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_eval_config_keys_are_validated():
    from ulysses_train.config import ConfigError, load_config

    cfg = load_config(None, ["train.eval_every=5", "train.eval_lengths=[128, 512]"])
    assert cfg.train.eval_every == 5 and cfg.train.eval_lengths == [128, 512]
    for bad, message in (("train.eval_every=-1", "train.eval_every=-1 must be an integer >= 0"),
                         ("train.eval_lengths=[1024, 0]", "train.eval_lengths=[1024, 0] must be a list"),
                         ("train.eval_bucket=0", "train.eval_bucket=0 must be a positive integer")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, [bad])


# ---------------------------------------------------------------- the script against a plain forward


def check_outputs(out_dir, name, sequences_by_length, model_dir, bucket):
    """The run's JSON equals the direct computation; CSV and combined JSON carry the same numbers; PNG exists."""
    with open(os.path.join(out_dir, f"{name}.json")) as fh:
        record = json.load(fh)
    for result in record["results"]:
        sequences = sequences_by_length[result["length"]]
        want, counts, per_token, errors = direct_buckets(model_dir, sequences, bucket)
        assert result["count"] == counts
        assert_close_lists(result["mean_nll"], want)
        # a spread of fp32 losses near 5: absolute, not relative, precision (two tokens per bucket at bucket 1)
        assert_close_lists(result["standard_error"], errors, rel=0.0, abs_tol=1e-5)
        assert abs(result["unigram_entropy"] - hand_entropy(sequences)) < 1e-9
        # negative control: the same per-token losses with the two halves of the positions swapped
        half = (result["length"] - 1) // 2
        sums, cnt = [0.0] * len(counts), [0] * len(counts)
        for nll, valid in per_token:
            swapped = torch.cat([nll[half:], nll[:half]]), torch.cat([valid[half:], valid[:half]])
            for p in range(len(nll)):
                if swapped[1][p]:
                    sums[p // bucket] += swapped[0][p].item()
                    cnt[p // bucket] += 1
        wrong = [s / c if c else None for s, c in zip(sums, cnt)]
        assert max(abs(a - b) for a, b in zip(result["mean_nll"], wrong) if a is not None and b is not None) > 1e-3
    with open(os.path.join(out_dir, "loss_by_position.csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r["run"] == name]
    flat = [(res["length"], start, m) for res in record["results"]
            for start, m in zip(res["bucket_start"], res["mean_nll"])]
    assert [(int(r["length"]), int(r["bucket_start"])) for r in rows] == [(n, s) for n, s, _ in flat]
    for row, (_, _, m) in zip(rows, flat):
        assert (row["mean_nll"] == "") if m is None else abs(float(row["mean_nll"]) - m) < 1e-9
    with open(os.path.join(out_dir, "loss_by_position.png"), "rb") as fh:
        assert fh.read(8) == PNG_MAGIC
    return record


def test_eval_positions_one_process_matches_plain_forward(model_dir, tmp_path):
    """sp=1, demo needle probes with every next token scored, bucket of 1 token: per-token equality."""
    from ulysses_train.diagnostics.evaluation import demo_probe_sequences

    out = str(tmp_path / "out")
    torchrun(1, EVAL, "--checkpoint-or-model", model_dir, "--set", "parallel.sequence_parallel_size=1",
             "--lengths", "101", "--bucket", "1", "--labels", "all", "--num-sequences", "2", "--name", "sp1",
             "--out", out)
    sequences = [{"input_ids": s["input_ids"], "labels": s["input_ids"].clone()} for s in demo_probe_sequences(101, 2)]
    record = check_outputs(out, "sp1", {101: sequences}, model_dir, bucket=1)
    assert record["sp"] == 1 and record["trained_length"] == 4096


def test_eval_positions_sp2_matches_plain_forward_and_compares_runs(model_dir, tmp_path):
    """sp=2 on gloo, tokens from a file, odd length (padding), buckets straddling the slice boundary,
    two lengths, and an earlier run added with --compare."""
    samples = make_samples(3, 101, vocab=256, seed=5)
    tokens = torch.cat([s["input_ids"] for s in samples])
    torch.save(tokens, tmp_path / "tokens.pt")
    other = {"name": "earlier", "results": [{"length": 64, "bucket": 12, "sequences": 1, "bucket_start": [0, 12],
                                             "nll_sum": [1.0, 2.0], "count": [1, 1], "unigram_entropy": 1.0}]}
    (tmp_path / "earlier.json").write_text(json.dumps(other))
    out = str(tmp_path / "out")
    torchrun(2, EVAL, "--checkpoint-or-model", model_dir, "--tokens", str(tmp_path / "tokens.pt"),
             "--lengths", "101,64", "--bucket", "12", "--num-sequences", "3", "--name", "sp2",
             "--compare", f"before={tmp_path / 'earlier.json'}", "--out", out)
    by_length = {n: [{"input_ids": t[None, :n], "labels": t[None, :n].clone()} for t in tokens] for n in (101, 64)}
    record = check_outputs(out, "sp2", by_length, model_dir, bucket=12)
    assert record["sp"] == 2 and [r["length"] for r in record["results"]] == [101, 64]
    with open(os.path.join(out, "loss_by_position.json")) as fh:
        runs = json.load(fh)["runs"]
    assert [r["name"] for r in runs] == ["sp2", "before"] and runs[1]["results"] == other["results"]


# ---------------------------------------------------------------- inside training, and the memory profile


def test_eval_every_in_training_matches_exported_model_and_profile_is_cpu_noop(tmp_path):
    """train.eval_every=1 over 2 demo steps (sp=2): the step-2 evaluation, made by the trainer on its ZeRO-3
    engine between steps, equals a plain forward of the exported (step-2) model on the same needle probes.
    --profile-memory on CPU says it records nothing and writes nothing."""
    from ulysses_train.data.demo import RetrievalTask
    from ulysses_train.diagnostics.evaluation import demo_probe_sequences
    from ulysses_train.diagnostics.profiling import CPU_MESSAGE

    out = str(tmp_path / "run")
    proc = torchrun(2, TRAIN, "--set", f"train.output_dir={out}", "--set", "train.steps=2",
                    "--set", "train.eval_every=1", "--set", "train.eval_lengths=[192, 384]",
                    "--set", "train.eval_bucket=64", "--set", "train.eval_sequences=6", "--profile-memory")
    assert proc.stdout.count(CPU_MESSAGE) == 1
    assert not os.path.exists(os.path.join(out, "memory"))
    folder = os.path.join(out, "eval")
    assert sorted(os.listdir(folder)) == ["loss_by_position.csv", "loss_by_position.json", "loss_by_position.png",
                                          "step_00000001.json", "step_00000002.json"]
    with open(os.path.join(folder, "loss_by_position.png"), "rb") as fh:
        assert fh.read(8) == PNG_MAGIC
    with open(os.path.join(folder, "step_00000002.json")) as fh:
        record = json.load(fh)
    assert record["step"] == 2 and record["references"] == {f"chance, ln({RetrievalTask().num_values})": RetrievalTask().chance_loss}
    assert [r["length"] for r in record["results"]] == [192, 384]
    export = os.path.join(out, "hf_model")
    for result in record["results"]:
        sequences = demo_probe_sequences(result["length"], 6)
        want, counts, _, _ = direct_buckets(export, sequences, 64)
        assert result["count"] == counts and sum(counts) == 6  # one scored answer per probe
        assert_close_lists(result["mean_nll"], want)
        assert abs(result["unigram_entropy"] - hand_entropy(sequences)) < 1e-9
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2]


def synthetic_snapshot():
    """An allocator history as torch.cuda.memory._snapshot() reports it: 10000 bytes in use before recording,
    six 512-byte phase markers (kept alive), an activation and a loss chunk that come and go."""
    events = [("alloc", 100, 512), ("alloc", 101, 512), ("alloc", 1, 2048), ("alloc", 102, 512), ("alloc", 2, 4096),
              ("free_requested", 2, 4096), ("free_completed", 2, 4096), ("alloc", 103, 512),
              ("free_completed", 1, 2048), ("alloc", 104, 512), ("alloc", 105, 512)]
    trace = [{"action": a, "addr": addr, "size": size, "stream": 0, "time_us": 5_000_000 + 1000 * i}
             for i, (a, addr, size) in enumerate(events)]
    blocks = [{"size": 10000, "state": "active_allocated"}] + [{"size": 512, "state": "active_allocated"}] * 6 + \
             [{"size": 2000, "state": "inactive"}]
    snapshot = {"segments": [{"device": 0, "total_size": 32768, "blocks": blocks}], "device_traces": [trace]}
    markers = [{"name": n, "addr": a, "time_s": None} for n, a in
               (("start", 100), ("forward", 101), ("loss", 102), ("backward", 103), ("optimizer", 104), ("end", 105))]
    return snapshot, markers


def test_markers_are_found_at_their_own_alloc_when_the_address_was_used_before():
    """The caching allocator reuses addresses: a short-lived tensor at the backward marker's address early in
    the forward must not move the marker there (seen on an H200: every phase shaded one phase early)."""
    from ulysses_train.diagnostics.plots import memory_timeline

    snapshot, markers = synthetic_snapshot()
    trace = snapshot["device_traces"][0]
    early = [{"action": "alloc", "addr": 103, "size": 256, "stream": 0, "time_us": trace[1]["time_us"] + 1},
             {"action": "free_completed", "addr": 103, "size": 256, "stream": 0, "time_us": trace[1]["time_us"] + 2}]
    snapshot["device_traces"][0] = trace[:2] + early + trace[2:]
    found = {m["name"]: m["index"] for m in memory_timeline(snapshot, markers=markers)["markers"]}
    assert found["backward"] == 7 + 2  # the marker's own alloc (index 7 before the two events were inserted)
    assert found["loss"] == 3 + 2 and found["forward"] == 1


def test_memory_timeline_from_a_snapshot(tmp_path):
    from ulysses_train.diagnostics.plots import memory_timeline, plot_memory_timeline

    snapshot, markers = synthetic_snapshot()
    line = memory_timeline(snapshot, markers=markers)
    assert line["allocated"] == [10512, 11024, 13072, 13584, 17680, 17680, 13584, 14096, 12048, 12560, 13072]
    assert line["reserved"] == [32768] * 11 and line["peak_allocated"] == 17680
    assert line["time"] == [float(i) for i in range(11)] and line["time_unit"] == "ms"
    png = str(tmp_path / "memory.png")
    drawn = plot_memory_timeline(snapshot, png, markers)
    assert drawn["phases"] == [("start", 0.0, 1.0), ("forward", 1.0, 3.0), ("loss", 3.0, 7.0),
                               ("backward", 7.0, 9.0), ("optimizer", 9.0, 10.0)]
    with open(png, "rb") as fh:
        assert fh.read(8) == PNG_MAGIC


def test_memory_profile_on_cpu_is_a_noop_that_says_so(tmp_path, capsys):
    from ulysses_train.diagnostics.profiling import CPU_MESSAGE, MemoryProfile

    with MemoryProfile(str(tmp_path / "memory"), tag="step_2") as profile:
        profile.mark("forward")
        torch.ones(4).sum()
    assert CPU_MESSAGE in capsys.readouterr().out
    assert not profile.enabled and profile.markers == [] and not (tmp_path / "memory").exists()


def test_memory_profile_phase_hooks_fire_in_step_order():
    """The hooks that mark phases, exercised on CPU: forward, loss, backward (not again in the recompute of a
    checkpointed layer), optimizer, for each of two micro-steps."""
    from helpers import tiny_qwen3_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.diagnostics.profiling import MemoryProfile
    from ulysses_train.model.loading import LongContextCausalLM, enable_gradient_checkpointing

    causal_lm = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32)
    causal_lm.train()
    enable_gradient_checkpointing(causal_lm)
    module = LongContextCausalLM(causal_lm, chunk_rows=8)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    profile = MemoryProfile("unused", module=module, optimizer=optimizer)
    profile.enabled = True  # CPU sentinels: only the hooks are under test here
    profile._install_hooks()
    ids = torch.randint(0, 256, (1, 32))
    for _ in range(2):
        nll, _ = module(ids, torch.arange(32)[None], ids)
        nll.backward()
        optimizer.step()
    for hook in profile._hooks:
        hook.remove()
    assert [m["name"] for m in profile.markers] == ["forward", "loss", "backward", "optimizer"] * 2
    assert len({m["addr"] for m in profile.markers}) == 8  # sentinels stay alive: every address is distinct


def test_eval_script_bad_input_exits_2_with_a_message(tmp_path, capsys):
    """Refused before any process group starts: a missing --compare file, a bad length, a checkpoint-only folder."""
    from helpers import load_script

    script = load_script(os.path.relpath(EVAL, REPO))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    cases = [(["--lengths", "64", "--compare", "a=missing.json"], "--compare 'a=missing.json' must be NAME=FILE.json"),
             (["--lengths", "12Q"], "'12Q' is not a token count"),
             (["--lengths", "64", "--checkpoint-or-model", str(tmp_path / "run")],
              "holds DeepSpeed checkpoints but no exported model"),
             # a model named without --config kept the demo's defaults (random weights, the demo's data)
             (["--lengths", "64", "--set", "model.name_or_path=/no/such/model"],
              "model.name_or_path='/no/such/model': the local path '/no/such/model' does not exist"),
             (["--lengths", "64", "--set", "model.name_or_path=Qwen/Qwen3-8B"], "data.source=demo is the demo")]
    for args, message in cases:
        assert script.main([*args, "--out", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
    assert script.parse_tokens("16K") == 16384 and script.parse_tokens("1M") == 2**20
