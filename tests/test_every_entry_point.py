"""Every family the trainer accepts through every entry point: scripts/train.py, scripts/eval_context.py and
scripts/plan.py, one preset of each family (model/presets.py: PRESETS, so a family added there joins this walk
without an edit here; its other sizes take the same path) at test size. A family that trained but could not be evaluated (Kimi Linear: eval_context.py read a RoPE field
its config does not have) or planned is found here, not by a user.

Each preset is a folder with its config.json (reduced_fields: the published fields, smaller) and the test tokenizer;
the model is random-init (the weights are not the point: the entry points' handling of the family is). All commands
run from one launched process (script_cases.py)."""
import os

import pytest
from helpers import REPO
from preset_worker import published_fields, reduced_preset
from script_cases import case, run_cases

from ulysses_train.model.presets import PRESETS, preset_config
from ulysses_train.model.mixers import has_sliding_windows

VOCAB = 1024  # past the test tokenizer (1,000 and any token a model folder adds), as releases pad theirs
TOKEN_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
"""The test tokenizer's ids (conftest.bpe_tokenizer): a preset's own ids lie past its test vocabulary."""
ENTRY_POINTS = ("train", "eval_context", "plan")


def env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


def family_of(name: str) -> tuple:
    """What sets a preset's code path through the entry points: its model type and the kinds of its layers (the
    sizes do not: qwen3-0.6b, -4b and -8b take the same path; Nemotron-H's 8B has MLP layers, its Nano experts)."""
    config = preset_config(name)
    return config.model_type, tuple(sorted(set(getattr(config, "layer_types", None) or [])))


def one_per_family(names=PRESETS) -> list[str]:
    """The first preset of each family (family_of), in the registry's order."""
    families = {}
    for name in names:
        families.setdefault(family_of(name), name)
    return list(families.values())


def walk(names=PRESETS) -> list[tuple[str, str]]:
    """(preset, entry point) for one preset of every family: the walk's cases."""
    return [(name, entry) for name in one_per_family(names) for entry in ENTRY_POINTS]


def tiny_folder(name: str, root, tokenizer) -> tuple[str, str]:
    """(folder with the preset's test-size config.json and the tokenizer, the attention it needs)."""
    ids = {key: value for key, value in TOKEN_IDS.items() if published_fields(name).get(key) is not None}
    config = reduced_preset(name, vocab_size=VOCAB, **ids)
    folder = str(root / f"tiny-{name}")  # not the preset's own name, which plan.py would read as the full preset
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, "fa4" if has_sliding_windows(config) else "sdpa"  # windows need a kernel that takes them


def commands(name: str, folder: str, attn: str, root, corpus) -> list[dict]:
    model = ["--set", "model.dtype=float32", "--set", f"model.attn_implementation={attn}"]
    train = ["--set", f"model.name_or_path={folder}", "--set", "model.random_init=true", *model,
             "--set", f"data.source={corpus}", "--set", f"data.tokenizer={folder}", "--set", "data.seq_length=128",
             "--set", "data.num_proc=1", "--set", f"data.cache_dir={root / 'cache' / name}", "--set", "train.steps=1",
             "--set", "train.export_hf=false", "--set", f"train.output_dir={root / 'runs' / name}"]
    probe = ["--model", folder, "--random-init", *model, "--lengths", "300", "--depths", "50", "--tasks", "passkey",
             "--out", str(root / "evals" / name)]
    plan = ["--model", folder, "--seq-length", "4096", "--gpus-per-node", "1", "--attention", attn]
    scripts = {"train": (os.path.join(REPO, "scripts", "train.py"), train),
               "eval_context": (os.path.join(REPO, "scripts", "eval_context.py"), probe),
               "plan": (os.path.join(REPO, "scripts", "plan.py"), plan)}
    return [case(f"{name} {entry}", argv, env(), script=script) for entry, (script, argv) in scripts.items()]


@pytest.fixture(scope="module")
def walked(tmp_path_factory, bpe_tokenizer):
    root = tmp_path_factory.mktemp("every_entry_point")
    corpus = root / "corpus.txt"
    corpus.write_text("the mill by the river turns all day and the miller counts the sacks of grain\n" * 200)
    cases = []
    for name in one_per_family():
        folder, attn = tiny_folder(name, root / "models", bpe_tokenizer)
        cases += commands(name, folder, attn, root, corpus)
    return run_cases(cases, root, env(), timeout=1800, at_once=2)  # each case its own folders and data cache


@pytest.mark.parametrize("name,entry", walk())
def test_every_preset_passes_every_entry_point(walked, name, entry):
    result = walked[f"{name} {entry}"]
    assert result.returncode == 0, f"{name} through {entry}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    expected = {"train": "loss", "eval_context": "retrieval accuracy: ", "plan": "GiB"}[entry]
    assert expected in result.stdout + result.stderr, (result.stdout[-2000:], result.stderr[-2000:])


def test_negative_control_a_family_added_to_the_registry_joins_the_walk(monkeypatch):
    """The walk reads the registry: a family added there is walked (and would fail here until every entry point
    takes it), one not added is not."""
    from ulysses_train.model import presets

    monkeypatch.setitem(presets.FAMILY_PRESETS, "newfamily-1b", ("llama", "org/NewFamily-1B", {}))
    names = (*presets.QWEN3_SHAPES, *presets.FAMILY_PRESETS)
    assert ("newfamily-1b", "eval_context") in walk(names) and ("newfamily-1b", "train") not in walk(PRESETS)
    assert len(walk(names)) == len(walk(PRESETS)) + 3 and preset_config("newfamily-1b").model_type == "llama"
    # a second size of a family already walked takes its path: not walked again (qwen3's three sizes, one walked)
    assert [name for name, entry in walk() if entry == "plan" and name in presets.QWEN3_SHAPES] == ["qwen3-0.6b"]
