"""scripts/train.py end to end on CPU: config errors, the demo learning, one-process runs (monitors, LoRA, kept
checkpoints), a resume on another GPU count, refusals of a used output folder, and the exported Hugging Face model
(test_train_stops.py: stops, kills and damaged checkpoints; test_train_data.py: real corpora and sessions)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, read_metrics, run_workers
from script_cases import case, run_cases
from train_runs import TRAIN, env, train_ranks

# ---------------------------------------------------------------- bad input: exit 2, no traceback
# Every refusal below is a command of scripts/train.py; the `refusals` fixture runs them all from one launched
# process (tests/script_cases.py: the imports once, each command in its own forked child with its own environment,
# exit code and output), and each test checks its command's result.

BAD_CONFIGS = [
    (["--config", "does/not/exist.yaml"], 2, "config file 'does/not/exist.yaml' does not exist"),
    (["--set", "train.stepz=3"], 2, "unknown key train.stepz; valid keys of 'train'"),
    (["--set", "loss.type=focal"], 2, "loss.type='focal' is not valid; choose one of chunked, nll"),
    (["--set", "train.deepspeed_config=nope.json"], 2, "train.deepspeed_config='nope.json' does not exist"),
    (["--set", "parallel.sequence_parallel_size=2"], 1, "world size 1 is not divisible by parallel.sequence_parallel_size=2"),
    (["--set", "parallel.sequence_parallel_size=3"], 3, "query heads, not divisible by parallel.sequence_parallel_size=3"),
]
DATA_MISTAKES = ["missing corpus", "missing text field", "missing tokenizer", "bad bytes on line 3"]
KILLED_BEFORE_CHECKPOINT_METRICS = '{"step": 1, "loss": 3.0}\n'


def bad_config_cases(tmp_path_factory) -> list[dict]:
    """Checked before any process group starts: one process posing as rank 0 of `world` is enough."""
    return [case(f"bad config {args}", [*args, "--set", f"train.output_dir={tmp_path_factory.mktemp('bad')}"],
                 dict(env(), WORLD_SIZE=str(world), RANK="0")) for args, world, _ in BAD_CONFIGS]


def data_mistake_cases(tmp_path, bpe_tokenizer) -> list[dict]:
    """Posing as rank 0 of 2 with no rank 1: reaching the process group (after model config and DeepSpeed
    checks) would hang until the deadline, so an exit 2 with the message shows the check ran first."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"body": "no text field here"}\n')
    tokenizer_dir = str(tmp_path / "tokenizer")
    bpe_tokenizer.save_pretrained(tokenizer_dir)
    (tmp_path / "good.jsonl").write_text('{"text": "some text"}\n')
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "\xff"}\n')  # rows: data/row_checks.py
    sources = {
        "missing corpus": (str(tmp_path / "nope.jsonl"), tokenizer_dir),
        "missing text field": (str(corpus), tokenizer_dir),
        "missing tokenizer": (str(tmp_path / "good.jsonl"), str(tmp_path / "no_tokenizer")),
        "bad bytes on line 3": (str(tmp_path / "bad.jsonl"), tokenizer_dir),
    }
    return [case(f"data mistake {name}", ["--set", f"train.output_dir={tmp_path / name / 'out'}",
                                          "--set", "model.name_or_path=Qwen/Qwen3-8B", "--set", f"data.source={source}",
                                          "--set", f"data.tokenizer={tokenizer}"],
                 dict(env(), WORLD_SIZE="2", RANK="0", HF_HUB_OFFLINE="1")) for name, (source, tokenizer) in sources.items()]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, bpe_tokenizer):
    """{case name: CompletedProcess} of every refused command in this section, run from one launched process."""
    yaml_folder = tmp_path_factory.mktemp("yaml")
    (yaml_folder / "bad.yaml").write_text("train:\n  steps: 3\n  steps: 4\n")
    killed = tmp_path_factory.mktemp("killed_before_checkpoint") / "run"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text(KILLED_BEFORE_CHECKPOINT_METRICS)
    cases = [*bad_config_cases(tmp_path_factory), *data_mistake_cases(tmp_path_factory.mktemp("data"), bpe_tokenizer),
             case("duplicate yaml key", ["--config", yaml_folder / "bad.yaml"], env()),
             case("killed before its first checkpoint", ["--set", f"train.output_dir={killed}"], env())]
    results = run_cases(cases, tmp_path_factory.mktemp("refusals"), env())
    return {**results, "killed folder": killed}


@pytest.mark.parametrize("args,world,message", BAD_CONFIGS)
def test_bad_config_exits_2_with_message_and_no_traceback(args, world, message, refusals):
    """Checked before any process group starts: one process posing as rank 0 of `world` is enough."""
    proc = refusals[f"bad config {args}"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", DATA_MISTAKES)
def test_data_mistakes_are_named_before_the_model_or_the_process_group(name, refusals):
    """Posing as rank 0 of 2 with no rank 1 (data_mistake_cases): an exit 2 with the message, not a hang at the
    process group, shows the check ran before the model config, DeepSpeed and the process group."""
    message = {"missing corpus": "nope.jsonl", "missing text field": "no text field 'text'",
               "missing tokenizer": "no_tokenizer", "bad bytes on line 3": "bad.jsonl, line 3: bytes that are not UTF-8",
               }[name]
    proc = refusals[f"data mistake {name}"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_invalid_yaml_and_duplicate_keys(refusals):
    proc = refusals["duplicate yaml key"]
    assert proc.returncode == 2 and "duplicate key 'steps'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_case_runner_reports_what_the_script_itself_reports(tmp_path):
    """Negative control of tests/script_cases.py: the same refusal launched as its own process and run as a case
    gives the same exit code and error line, and a case that raises shows its traceback and exit 1, as the
    interpreter would (so "no Traceback" in a case's stderr means something)."""
    args = ["--set", "train.stepz=3", "--set", f"train.output_dir={tmp_path / 'out'}"]
    alone = subprocess.run([sys.executable, TRAIN, *args], env=env(), capture_output=True, text=True, timeout=120)
    raising = tmp_path / "raising.py"
    raising.write_text("import sys\nprint('to stdout')\nraise RuntimeError(sys.argv[1])\n")
    exiting = tmp_path / "exiting.py"
    exiting.write_text("import os, sys\nprint(os.environ['ONLY_HERE'], os.getcwd(), file=sys.stderr)\nsys.exit(7)\n")
    got = run_cases([case("refusal", args, env()), case("raises", ["boom"], env(), script=str(raising)),
                     case("exits", [], dict(env(), ONLY_HERE="yes"), cwd=tmp_path, script=str(exiting))],
                    tmp_path, env())
    assert (got["refusal"].returncode, got["refusal"].stderr) == (alone.returncode, alone.stderr) == (2, alone.stderr)
    assert "unknown key train.stepz" in alone.stderr
    assert got["raises"].returncode == 1 and got["raises"].stdout == "to stdout\n"
    assert "Traceback" in got["raises"].stderr and "RuntimeError: boom" in got["raises"].stderr
    assert got["exits"].returncode == 7 and got["exits"].stderr == f"yes {tmp_path}\n"


def test_demo_yaml_equals_embedded_demo():
    from ulysses_train.cli import DEMO_DEFAULTS
    from ulysses_train.config import load_config

    assert load_config(os.path.join(REPO, "configs", "demo.yaml")) == load_config(None, defaults=DEMO_DEFAULTS)


# ---------------------------------------------------------------- the demo learns


def test_demo_learns_retrieval_across_slices(tmp_path):
    """A shortened demo (300 of its 600 steps, 2 processes, sp=2): the answer loss starts near ln(vocab) and
    ends far below chance, ln(num_values); its retrieval probes (eval.tasks=[demo]) go from none to nearly all. Below chance means the model reads the needle, which sits in the
    other sp slice, so the Ulysses all-to-all must carry it. Measured through this path with seeds 0, 1, 2:
    mean of steps 251-300 0.02, 0.06, 0.09 (chance 2.08); the bound below leaves a wide margin for CPUs
    whose floating point differs."""
    from ulysses_train.data.demo import RetrievalTask

    out = str(tmp_path / "demo")
    proc = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=300", "--set",
                       "train.export_hf=false", "--set", "eval.every=300", "--set", "eval.tasks=[demo]", "--set",
                       "eval.depths=[0, 50, 100]", "--set", "eval.samples=4", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # its retrieval heatmap: no answer the top choice before training (measured 0%), nearly all after (100%)
    accuracy = {}
    for step in (0, 300):
        with open(os.path.join(out, "eval", f"retrieval_step_{step}", "retrieval.json")) as fh:
            cells = json.load(fh)["cells"]
        assert sum(c["count"] for c in cells) == 12
        accuracy[step] = sum(c["accuracy"] * c["count"] for c in cells) / 12
    assert accuracy[0] <= 0.25 and accuracy[300] >= 0.9, accuracy
    records = read_metrics(out)
    chance = RetrievalTask().chance_loss
    first = sum(r["loss"] for r in records[:10]) / 10
    last = sum(r["loss"] for r in records[-50:]) / 50
    print(f"mean of first 10 {first:.3f}, of last 50 {last:.3f}, chance ln(values) {chance:.3f}")
    assert first > chance + 0.8
    assert last < 0.3 * chance
    assert {"step", "loss", "grad_norm", "num_tokens", "step_time_s", "tokens_per_s", "peak_gpu_gib",
            "peak_host_gib"} <= set(records[-1])


LORA = ["--set", "model.lora={r: 4, init_lora_weights: false}", "--set", "train.save_every=2"]


def tensorboard_deepspeed_config(folder) -> str:
    """ds_configs/demo.json with DeepSpeed's own TensorBoard and CSV monitor sections switched on."""
    with open(os.path.join(REPO, "ds_configs", "demo.json")) as fh:
        ds = json.load(fh)
    ds["tensorboard"] = {"enabled": True}
    ds["csv_monitor"] = {"enabled": True}
    (folder / "ds.json").write_text(json.dumps(ds))
    return str(folder / "ds.json")


def one_process_cases(root, has_peft: bool) -> list[dict]:
    """The plain-`python` runs of the tests below, in the order they must run (a resume after its first part)."""
    quiet = ["--set", "train.export_hf=false"]
    lora = [
        case("lora straight", ["--set", f"train.output_dir={root / 'lora_a'}", "--set", "train.steps=4", *quiet, *LORA],
             env()),
        case("lora first", ["--set", f"train.output_dir={root / 'lora_b'}", "--set", "train.steps=2", *quiet, *LORA],
             env()),
        case("lora resumed", ["--set", f"train.output_dir={root / 'lora_b'}", "--set", "train.steps=4", "--resume",
                              *LORA], env()),
    ] if has_peft else []
    return [
        # started from a folder outside the repository, the demo's own DeepSpeed config
        case("demo", ["--set", f"train.output_dir={root / 'demo1'}", "--set", "train.steps=3", *quiet], env(),
             cwd=root),
        case("keep last", ["--set", f"train.output_dir={root / 'kept'}", "--set", "train.steps=4", "--set",
                           "train.save_every=1", "--set", "train.keep_last=3", *quiet], env()),
        case("monitors", ["--set", f"train.output_dir={root / 'monitored' / 'run'}", "--set", "train.steps=3", "--set",
                          f"train.deepspeed_config={tensorboard_deepspeed_config(root)}", *quiet], env()),
        case("one step", ["--set", f"train.output_dir={root / 'one_step'}", "--set", "train.steps=1", *quiet], env()),
        case("again without --resume", ["--set", f"train.output_dir={root / 'one_step'}"], env()),
        *lora,
    ]


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """(root folder, {case name: CompletedProcess}) of the one-process runs of one_process_cases, all run from one
    launched process (tests/script_cases.py); each test reads only its own runs' folders."""
    import importlib.util

    root = tmp_path_factory.mktemp("one_process")
    cases = one_process_cases(root, has_peft=importlib.util.find_spec("peft") is not None)
    return root, run_cases(cases, tmp_path_factory.mktemp("one_process_cases"), env(), timeout=1500)


def test_demo_runs_as_one_process_with_sp_resolved_to_one(one_process_runs):
    """The demo's parallel.sequence_parallel_size is auto: one process (one GPU, or a plain `python`) trains
    with sp=1 instead of refusing the world size; run_config.json records the number it resolved to. Started
    from a folder outside the repository (`python /path/to/scripts/train.py`): ds_configs/demo.json is found in
    the repository, not in the current folder nor inside the package."""
    root, runs = one_process_runs
    out = root / "demo1"
    assert runs["demo"].args[0] == TRAIN and runs["demo"].returncode == 0, runs["demo"].stderr[-3000:]
    assert [r["step"] for r in read_metrics(str(out))] == [1, 2, 3]
    with open(out / "run_config.json") as fh:
        assert json.load(fh)["config"]["parallel"]["sequence_parallel_size"] == 1


def test_keep_last_is_the_number_of_checkpoints_kept(one_process_runs):
    root, runs = one_process_runs
    out = root / "kept"
    assert runs["keep last"].returncode == 0, runs["keep last"].stderr[-3000:]
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_00000002", "step_00000003", "step_00000004"]  # the default (2) would keep two


def test_tensorboard_and_csv_monitors_get_what_metrics_jsonl_gets(one_process_runs):
    """DeepSpeed's own monitor sections in the DeepSpeed JSON switch TensorBoard and CSV on; the trainer feeds them
    its step records (written under <output_dir>/monitor). The event files are read back with TensorBoard's
    reader and compared with metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, runs = one_process_runs
    out = root / "monitored" / "run"  # DeepSpeed's job name is the folder's name: monitor/run
    assert runs["monitors"].returncode == 0, runs["monitors"].stderr[-3000:]
    records = read_metrics(str(out))
    events = EventAccumulator(str(out / "monitor" / "run"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("Train/loss")]
    assert [step for step, _ in losses] == [1, 2, 3]
    assert all(abs(value - r["loss"]) < 1e-5 for (_, value), r in zip(losses, records))
    assert {"Train/tokens_per_s", "Train/peak_host_gib", "Train/grad_norm"} <= set(events.Tags()["scalars"])
    csv_rows = (out / "monitor" / "run" / "Train_loss.csv").read_text().strip().splitlines()
    assert len(csv_rows) == 1 + 3  # a header and one row per step


def test_lora_run_saves_only_adapters_resumes_exactly_and_exports_an_adapter(one_process_runs):
    """The demo with LoRA: a run stopped after 2 steps and resumed to 4 logs the losses of a straight 4-step run
    (the frozen base is rebuilt from the seed; the checkpoint holds the adapters and their optimizer states),
    and hf_model/ is PEFT's adapter folder. Three separate processes: straight, first part, resumed."""
    pytest.importorskip("peft")
    root, runs = one_process_runs
    straight, first, resumed = runs["lora straight"], runs["lora first"], runs["lora resumed"]
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "LoRA r=4" in straight.stdout
    assert first.returncode == 0, first.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = [r["loss"] for r in read_metrics(str(root / "lora_a"))]
    got = [r["loss"] for r in read_metrics(str(root / "lora_b"))]
    assert got == want and len(got) == 4
    assert sorted(os.listdir(root / "lora_b" / "hf_model")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_resume_on_another_gpu_count_continues_the_run(tmp_path):
    """A checkpoint written by 4 processes (sp=2 x dp=2) resumes on 2 (sp=2, 2 micro-steps: the same 2 sequences
    per step) through DeepSpeed's universal checkpoint: steps 3-4 log the losses of the uninterrupted 4-process
    run (to fp32 rounding, < 1e-5 like every loss check: the sums run in another order), since weights, optimizer states and the data position
    carry over."""
    common = ["--set", "parallel.sequence_parallel_size=2", "--set", "train.export_hf=false", "--set", "train.save_every=2"]
    straight = train_ranks(4, "--set", f"train.output_dir={tmp_path / 'a'}", "--set", "train.steps=4", *common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = train_ranks(4, "--set", f"train.output_dir={tmp_path / 'b'}", "--set", "train.steps=2", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train_ranks(2, "--set", f"train.output_dir={tmp_path / 'b'}", "--set", "train.steps=4",
                          "--set", "train.gradient_accumulation_steps=2", "--resume", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming through DeepSpeed's universal checkpoint" in resumed.stdout
    want = [r["loss"] for r in read_metrics(str(tmp_path / "a"))]
    got = [r["loss"] for r in read_metrics(str(tmp_path / "b"))]
    assert len(got) == 4 and got[:2] == want[:2]
    # metrics.jsonl rounds to 6 decimals; measured 0 and 2.7e-7 (one unit of that rounding)
    assert all(abs(g - w) / abs(w) < 1e-5 for g, w in zip(got[2:], want[2:])), (got, want)
    assert got[2:] != [r["loss"] for r in read_metrics(str(tmp_path / "b"))][:2]  # the run moved on


def test_demo_questions_cannot_be_answered_by_copying():
    """Every answer must come from the needle: the value token appears once, at the needle in the first
    quarter, right after the asked key; every input token after the needle is filler or that key."""
    from ulysses_train.data.demo import RetrievalTask

    task = RetrievalTask()
    for index in range(20):
        sample = task.sample(index)
        ids, labels = sample["input_ids"][0], sample["labels"][0]
        answers = labels[labels != -100]
        assert len(answers) == task.queries and (answers == answers[0]).all()
        where_value = torch.nonzero(task.is_value(ids)).flatten()
        assert len(where_value) == 1 and where_value.item() < task.seq_length // 4
        assert ids[where_value].item() == answers[0].item()
        key = ids[where_value - 1]
        assert task.key_base <= key.item() < task.value_base
        asked = torch.nonzero(labels != -100).flatten() - 1  # label p is predicted at position p - 1
        assert (ids[asked] == key).all()


# ---------------------------------------------------------------- checkpoints


def test_output_dir_with_checkpoint_is_refused_without_resume_or_overwrite(one_process_runs):
    """A one-step run (its checkpoint at the end), then the same output_dir again without --resume."""
    _, runs = one_process_runs
    first, again = runs["one step"], runs["again without --resume"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert again.returncode == 2 and "already holds a run (checkpoint step_00000001); pass --resume" in again.stderr


def test_a_run_killed_before_its_first_checkpoint_is_not_overwritten(refusals):
    """Only metrics.jsonl and run_config.json, no checkpoint (the default save_every 0): still a run."""
    again = refusals["killed before its first checkpoint"]
    assert again.returncode == 2 and "already holds a run (metrics.jsonl of a run without a checkpoint)" in again.stderr
    assert "Traceback" not in again.stderr
    assert (refusals["killed folder"] / "metrics.jsonl").read_text() == KILLED_BEFORE_CHECKPOINT_METRICS


# ---------------------------------------------------------------- export


def test_exported_model_loads_and_matches_engine(tmp_path):
    from transformers import AutoModelForCausalLM

    out_dir = str(tmp_path / "run")
    result = str(tmp_path / "engine_nll.json")
    run_workers(2, [result, f"train.output_dir={out_dir}", "train.steps=5"],
                script=os.path.join(REPO, "tests", "train_worker.py"))
    with open(result) as fh:
        engine_nll = json.load(fh)["nll_sum"]
    sample = torch.load(result + ".sample.pt")
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "hf_model"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=sample["input_ids"]).logits[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), sample["labels"][:, 1:].reshape(-1),
                                             ignore_index=-100, reduction="sum").item()
    assert abs(engine_nll - want) / abs(want) < 1e-5, (engine_nll, want)
    # negative control: the untrained model gives a different loss
    fresh = AutoModelForCausalLM.from_config(model.config)
    with torch.no_grad():
        other = fresh(input_ids=sample["input_ids"]).logits[:, :-1]
    assert abs(torch.nn.functional.cross_entropy(other.reshape(-1, other.shape[-1]), sample["labels"][:, 1:].reshape(-1),
                                                 ignore_index=-100, reduction="sum").item() - want) > 1e-3


