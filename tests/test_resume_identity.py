"""A resume names what changed (training/run_identity.py, checkpoint.step_size_words): the adapter (LoRA's rank,
alpha, targets, or LoRA added or removed) is refused in one line naming the field before DeepSpeed loads anything
(it used to fail inside DeepSpeed's state-dict load with a traceback); another sp on the same processes states the
data-parallel groups and the tokens each step now trains. Real runs of scripts/train.py (the demo)."""
import os

import pytest
from helpers import REPO, launch_ranks, read_metrics
from script_cases import case, run_cases

from ulysses_train.training import checkpoint

pytest.importorskip("peft")

TRAIN = os.path.join(REPO, "scripts", "train.py")
LORA = "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}"
QUIET = ["--set", "train.export_hf=false"]


def env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


CHANGED = {
    "rank": ("model.lora={r: 8, lora_alpha: 8, target_modules: [q_proj, v_proj]}", "model.lora.r: 4 -> 8"),
    "alpha": ("model.lora={r: 4, lora_alpha: 16, target_modules: [q_proj, v_proj]}", "model.lora.lora_alpha: 8 -> 16"),
    "targets": ("model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, k_proj, v_proj, o_proj]}",
                'model.lora.target_modules: ["q_proj", "v_proj"] -> ["k_proj", "o_proj", "q_proj", "v_proj"]'),
    "removed": ("model.lora={}", "model.lora: LoRA rank 4 -> none (a full fine-tune)"),
}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_identity")
    out = root / "run"
    cases = [case("first", ["--set", f"train.output_dir={out}", "--set", "train.steps=1", "--set", LORA, *QUIET],
                  env())]
    cases += [case(name, ["--set", f"train.output_dir={out}", "--set", "train.steps=2", "--set", lora, "--resume",
                          *QUIET], env()) for name, (lora, _) in CHANGED.items()]
    cases += [case("same adapter", ["--set", f"train.output_dir={out}", "--set", "train.steps=2", "--set", LORA,
                                    "--resume", *QUIET], env())]
    full = root / "full"
    cases += [case("full first", ["--set", f"train.output_dir={full}", "--set", "train.steps=1", *QUIET], env()),
              case("added", ["--set", f"train.output_dir={full}", "--set", "train.steps=2", "--set", LORA, "--resume",
                             *QUIET], env())]
    return root, run_cases(cases, root, env(), timeout=1500)


@pytest.mark.parametrize("name", [*CHANGED, "added"])
def test_a_changed_adapter_is_refused_in_one_line_before_deepspeed_loads(lora_runs, name):
    root, runs = lora_runs
    assert runs["first"].returncode == 0 and runs["full first"].returncode == 0, runs["first"].stderr[-3000:]
    result = runs[name]
    folder = root / ("full" if name == "added" else "run")
    field = CHANGED[name][1] if name != "added" else "model.lora: none -> LoRA rank 4"
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --resume: the checkpoints in {str(folder)!r} were trained with another adapter ({field}); they "
        f"cannot load into this model. Restore model.lora, or start over (--overwrite or another output_dir).")
    assert "Traceback" not in result.stderr and "resumed from" not in result.stdout
    assert checkpoint.tag_for(1) in checkpoint.complete_tags(str(folder))  # intact (the control resumes from it)


def test_negative_control_the_same_adapter_resumes(lora_runs):
    root, runs = lora_runs
    result = runs["same adapter"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from step_00000001 (step 1)" in result.stdout
    assert [r["step"] for r in read_metrics(str(root / "run"))] == [1, 2]


def test_another_sp_on_the_same_processes_states_the_tokens_per_step(tmp_path):
    """Two processes at sp=2 (one data-parallel group), resumed at sp=1 (two): each step now trains twice the
    sequences; the resume line says so with the numbers. The same layout (the negative control) says nothing."""
    out = str(tmp_path / "run")
    common = ["--set", f"train.output_dir={out}", "--set", "train.save_every=1", *QUIET]
    # two ranks as torchrun --standalone starts them, forked by the rank server (tests/helpers.launch_ranks)
    first = launch_ranks(2, [TRAIN, *common, "--set", "train.steps=1", "--set", "parallel.sequence_parallel_size=2"],
                         env(), 600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data-parallel groups" not in first.stdout
    resumed = launch_ranks(2, [TRAIN, *common, "--set", "train.steps=2", "--set", "parallel.sequence_parallel_size=1",
                               "--resume"], env(), 600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    length = 128  # the demo's data.seq_length
    assert (f"(converted anew from step_00000001 into universal_step_00000001); data-parallel groups 1 -> 2: each step now trains 2 "
            f"sequence(s) of {length:,} tokens (train.gradient_accumulation_steps=1 x 2), {2 * length:,} tokens per "
            f"step.") in resumed.stdout, resumed.stdout[-3000:]
