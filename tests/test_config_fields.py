"""A malformed model config is refused in one line, the same by every entry point (model/config_fields.py).

Each case is a test-size family config (a preset's, or transformers' own class) with one key set as a hand edit or a
bad `config_overrides` leaves it: a value head of width 0, more KV heads than query heads, YaRN without its factor or
with a mscale that is not a number, a latent expert width of 0, a per-layer list of the wrong length. The old code
planned several of them as "fits" and trained them into a traceback at step 1. scripts/train.py, eval_context.py,
plan.py and warm_kernels.py run on each (one launched process, script_cases.py) and must all end in exit 2 with the
same line naming the key; a control case (the same folder unedited) passes the check."""
import json
import os

import pytest
from helpers import REPO
from preset_worker import reduced_preset
from script_cases import case, run_cases

from ulysses_train.errors import ConfigError
from ulysses_train.families import FAMILIES
from ulysses_train.model import config_fields
from ulysses_train.model.config_fields import check_model_fields
from ulysses_train.model.presets import PRESETS, preset_config

IDS = dict(vocab_size=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def smollm3(**fields):
    from transformers import AutoConfig

    return AutoConfig.for_model("smollm3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, **IDS, **fields)


def _set_rope(key, value):
    def edit(fields):
        fields["rope_parameters"] = {**fields["rope_parameters"], key: value}
        if value is None:
            del fields["rope_parameters"][key]
    return edit


CASES = {  # name: (config builder, edit of its config.json, the words the refusal must hold)
    "value head of width 0": (lambda: reduced_preset("deepseek-v3", vocab_size=1024),
                              lambda f: f.update(v_head_dim=0), "v_head_dim=0 must be a whole number > 0"),
    "YaRN without its factor": (lambda: reduced_preset("deepseek-v3", vocab_size=1024), _set_rope("factor", None),
                                "Missing required keys in `rope_parameters` for 'rope_type'='yarn': {'factor'}"),
    "mscale not a number": (lambda: reduced_preset("deepseek-v3", vocab_size=1024), _set_rope("mscale", "big"),
                            "rope_parameters.mscale='big' must be a finite number"),
    "more KV heads than query heads": (lambda: reduced_preset("qwen3-0.6b", **IDS),
                                       lambda f: f.update(num_key_value_heads=2 * f["num_attention_heads"]),
                                       "num_key_value_heads=8 is more than num_attention_heads=4"),
    "latent expert width 0": (lambda: reduced_preset("nemotron-3-nano-30b-a3b", vocab_size=1024),
                              lambda f: f.update(moe_latent_size=0), "moe_latent_size=0 must be a whole number > 0"),
    "padding id past the vocabulary": (lambda: reduced_preset("qwen3-0.6b", **IDS),
                                       lambda f: f.update(pad_token_id=f["vocab_size"] + 5),
                                       "pad_token_id=1029 is not a token of its vocab_size=1024"),
    "no_rope_layers too short": (smollm3, lambda f: f.update(no_rope_layers=[1, 0]),
                                 "no_rope_layers has 2 entries, where num_hidden_layers=4 needs one per layer"),
}
ENTRY_POINTS = ("train", "eval_context", "plan", "warm_kernels")


def env():
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")


def written(folder, config, edit) -> str:
    config.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        fields = json.load(fh)
    edit(fields)
    with open(path, "w") as fh:
        json.dump(fields, fh)
    return str(folder)


def commands(name: str, folder: str, root, corpus, tokenizer_folder) -> list[dict]:
    script = {entry: os.path.join(REPO, "scripts", f"{entry}.py") for entry in ENTRY_POINTS}
    argv = {
        "train": ["--set", f"model.name_or_path={folder}", "--set", "model.random_init=true", "--set",
                  f"data.source={corpus}", "--set", f"data.tokenizer={tokenizer_folder}", "--set",
                  "data.seq_length=128", "--set", f"train.output_dir={root / 'runs' / name}"],
        "eval_context": ["--model", folder, "--random-init", "--tokenizer", tokenizer_folder, "--lengths", "300",
                         "--depths", "50", "--tasks", "passkey", "--out", str(root / "evals" / name)],
        "plan": ["--model", folder, "--seq-length", "4096", "--gpus-per-node", "1"],
        "warm_kernels": ["--config", os.path.join(REPO, "configs", "qwen3_5_9b_sessions_256k_1gpu.yaml"), "--set",
                         f"model.name_or_path={folder}", "--plan-only"],
    }
    return [case(f"{name} {entry}", argv[entry], env(), script=script[entry]) for entry in ENTRY_POINTS]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, bpe_tokenizer):
    root = tmp_path_factory.mktemp("config_fields")
    corpus = root / "corpus.txt"
    corpus.write_text("the mill by the river turns all day\n" * 50)
    tokenizer_folder = str(root / "tokenizer")
    bpe_tokenizer.save_pretrained(tokenizer_folder)
    cases = []
    for index, (name, (build, edit, _)) in enumerate(CASES.items()):
        folder = written(root / f"model-{index}", build(), edit)
        cases += commands(name, folder, root, corpus, tokenizer_folder)
    return run_cases(cases, root, env(), timeout=1200)


@pytest.mark.parametrize("name", CASES)
def test_every_entry_point_refuses_the_malformed_key_in_the_same_line(refusals, name):
    words = CASES[name][2]
    for entry in ENTRY_POINTS:
        result = refusals[f"{name} {entry}"]
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and "Traceback" not in result.stderr, (entry, result.stderr[-3000:])
        assert lines and lines[-1].startswith("error: ") and words in lines[-1], (entry, lines[-1:])
        assert config_fields.FIX in lines[-1], (entry, lines[-1])


def test_every_family_and_preset_passes_the_check():
    """The control: each family's own transformers config, each preset at full and test size, unedited, passes (so
    the refusals above are the edits', not the check refusing a family)."""
    from transformers import AutoConfig

    for model_type in (t for family in FAMILIES for t in family.model_types):
        check_model_fields(AutoConfig.for_model(model_type))
    for name in PRESETS:
        check_model_fields(preset_config(name))
        check_model_fields(reduced_preset(name))


@pytest.mark.parametrize("name", CASES)
def test_the_check_catches_each_case_as_built_in_memory_or_by_config_overrides(tmp_path, name):
    """The same edits without a config.json: an override the trainer applies after reading the file (the check runs
    after model.config_overrides)."""
    build, edit, words = CASES[name]
    config = build()
    fields = config.to_dict()
    edited = json.loads(json.dumps(fields))  # a deep copy the edit may change
    edit(edited)
    for key in (key for key in edited if edited[key] != fields.get(key)):
        setattr(config, key, edited[key])  # as load_model_config applies model.config_overrides
    with pytest.raises(ConfigError) as err:
        check_model_fields(config)
    assert words in str(err.value), str(err.value)


def test_every_per_layer_list_of_a_family_is_checked():
    """Every list a family's transformers config holds one entry per layer of is in PER_LAYER_LISTS (or is
    one of the mixers' own PER_LAYER_KEYS, `layer_types` among them, or a list of layer indices that can name every
    layer: LAYER_INDEX_LISTS, Llama 4's `moe_layers`): a family added later with a new per-layer key fails here until
    it is."""
    from transformers import AutoConfig

    from ulysses_train.model.mixers import PER_LAYER_KEYS

    checked = {*config_fields.PER_LAYER_LISTS, *PER_LAYER_KEYS, *config_fields.LAYER_INDEX_LISTS}
    for model_type in (t for family in FAMILIES for t in family.model_types):
        fields = AutoConfig.for_model(model_type).to_dict()
        layers = fields.get("num_hidden_layers")
        for key, value in fields.items():
            if isinstance(value, list) and layers and len(value) == layers and len(value) > 2:
                assert key in checked, f"{model_type}: {key} lists one value per layer but is not checked"


def test_negative_control_a_check_left_out_lets_the_case_through(monkeypatch):
    """With the width check emptied, the value head of width 0 passes: the test above fails on the old code."""
    config = CASES["value head of width 0"][0]()
    config.v_head_dim = 0
    with pytest.raises(ConfigError):
        check_model_fields(config)
    monkeypatch.setattr(config_fields, "POSITIVE_WIDTHS", ())
    check_model_fields(config)
