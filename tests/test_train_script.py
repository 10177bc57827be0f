"""scripts/train.py end to end on CPU: config errors, the demo learning, kill-and-resume equality,
crash-safe checkpoints and the exported Hugging Face model."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO, kill_tree, launch_ranks, live_commands, read_metrics, run_workers, wait_for_steps
from script_cases import case, run_cases

TRAIN = os.path.join(REPO, "scripts", "train.py")


def env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


def torchrun(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]


def train_ranks(nproc, *args, run_env=None, timeout=600) -> subprocess.CompletedProcess:
    """scripts/train.py as `nproc` real ranks on gloo, forked by tests/rank_server.py with the environment torchrun
    gives each rank (helpers.launch_ranks: the imports paid once, not per run). For the runs whose check is the
    training itself (resume, data, tampered files); what the launchers do (torchrun, deepspeed, srun: signals,
    a killed launcher) is checked by the tests that start them."""
    return launch_ranks(nproc, [TRAIN, *args], run_env or env(), timeout)


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
    proc = subprocess.run(torchrun(2, "--set", f"train.output_dir={out}", "--set", "train.steps=300",
                                   "--set", "train.export_hf=false", "--set", "eval.every=300", "--set",
                                   "eval.tasks=[demo]", "--set", "eval.depths=[0, 50, 100]", "--set", "eval.samples=4"),
                          env=env(), capture_output=True, text=True, timeout=900)
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


def test_kill_tree_passes_over_a_process_that_ended_before_its_kill(monkeypatch):
    """A real tree (a shell with two sleeping children) where the first kill finds its process gone (faked: a
    launcher's short-lived helper ending between the listing and the kill): every other process is still killed and
    nothing raises. Control: the bare kill raises there, as the loop without the check did."""
    import psutil

    tree = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    deadline = time.time() + 30
    while len(psutil.Process(tree.pid).children()) < 2 and time.time() < deadline:
        time.sleep(0.05)
    children = psutil.Process(tree.pid).children()
    real_kill, calls = psutil.Process.kill, []

    def kill(process):
        calls.append(process.pid)
        if len(calls) == 1:
            raise psutil.NoSuchProcess(process.pid)
        return real_kill(process)

    monkeypatch.setattr(psutil.Process, "kill", kill)
    with pytest.raises(psutil.NoSuchProcess):
        children[0].kill()  # the control: what the loop met
    calls.clear()
    kill_tree(tree.pid)
    assert tree.wait(timeout=30) == -signal.SIGKILL and len(calls) == 3
    monkeypatch.undo()
    for child in children:  # the one whose kill was faked away
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def test_killed_run_resumes_with_identical_losses(tmp_path, straight_losses):
    """Kill a run (SIGKILL, whole process group) once its step-3 checkpoint is complete, resume it,
    and compare every step's loss with an uninterrupted run (the straight_losses fixture: the same demo, 2
    processes, log_every 1; saving checkpoints does not change a loss, as the stop and fallback tests show)."""
    killed = str(tmp_path / "killed")
    common = ["--set", "train.save_every=3", "--set", "train.export_hf=false", "--set", "train.log_every=1"]
    proc = subprocess.Popen(torchrun(2, "--set", f"train.output_dir={killed}", "--set", "train.steps=1000", *common),
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = os.path.join(killed, "checkpoints", "latest_good")
    deadline = time.time() + 300
    while not os.path.exists(latest) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    kill_tree(proc.pid)
    proc.wait()
    with open(latest) as fh:
        resumed_from = int(fh.read().strip().split("_")[1])
    steps = resumed_from + 3
    assert steps <= STRAIGHT_STEPS, resumed_from
    resumed = train_ranks(2, "--set", f"train.output_dir={killed}", "--set", f"train.steps={steps}", "--resume",
                          *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{resumed_from:08d}" in resumed.stdout

    got = read_metrics(killed)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [loss for loss, _ in straight_losses[:steps]]
    assert [r["grad_norm"] for r in got] == [grad_norm for _, grad_norm in straight_losses[:steps]]


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


def test_partial_save_never_replaces_the_previous_good_checkpoint(tmp_path):
    from ulysses_train.training import checkpoint

    root = tmp_path / "checkpoints"
    (root / "step_00000003").mkdir(parents=True)
    (root / "step_00000003" / "COMPLETE").write_text("3\n")
    (root / "latest_good").write_text("step_00000003")
    (root / "step_00000006").mkdir()          # a save that died half way: no COMPLETE, latest untouched
    assert checkpoint.latest_good(str(tmp_path)) == "step_00000003"
    checkpoint._prune(str(root), keep_last=1)
    assert (root / "step_00000003" / "COMPLETE").exists()
    (root / "latest_good").write_text("step_00000006")   # a pointer to an incomplete folder is not trusted:
    assert checkpoint.latest_good(str(tmp_path)) == "step_00000003"   # the newest complete one is


FULL_DISK = """
import errno, os
import torch
_save = torch.save
def save(obj, f, *args, **kwargs):  # this rank's disk is full from the second checkpoint on
    if "step_00000002" in str(f) and os.environ.get("RANK") == "0":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return _save(obj, f, *args, **kwargs)
torch.save = save
"""


def test_a_disk_full_during_a_save_on_one_rank_is_named_and_the_partial_folder_removed(tmp_path):
    """Issue 41: one rank's write failing inside DeepSpeed's save_checkpoint (a full disk: rank 0's model states of
    step 2, through a sitecustomize that makes torch.save raise ENOSPC there) used to leave that rank short of
    DeepSpeed's closing barrier: gloo aborted on a collective mismatch, no "no space left" line, step_2's partial
    folder stayed. Now every rank finishes the save's collectives, agrees it failed, and the README's promise holds:
    one line naming the problem and the folder, the partial folder removed, step 1 still what --resume picks."""
    from ulysses_train.training import checkpoint

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FULL_DISK)
    out = tmp_path / "run"
    proc = subprocess.run(torchrun(2, "--set", f"train.output_dir={out}", "--set", "train.steps=3", "--set",
                                   "train.save_every=1", "--set", "train.export_hf=false"),
                          env=dict(env(), PYTHONPATH=f"{inject}{os.pathsep}{REPO}"), capture_output=True, text=True,
                          timeout=300)
    output = proc.stdout + proc.stderr
    folder = out / "checkpoints" / "step_00000002"
    assert proc.returncode != 0 and "collective mismatch" not in output and "Connection reset" not in output, output
    assert (f"error: could not save checkpoint step_00000002: no space left on the device of {folder}" in output and
            f"the partial folder was removed and the last good checkpoint is {out / 'checkpoints' / 'step_00000001'}"
            in output), output[-3000:]
    assert not folder.exists() and checkpoint.latest_good(str(out)) == "step_00000001"
    assert (out / "checkpoints" / "step_00000001" / checkpoint.COMPLETE).exists()


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


# ---------------------------------------------------------------- a real corpus end to end


def test_trains_on_a_text_corpus_with_a_local_tokenizer(tmp_path, bpe_tokenizer):
    """Folder of .txt -> tokenizer -> packed, cached sequences -> 2-process sp=2 training of a local model."""
    import math
    import random

    from helpers import save_tiny_model

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    tokenizer_dir = str(tmp_path / "tokenizer")
    bpe_tokenizer.save_pretrained(tokenizer_dir)
    model_dir = save_tiny_model(str(tmp_path / "model"), vocab_size=len(bpe_tokenizer))
    config = tmp_path / "run.yaml"
    config.write_text(f"""
model: {{name_or_path: {model_dir}, dtype: float32, attn_implementation: sdpa}}
parallel: {{sequence_parallel_size: 2}}
data: {{source: {corpus}, tokenizer: {tokenizer_dir}, seq_length: 256, num_proc: 1}}
train: {{steps: 3, output_dir: {tmp_path / 'out'}, export_hf: false}}
""")
    shared = dict(env(), ULYSSES_TRAIN_DATA_CACHE=str(tmp_path / "shared_cache"))
    proc = train_ranks(2, "--config", str(config), run_env=shared)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(tmp_path / "out"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert abs(records[0]["loss"] - math.log(len(bpe_tokenizer))) < 1.5  # a random model is near ln(vocab)
    assert records[0]["num_tokens"] == 255  # one 256-token sequence per step: 255 labels
    cache_line = [line for line in proc.stdout.splitlines() if line.strip().startswith("cache ")]
    assert cache_line and str(tmp_path / "shared_cache") in cache_line[0]  # the default location, printed
    # prepare_data.py with the same options finds the trainer's cache in the same default place
    prepare = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_data.py"), "--source", str(corpus),
                              "--tokenizer", tokenizer_dir, "--seq-length", "256", "--pad-multiple", "2"],
                             env=shared, capture_output=True, text=True, timeout=300)
    assert prepare.returncode == 0 and "(reused)" in prepare.stdout, prepare.stdout + prepare.stderr[-2000:]


def test_trains_on_chat_sessions_packed_as_documents(tmp_path, bpe_tokenizer):
    """JSONL of sessions -> chat template -> assistant-only labels, whole sessions per sequence -> 2-process
    sp=2 training with FlashAttention 4's variable-length op (its CPU reference kernel). The step's label count
    is the packed row's, less each document's last label (it would cross into the next document)."""
    from helpers import save_tiny_model
    from test_document_packing import write_sessions
    from test_sessions import QWEN3, chat_tokenizer

    tokenizer = chat_tokenizer(bpe_tokenizer, QWEN3)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    model_dir = save_tiny_model(str(tmp_path / "model"), vocab_size=len(tokenizer))
    source = write_sessions(tmp_path / "sessions.jsonl")
    config = tmp_path / "run.yaml"
    config.write_text(f"""
model: {{name_or_path: {model_dir}, dtype: float32, attn_implementation: fa4}}
parallel: {{sequence_parallel_size: 2}}
data: {{source: {source}, tokenizer: {tmp_path / 'tokenizer'}, format: chat, packing: documents, seq_length: 512,
       num_proc: 1, cache_dir: {tmp_path / 'cache'}}}
train: {{steps: 2, output_dir: {tmp_path / 'out'}}}
""")
    proc = train_ranks(2, "--config", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "whole documents per sequence" in proc.stdout and "without an assistant turn, skipped" in proc.stdout
    # the export is a complete Hugging Face folder: the run's tokenizer (chat template included) and the model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoTokenizer.from_pretrained(tmp_path / "out" / "hf_model")
    assert exported.get_vocab() == tokenizer.get_vocab() and exported.chat_template == QWEN3
    prompt = exported.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf_model")
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4
    records = read_metrics(str(tmp_path / "out"))
    assert [r["step"] for r in records] == [1, 2]
    from datasets import Dataset

    rows = [row for path in sorted((tmp_path / "cache").glob("packed-*/*.arrow")) for row in Dataset.from_file(str(path))]
    counts = {sum(1 for label in row["labels"] if label != -100) for row in rows}
    assert all(r["num_tokens"] in counts for r in records), (records, counts)


def test_document_packing_with_sdpa_is_one_line(tmp_path, bpe_tokenizer, capsys):
    from helpers import save_tiny_model
    from test_input_errors import one_error_line

    bpe_tokenizer.save_pretrained(tmp_path / "tokenizer")
    source = tmp_path / "t.jsonl"
    source.write_text(json.dumps({"text": "hello world"}) + "\n")
    model_dir = save_tiny_model(str(tmp_path / "model"), vocab_size=len(bpe_tokenizer))
    capsys.readouterr()
    line = one_error_line(["--set", f"model.name_or_path={model_dir}", "--set", "model.attn_implementation=sdpa",
                           "--set", "parallel.sequence_parallel_size=1",
                           "--set", f"data.source={source}", "--set", f"data.tokenizer={tmp_path / 'tokenizer'}",
                           "--set", "data.packing=documents", "--set", f"train.output_dir={tmp_path / 'out'}",
                           "--set", f"data.cache_dir={tmp_path / 'cache'}"], capsys)
    assert "data.packing=documents needs variable-length attention" in line and "fa4" in line


# ---------------------------------------------------------------- stopping on request, damaged and tampered checkpoints

RUN_COMMON = ["--set", "train.export_hf=false", "--set", "train.log_every=1"]
STRAIGHT_STEPS = 30


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory):
    """(loss, grad_norm) of every step of an uninterrupted 2-process demo run: what every stopped, killed or
    fallen-back run must reproduce after its resume."""
    out = str(tmp_path_factory.mktemp("straight") / "run")
    run = train_ranks(2, "--set", f"train.output_dir={out}", "--set", f"train.steps={STRAIGHT_STEPS}", *RUN_COMMON)
    assert run.returncode == 0, run.stderr[-3000:]
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out)]


def train_processes(launcher_pid):
    return [p for p, text in live_commands(launcher_pid) if TRAIN in text and "deepspeed.launcher" not in text]


def resume_and_compare(output_dir, resumed_from, straight, extra=3):
    steps = resumed_from + extra
    resumed = train_ranks(2, "--set", f"train.output_dir={output_dir}", "--set", f"train.steps={steps}", "--resume",
                          *RUN_COMMON)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{resumed_from:08d}" in resumed.stdout
    got = read_metrics(output_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [(r["loss"], r["grad_norm"]) for r in got] == straight[:steps]
    return resumed


def test_sigterm_to_one_worker_stops_every_rank_after_the_step_with_a_checkpoint(tmp_path, straight_losses):
    """SLURM-style: SIGTERM reaches one rank only. Both ranks finish the step, agree, save and exit; the resumed
    run's losses equal the uninterrupted run's."""
    from ulysses_train.training import checkpoint

    out = str(tmp_path / "run")
    proc = subprocess.Popen(torchrun(2, "--set", f"train.output_dir={out}", "--set", "train.steps=1000", *RUN_COMMON),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for_steps(out, 3, proc)
    rank1 = [p for p in train_processes(proc.pid) if p.environ().get("RANK") == "1"]
    assert len(rank1) == 1
    rank1[0].send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert "another rank was asked to stop: saving a checkpoint after this step" in stderr  # said once, by rank 0
    assert "received SIGTERM" not in stderr  # rank 1 (not the first of its node) does not repeat it
    assert "exitcode  : 75" in stderr or "exitcode: 75" in stderr, stderr[-3000:]
    stopped_at = len(read_metrics(out))
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at)  # the step was not lost
    assert stopped_at + 3 <= STRAIGHT_STEPS
    resume_and_compare(out, stopped_at, straight_losses)


def test_a_single_process_stopped_by_sigterm_exits_75_after_saving(tmp_path):
    """What srun passes on to the job: the worker's own exit code, 75 = stopped cleanly, resume me."""
    from ulysses_train.parallel.ports import free_port
    from ulysses_train.training import checkpoint

    out = str(tmp_path / "run")
    single = dict(env(), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, TRAIN, "--set", f"train.output_dir={out}", "--set", "train.steps=1000",
                             "--set", "parallel.sequence_parallel_size=1", *RUN_COMMON], env=single,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    stopped_at = len(read_metrics(out))
    assert f"stopped after step {stopped_at} (received SIGTERM); checkpoint step_{stopped_at:08d} is saved" in stderr
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at)
    assert "Traceback" not in stderr


def test_killing_the_deepspeed_command_ends_its_workers_with_a_checkpoint(tmp_path):
    """`deepspeed` starts DeepSpeed's per-node launcher, which starts the workers; SIGTERM to the `deepspeed`
    command alone reaches neither. The workers notice, finish the step, save and exit."""
    import psutil

    from ulysses_train.parallel.ports import free_port
    from ulysses_train.training import checkpoint

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           TRAIN, "--set", f"train.output_dir={out}", "--set", "train.steps=1000", *RUN_COMMON]
    runner = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_for_steps(out, 2, runner)
        workers = train_processes(runner.pid)
        assert len(workers) == 2
        everything = psutil.Process(runner.pid).children(recursive=True)
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=60)
        gone, alive = psutil.wait_procs(everything, timeout=120)
        assert not alive, f"still running after the launcher died: {[p.cmdline() for p in alive]}"
    finally:
        kill_tree(runner.pid) if runner.poll() is None else None
    stopped_at = len(read_metrics(out))
    assert checkpoint.latest_good(out) == checkpoint.tag_for(stopped_at)


def test_resume_refuses_tampered_files_falls_back_past_damaged_ones(tmp_path, straight_losses):
    """One 2-step run saving every step, then: (1) a pickle payload in the newest checkpoint (manifest forged to
    match) is refused, naming the file, and nothing runs; (2) a truncated optimizer shard makes --resume fall
    back to the previous checkpoint, saying so, and the losses continue exactly; (3) --resume with another sp
    is refused before anything in the folder changes; (4) --resume of the finished run says so."""
    import shutil as _shutil

    from test_checkpoint import MARKER_NAME, forge_manifest, plant_payload

    out = str(tmp_path / "run")
    first = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=2", "--set", "train.save_every=1",
                        *RUN_COMMON)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = os.path.join(out, "checkpoints", "step_00000002")
    model_states = os.path.join(newest, "zero_pp_rank_1_mp_rank_00_model_states.pt")
    _shutil.copy(model_states, tmp_path / "saved.pt")
    _shutil.copy(os.path.join(newest, "COMPLETE"), tmp_path / "saved_complete")
    marker = tmp_path / MARKER_NAME
    plant_payload(model_states, marker)
    forge_manifest(newest)
    tampered = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=3", "--resume", *RUN_COMMON)
    assert tampered.returncode != 0 and f"error: refused to read {model_states}" in tampered.stderr, tampered.stderr[-3000:]
    assert not marker.exists()

    _shutil.copy(tmp_path / "saved.pt", model_states)
    _shutil.copy(tmp_path / "saved_complete", os.path.join(newest, "COMPLETE"))
    shard = os.path.join(newest, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.truncate(shard, os.path.getsize(shard) - 100)
    resumed = resume_and_compare(out, 1, straight_losses, extra=2)
    assert f"passed over damaged checkpoint step_00000002: {shard} has" in resumed.stdout
    assert os.path.isdir(os.path.join(out, "checkpoints", "damaged_step_00000002"))

    finished = train_ranks(2, "--set", f"train.output_dir={out}", "--set", "train.steps=3", "--resume", *RUN_COMMON)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "already finished (step 3 of train.steps=3); raise train.steps to train further" in finished.stdout
    assert len(read_metrics(out)) == 3
