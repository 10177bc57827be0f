"""Mistakes in what a run is given, refused in one line with exit 2 before the model is built: the demo's defaults
kept for a named model (random weights), a missing model folder, a damaged weights file, LoRA targets that name no
layer, unwritable monitor folders, glue packing asked to drop, YAML alias bombs, a DeepSpeed JSON looked up from
another folder, and a refusal printed by every rank. Each case is also run the way that passes (the controls).

Cases that need `scripts/train.py` run it as one process posing as rank 0 of 2 with no rank 1: reaching the process
group (where the model build starts) would hang until the timeout, so an exit 2 shows the check ran first."""
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, one_error_line, save_tiny_model, tiny_family_config
from script_cases import case, run_cases

from ulysses_train import cli
from ulysses_train.config import ConfigError, load_config
from ulysses_train.training.ds_config import resolve_path
from ulysses_train.user_input import MAX_YAML_VALUES

TRAIN = os.path.join(REPO, "scripts", "train.py")


def env(**extra):
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", **extra)


THREE_KEY_HEADS = dict(num_attention_heads=6, num_key_value_heads=6, head_dim=16, linear_num_key_heads=3,
                       linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
                       layer_types=["linear_attention", "full_attention"])
"""A hybrid whose attention splits over sp 1, 2, 3, 6 but whose 3 Gated DeltaNet key heads split over 1 and 3 only."""


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory, bpe_tokenizer):
    """A tiny model folder with weights, one whose model.safetensors is 0 bytes, a tokenizer and a text corpus."""
    root = tmp_path_factory.mktemp("inputs")
    good = save_tiny_model(str(root / "model"))
    hybrid = save_tiny_model(str(root / "hybrid"), config=tiny_family_config("qwen3_5_text", **THREE_KEY_HEADS))
    layer_types = {name: with_layer_types(hybrid, str(root / name), kinds) for name, kinds in (
        ("mamba", ["mamba", "full_attention"]), ("short", ["full_attention"]), ("unknown", ["foo", "full_attention"]))}
    empty = save_tiny_model(str(root / "empty_weights"))
    open(os.path.join(empty, "model.safetensors"), "wb").close()
    bpe_tokenizer.save_pretrained(str(root / "tokenizer"))
    (root / "corpus.txt").write_text("words to train on " * 200)
    (root / "a_file").write_text("not a folder")
    ds = json.load(open(os.path.join(REPO, "ds_configs", "zero3.json")))
    ds["tensorboard"] = {"enabled": True, "output_path": str(root / "a_file" / "tb")}
    (root / "ds_tb_under_a_file.json").write_text(json.dumps(ds))
    return {"good": good, "empty": empty, "tokenizer": str(root / "tokenizer"), "corpus": str(root / "corpus.txt"),
            "ds_tb": str(root / "ds_tb_under_a_file.json"), "root": root, "hybrid": hybrid, **layer_types}


def with_layer_types(model: str, folder: str, kinds: list) -> str:
    """A copy of a model folder whose config.json says `layer_types: kinds` (as a user would edit it)."""
    import shutil

    shutil.copytree(model, folder)
    config = json.load(open(os.path.join(folder, "config.json")))
    json.dump({**config, "layer_types": kinds}, open(os.path.join(folder, "config.json"), "w"))
    return folder


CORPUS_RUN = ["data.source={corpus}", "data.tokenizer={tokenizer}", "model.attn_implementation=sdpa",
              "model.dtype=float32", "data.seq_length=64"]


REFUSALS = [
    # the random-weights trap: a model named without --config kept the demo's random_init: true, so the 0-byte
    # weights file was never read and the run trained random weights with the model's shapes
    ("trap", ["model.name_or_path={empty}", *CORPUS_RUN],
     "the weights file '{empty}/model.safetensors' is empty (0 bytes)"),
    ("missing folder, demo data", ["model.name_or_path=/no/such/folder", "model.random_init=false"],
     "model.name_or_path='/no/such/folder': the local path '/no/such/folder' does not exist"),
    ("lora targets", ["model.name_or_path={good}", *CORPUS_RUN, "model.lora={{target_modules: [qkv]}}"],
     "model.lora.target_modules=['qkv'] names no module of this model; its linear layers are down_proj, gate_proj"),
    ("monitor under a file", ["model.name_or_path={good}", *CORPUS_RUN, "train.deepspeed_config={ds_tb}"],
     "tensorboard.output_path (+ job_name)='{root}/a_file/tb/DeepSpeedJobName' cannot be written"),
    # the sp rule of every mixer, with the values that work: it used to list only sp > 1 ("Use sp in [3]")
    ("hybrid key heads", ["model.name_or_path={hybrid}", *CORPUS_RUN, "parallel.sequence_parallel_size=2"],
     "Gated DeltaNet) layers have 3 key heads and 6 value heads, not divisible by parallel.sequence_parallel_size=2: "
     "each rank runs the whole sequence of key_heads/sp key heads and their value heads. Use sp in [1, 3]."),
    # layer_types checked before transformers reads them: "mamba" was silently built as a Gated DeltaNet layer,
    # a wrong length or an unknown type was transformers' traceback (a length set by an override: at the build)
    ("layer_types mamba", ["model.name_or_path={mamba}", *CORPUS_RUN],
     "its config.json's layer_types names ['mamba'] (layers [0]), a legacy name transformers silently reads as "
     "['linear_attention']: a Gated DeltaNet layer in the Qwen3.5 and Qwen3-Next families, not a Mamba layer. Fix: "
     "write 'linear_attention'"),
    ("layer_types short", ["model.name_or_path={short}", *CORPUS_RUN],
     "its config.json's layer_types has 1 entries but num_hidden_layers=2: one entry per decoder layer. Fix: give 2 "
     "entries from ['full_attention', 'sliding_attention', 'chunked_attention', 'linear_attention', "
     "'indexed_attention'], or leave layer_types out."),
    ("layer_types unknown", ["model.name_or_path={unknown}", *CORPUS_RUN],
     "its config.json's layer_types names layers of type ['foo'] (layers [0]), which ulysses-train does not build; "
     "known layer types: ['full_attention', 'sliding_attention', 'chunked_attention', 'linear_attention', "
     "'indexed_attention']."),
    ("layer_types override", ["model.name_or_path={hybrid}", *CORPUS_RUN,
                              "model.config_overrides={{layer_types: [full_attention]}}"],
     "error: layer_types has 1 entries but num_hidden_layers=2"),
]
"""(case, --set items, the refusal it must print): each a scripts/train.py command posing as rank 0 of 2."""


@pytest.fixture(scope="module")
def refused(run_inputs, tmp_path_factory):
    """{case: CompletedProcess} of every REFUSALS command, run from one launched process (tests/script_cases.py: the
    imports once, each command in its own forked child, with its own folder and exit code)."""
    cases = []
    for name, sets, _ in REFUSALS:
        folder = tmp_path_factory.mktemp("refused")
        argv = ["--set", f"train.output_dir={folder / 'out'}"]
        for item in sets:
            argv += ["--set", item.format(**run_inputs)]
        cases.append(case(name, argv, env(WORLD_SIZE="2", RANK="0"), cwd=folder))
    return run_cases(cases, tmp_path_factory.mktemp("refused_cases"), env(), at_once=2)


@pytest.mark.parametrize("name, sets, message", REFUSALS, ids=[name for name, _, _ in REFUSALS])
def test_refused_before_the_model_is_built(name, sets, message, run_inputs, refused):
    proc = refused[name]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message.format(**run_inputs) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error: ")]) == 1, proc.stderr[-3000:]


def test_demo_defaults_only_for_the_demo(run_inputs, capsys):
    """A named model and corpus get the plain defaults (weights loaded, ds_configs/zero3.json, 10 steps); asking
    for random weights is honoured and said; the demo itself keeps its defaults (the controls)."""
    sets = [item.format(**run_inputs) for item in ["model.name_or_path={good}", *CORPUS_RUN]]
    named = cli.run_config(None, sets)
    assert (named.model.random_init, named.train.steps, named.train.deepspeed_config) == \
        (False, 10, "ds_configs/zero3.json")
    assert capsys.readouterr().err == ""
    asked = cli.run_config(None, [*sets, "model.random_init=true"])
    assert asked.model.random_init and "model.random_init is true" in capsys.readouterr().err
    demo = cli.run_config(None, ["train.steps=3"])
    assert demo.model.random_init and demo.train.deepspeed_config == "ds_configs/demo.json"
    assert "data.source=demo is the demo: its own tiny model" in \
        one_error_line(["--set", "model.name_or_path=Qwen/Qwen3-8B"], capsys)


def test_glue_packing_refuses_drop_and_truncate(capsys):
    """data.too_long applies to document packing only; glue would silently keep the long sessions (in pieces)."""
    for rule in ("drop", "truncate"):
        line = one_error_line(["--set", "model.name_or_path=m", "--set", "data.source=x.jsonl",
                               "--set", f"data.too_long={rule}"], capsys)
        assert f"data.too_long={rule} needs data.packing documents" in line
    assert load_config(None, ["model.name_or_path=m", "data.source=x.jsonl", "data.too_long=drop",
                              "data.packing=documents"]).data.too_long == "drop"
    assert load_config(None, ["model.name_or_path=m", "data.source=x.jsonl"]).data.too_long == "split"


def alias_bomb(levels: int) -> str:
    """A "billion laughs" document: each level a list of nine aliases of the level below (9**levels values)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines)


def test_yaml_alias_bombs_are_refused_and_quotes_stay_short(tmp_path, capsys):
    """Six levels (531,441 values once expanded: a few hundred bytes of YAML) are refused in a file and in a --set
    value; an error quoting a large value quotes a few items of it. Controls: an alias used a few times loads."""
    bomb = tmp_path / "bomb.yaml"
    nested = "\n".join("    " + line for line in alias_bomb(6).splitlines())
    bomb.write_text(f"model:\n  config_overrides:\n{nested}\n  name_or_path: *l5\n")
    line = one_error_line(["--config", str(bomb)], capsys)
    assert f"expand to more than {MAX_YAML_VALUES:,} values" in line and len(line) < 400
    flow = "{" + alias_bomb(6).replace("\n", ", ") + "}"
    line = one_error_line(["--set", f"model.name_or_path={flow}"], capsys)
    assert "override model.name_or_path=...: its aliases" in line and len(line) < 400
    line = one_error_line(["--set", f"model.name_or_path=[{', '.join(['word'] * 5000)}]"], capsys)
    assert line.startswith("error: model.name_or_path=['word', 'word',") and len(line) < 300
    fine = tmp_path / "fine.yaml"
    fine.write_text("model: &m\n  dtype: float32\ntrain:\n  eval_lengths: &n [128, 256]\n")
    assert load_config(str(fine), ["train.eval_lengths=[64, 32]"]).train.eval_lengths == [64, 32]


def test_deepspeed_json_found_from_any_folder_and_beside_the_config(tmp_path, monkeypatch):
    """ds_configs/... from a folder outside the repository resolves in the repository (not inside the package);
    a config file's relative deepspeed_config names the file next to it. Control: a missing name still fails."""
    monkeypatch.chdir(tmp_path)
    assert resolve_path("ds_configs/demo.json") == os.path.join(REPO, "ds_configs", "demo.json")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "run.yaml").write_text("train:\n  deepspeed_config: my_ds.json\n")
    (tmp_path / "runs" / "my_ds.json").write_text("{}")
    cfg = load_config(str(tmp_path / "runs" / "run.yaml"))
    assert resolve_path(cfg.train.deepspeed_config) == str(tmp_path / "runs" / "my_ds.json")
    with pytest.raises(ConfigError, match="'my_ds.json' does not exist"):
        resolve_path(load_config(None, ["train.deepspeed_config=my_ds.json"]).train.deepspeed_config)


def test_a_refusal_is_printed_once_not_once_per_rank(tmp_path, monkeypatch, capsys):
    """Two ranks of one launch (processes of one parent, as under deepspeed or torchrun, but with no launcher to
    stop one when the other exits) meet the same missing config file: one `error:` line, both exit 2 (each
    printed it before). Control: a rank other than the first whose first rank never tells it prints it itself
    after the wait (nothing is lost)."""
    args = [sys.executable, TRAIN, "--config", str(tmp_path / "missing.yaml")]
    ranks = [subprocess.Popen(args, env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"), stderr=subprocess.PIPE,
                              text=True) for r in (1, 0)]
    outputs = [(proc.communicate(timeout=120)[1], proc.returncode) for proc in ranks]
    assert [rc for _, rc in outputs] == [2, 2]
    lines = [line for err, _ in outputs for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: config file '{tmp_path / 'missing.yaml'}' does not exist."], outputs
    monkeypatch.setattr(cli, "TOLD_WAIT_S", 0.2)
    for key, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    assert "error: config file 'alone.yaml' does not exist." in one_error_line(["--config", "alone.yaml"], capsys)


def test_plan_refuses_an_sp_the_trainer_refuses(capsys):
    """plan.py --sp 3 on Qwen3-0.6B (16 query heads, 8 KV heads) said "fits: yes" and exited 0 while train.py
    refuses that layout; both now use model/mixers check_sp_splits_heads. Control: sp=2 plans and exits 0."""
    plan = load_plan_script()
    common = ["--model", "qwen3-0.6b", "--seq-length", "3000", "--no-story"]
    assert plan.main([*common, "--sp", "3", "--gpus-per-node", "3"]) == 2
    err = capsys.readouterr().err
    assert "error: the model has 16 query heads, not divisible by --sp=3" in err and "Use sp in [1, 2, 4, 8, 16]" in err
    assert plan.main([*common, "--sp", "2", "--gpus-per-node", "2"]) == 0
    assert "fits: yes" in capsys.readouterr().out


def test_plan_refuses_an_sp_the_gated_deltanet_heads_refuse(run_inputs, capsys):
    """plan.py --sp 2 for a hybrid with 3 Gated DeltaNet key heads said "fits: yes" and exited 0 (its sp rule knew
    query and KV heads only) while train.py refuses that layout (the case above); both now ask model/mixers. The
    planner's search skips sp=2 too. Control: --sp 3 splits every mixer's heads and plans."""
    from ulysses_train.planner import PlanOptions, load_model_shape
    from ulysses_train.planner.search import valid_sp

    plan = load_plan_script()
    common = ["--model", run_inputs["hybrid"], "--seq-length", "3000", "--no-story"]
    assert plan.main([*common, "--sp", "2", "--gpus-per-node", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "3 key heads and 6 value heads, not divisible by --sp=2" in err and err.endswith("Use sp in [1, 3]."), err
    shape = load_model_shape(run_inputs["hybrid"])
    assert valid_sp(shape, PlanOptions(seq_length=3000, gpus_per_node=6)) == [1, 3]
    assert plan.main([*common, "--sp", "3", "--gpus-per-node", "3"]) == 0
    assert "fits: yes" in capsys.readouterr().out


def load_plan_script():
    from helpers import load_script

    return load_script("scripts/plan.py")


def test_damaged_or_missing_weights_files_are_named(run_inputs, tmp_path):
    """Read before the process group (headers only): a .safetensors file whose header is garbage, and a shard index
    naming a shard that is not there. Control: the intact folder reads."""
    import shutil

    from ulysses_train.model.loading import read_hf_config

    folder = tmp_path / "m"
    shutil.copytree(run_inputs["good"], folder)
    assert read_hf_config(str(folder), need_weights=True).model_type == "qwen3"
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=r"the weights file '.*model.safetensors' is not a readable safetensors"):
        read_hf_config(str(folder), need_weights=True)
    shutil.copy(os.path.join(run_inputs["good"], "model.safetensors"), folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=r"names 1 shard\(s\) that are not there, e.g. 'model-00002-of-00002"):
        read_hf_config(str(folder), need_weights=True)


def stale_lock(root):
    lock = root / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    return lock


def test_a_stale_deepspeed_cpu_op_build_lock_is_named_not_waited_on_forever(tmp_path):
    """Issue 41: a run killed while DeepSpeed builds its CPU communication op leaves torch's build lock, and every later
    CPU run waited on it forever at process-group start, saying nothing. Now the trainer names the file and the fix
    (one line, exit 2) before the process group; the old code hangs here until the subprocess timeout."""
    extensions = tmp_path / "torch_extensions"
    lock = stale_lock(extensions)
    proc = subprocess.run([sys.executable, TRAIN, "--set", f"train.output_dir={tmp_path / 'out'}", "--set",
                           "train.steps=1"], env=env(TORCH_EXTENSIONS_DIR=str(extensions)), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"error: DeepSpeed's CPU op build lock {lock} is left from a run killed while building it" in proc.stderr
            and f"Fix: rm {lock} (or set TORCH_EXTENSIONS_DIR to another folder)" in proc.stderr), proc.stderr[-3000:]
    assert lock.exists()  # named, not removed: a build on another machine sharing the folder may own it


def test_a_build_lock_is_stale_only_when_nobody_holds_it_and_on_several_nodes_only_when_old(tmp_path, capsys):
    from ulysses_train.parallel.launch import STALE_LOCK_SECONDS, LaunchError, check_op_build_locks

    extensions = tmp_path / "ext"
    one_node = {"TORCH_EXTENSIONS_DIR": str(extensions), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    two_nodes = {"TORCH_EXTENSIONS_DIR": str(extensions), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    check_op_build_locks(one_node)  # no lock: nothing to say
    lock = stale_lock(extensions)
    with open(lock):  # a build in progress holds its lock open (torch's FileBaton): waited on, not refused
        check_op_build_locks(one_node)
    with pytest.raises(LaunchError, match="no process here holds it"):
        check_op_build_locks(one_node)
    check_op_build_locks(two_nodes)  # young, and another node may be building into a shared folder: a note only
    assert "note: waiting for DeepSpeed's CPU op build lock" in capsys.readouterr().err
    os.utime(lock, (0, os.stat(lock).st_mtime - STALE_LOCK_SECONDS - 60))
    with pytest.raises(LaunchError, match=r"\(11 min old, no process here holds it\)"):
        check_op_build_locks(two_nodes)
