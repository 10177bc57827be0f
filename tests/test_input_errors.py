"""Every user mistake ends as one `error:` line and exit code 2, never a traceback, with its negative controls
(here the config, its files and the model; the data's: test_data_input_errors.py).

Config-level mistakes go through `cli.main` in this process (they fail before any process group starts);
model, tokenizer and corpus mistakes call the function that meets them (`load_model_config`,
`load_tokenizer`, `check_data_inputs`, ...) on tiny folders built in tmp_path. Nothing here builds an engine.
"""
import json

import pytest
from helpers import load_script, one_error_line, tiny_qwen3_config, write_jsonl

from ulysses_train.config import ConfigError, ModelConfig, load_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---------------------------------------------------------------- 1. every field against its type


@pytest.mark.parametrize("override, message", [
    ("train.export_hf=maybe", "train.export_hf='maybe' must be true or false (unquoted in YAML)."),
    ("parallel.allow_sp_across_nodes=yes please", "parallel.allow_sp_across_nodes='yes please' must be true or false"),
    ("data.drop_last=1", "data.drop_last=1 must be true or false"),
    ("model.gradient_checkpointing=sometimes", "model.gradient_checkpointing='sometimes' must be true or false"),
])
def test_bool_fields_need_a_real_bool(override, message, capsys):
    assert message in one_error_line(["--set", override], capsys)


def test_quoted_false_in_yaml_is_refused_not_truthy(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text('train:\n  export_hf: "false"\n')
    assert "train.export_hf='false' must be true or false (unquoted in YAML)" in \
        one_error_line(["--config", str(path)], capsys)


def test_unquoted_false_really_is_false(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  export_hf: false\ndata:\n  drop_last: true\n")
    cfg = load_config(str(path), ["parallel.allow_sp_across_nodes=false", "model.tiled_mlp=true"])
    assert cfg.train.export_hf is False and cfg.data.drop_last is True
    assert cfg.parallel.allow_sp_across_nodes is False and cfg.model.tiled_mlp is True  # bare YAML bool allowed


@pytest.mark.parametrize("override, message", [
    ("train.save_every=often", "train.save_every='often' must be an integer."),
    ("train.seed=abc", "train.seed='abc' must be an integer."),
    ("train.steps=2.5", "train.steps=2.5 must be an integer."),
    ("data.seq_length=true", "data.seq_length=True must be an integer."),
    ("model.rope_factor=big", "model.rope_factor='big' must be a number or unset (null)."),
    ("model.keep_attention_fraction=half", "model.keep_attention_fraction='half' must be auto or a number"),
    ("model.config_overrides=5", "model.config_overrides=5 must be a mapping, e.g. {num_hidden_layers: 4}."),
    ("train.eval_lengths=4096", "train.eval_lengths=4096 must be a list"),
    ("data.text_field=7", "data.text_field=7 must be text"),
])
def test_type_slips_name_the_key(override, message, capsys):
    assert message in one_error_line(["--set", override], capsys)


def test_num_proc_slip_blames_num_proc_not_the_corpus(capsys):
    line = one_error_line(["--set", "data.num_proc=many"], capsys)
    assert "data.num_proc='many' must be an integer" in line and "corpus" not in line


def test_numbers_of_the_right_type_still_pass():
    cfg = load_config(None, ["model.rope_factor=4", "model.keep_attention_fraction=1", "train.seed=7"])
    assert (cfg.model.rope_factor, cfg.model.keep_attention_fraction, cfg.train.seed) == (4, 1, 7)


@pytest.mark.parametrize("override, message", [
    ("train.seed=-1", "train.seed=-1 must be from 0 to 2**32 - 1"),
    ("data.num_proc=0", "data.num_proc=0 must be a positive integer"),
    ("data.num_samples=0", "data.num_samples=0 must be a positive integer"),
    ("train.output_dir=' '", "train.output_dir is empty"),
])
def test_range_slips_siblings(override, message, capsys):
    assert message in one_error_line(["--set", override], capsys)


# ---------------------------------------------------------------- 2. files that are not what they should be


@pytest.mark.parametrize("content, kind", [("42\n", "int"), ("- a\n- b\n", "list"), ("just text\n", "str")])
def test_yaml_file_that_is_not_a_mapping(content, kind, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    line = one_error_line(["--config", str(path)], capsys)
    assert f"must be a YAML mapping of sections (model:, data:, train:, ...), but its content is {kind}" in line


def test_empty_yaml_section_is_named(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model:\ntrain:\n  steps: 1\n")
    assert "section 'model' must be a mapping of its keys, got NoneType (an empty section in YAML is null" in \
        one_error_line(["--config", str(path)], capsys)


def test_invalid_yaml_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train: [unclosed\n")
    assert "is not valid YAML" in one_error_line(["--config", str(path)], capsys)


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ("{not json", "is not valid JSON"),
    ('{"zero_optimization": 3}', '"zero_optimization" must be an object such as {"stage": 3}, got 3'),
    ('{"bf16": true}', '"bf16" must be an object such as {"enabled": "auto"}, got true'),
])
def test_deepspeed_json_that_is_not_an_object(content, message, tmp_path):
    from ulysses_train.training.ds_config import load_deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="train.deepspeed_config=.*" + message.replace("{", r"\{")
                       .replace("[", r"\[").replace("}", r"\}").replace("]", r"\]")):
        load_deepspeed_config(str(path))


def test_deepspeed_json_missing_or_a_folder(tmp_path):
    from ulysses_train.training.ds_config import load_deepspeed_config

    with pytest.raises(ConfigError, match="does not exist"):
        load_deepspeed_config(str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="is a folder; name a JSON file"):
        load_deepspeed_config(str(tmp_path))
    assert isinstance(load_deepspeed_config("ds_configs/zero3.json"), dict)  # negative control


# ---------------------------------------------------------------- 3. model folders and names


def model_folder(tmp_path, name="m", weights=False, **edits) -> str:
    """A tiny Qwen3 config.json (and, with weights, an empty safetensors index stand-in) with dict edits."""
    folder = tmp_path / name
    folder.mkdir()
    data = tiny_qwen3_config().to_dict()
    for key, value in edits.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (folder / "config.json").write_text(json.dumps(data))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.mark.parametrize("name", ["/nonexistent/model", "./no_such_model", "~/no_such_model_dir", "runs/a/hf_model"])
def test_missing_local_model_folder_is_called_missing(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    from ulysses_train.model.loading import load_model_config

    with pytest.raises(ConfigError) as err:
        load_model_config(ModelConfig(name_or_path=name, random_init=True))
    message = str(err.value)
    assert f"model.name_or_path={name!r}: the local path {name!r} does not exist" in message
    assert "Repo id" not in message


def test_hub_name_is_not_called_a_missing_folder(monkeypatch, tmp_path):
    """Negative control: Qwen/Qwen3-8B goes to the hub (offline here: its own error), never 'does not exist'."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the hub library reads the variable once, at import: without this it would try the network until it times out
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    from ulysses_train.model.loading import read_hf_config
    from ulysses_train.user_input import missing_local_path

    assert missing_local_path("Qwen/Qwen3-8B") is None
    try:
        read_hf_config("Qwen/Qwen3-8B-not-a-real-repo")
    except ConfigError as err:
        assert "does not exist" not in str(err) and "\n" not in str(err)


def test_missing_model_folder_through_the_cli(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{name_or_path: {tmp_path}/absent/model}}\ndata: {{source: {corpus}, seq_length: 64}}\n"
                    f"train: {{output_dir: {tmp_path}/out}}\n")
    line = one_error_line(["--config", str(path)], capsys)
    assert "does not exist" in line and "Repo id" not in line


def test_model_folder_without_weights_suggests_random_init(tmp_path):
    from ulysses_train.model.loading import load_model_config

    folder = model_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"has config.json but no weights .*model.random_init: true"):
        load_model_config(ModelConfig(name_or_path=folder))
    assert load_model_config(ModelConfig(name_or_path=folder, random_init=True)).model_type == "qwen3"


def test_folder_without_config_json(tmp_path):
    from ulysses_train.model.loading import load_model_config

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is a folder without config.json"):
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "empty"), random_init=True))


def test_unknown_model_type_is_named(tmp_path):
    from ulysses_train.model.loading import load_model_config

    folder = model_folder(tmp_path, model_type="frobnicator")
    with pytest.raises(ConfigError, match=r"model_type 'frobnicator', which transformers .* does not know"):
        load_model_config(ModelConfig(name_or_path=folder, random_init=True))


def test_custom_code_is_refused_never_run(tmp_path):
    from ulysses_train.model.loading import load_model_config

    folder = model_folder(tmp_path, model_type="my_custom_lm",
                          auto_map={"AutoConfig": "configuration_x.XConfig",
                                    "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(ConfigError, match=r"needs custom code .*auto_map.*trust_remote_code stays off"):
        load_model_config(ModelConfig(name_or_path=folder, random_init=True))


def test_encoder_decoder_is_not_told_to_switch_rope_off(tmp_path):
    from transformers import T5Config

    from ulysses_train.model.loading import load_model_config

    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=100).save_pretrained(tmp_path / "t5")
    with pytest.raises(ConfigError) as err:
        load_model_config(ModelConfig(name_or_path=str(tmp_path / "t5"), random_init=True))
    assert "is an encoder-decoder model: it is not a decoder-only causal LM" in str(err.value)
    assert "rope_scaling" not in str(err.value)


def test_rope_less_model_within_its_length_passes_with_rope_none():
    """'use rope_scaling none' must be advice that works: a model without RoPE is left alone within its length."""
    from transformers import GPT2Config

    from ulysses_train.model.rope import RopeConfigError, apply_rope_scaling

    config = GPT2Config(n_positions=1024)
    assert apply_rope_scaling(config, 512, "none").applied == "none"
    assert apply_rope_scaling(config, 512, "auto").applied == "none"
    with pytest.raises(RopeConfigError, match=r"supports 1,024 positions.*data.seq_length <= 1,024"):
        apply_rope_scaling(config, 2048, "none")


# ---------------------------------------------------------------- 3b. the same for scripts/plan.py


@pytest.mark.parametrize("name, message", [
    ("/nonexistent/model", "the local path '/nonexistent/model' does not exist"),
    ("a/b/c", "the local path 'a/b/c' does not exist"),
])
def test_plan_script_uses_the_same_missing_path_check(name, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert load_script("scripts/plan.py").main(["--model", name, "--no-story"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Repo id" not in err and "Traceback" not in err


@pytest.mark.parametrize("name, message", [
    ("qwen3.5-99b", "--model 'qwen3.5-99b': unknown model (not one of the presets). Known presets: qwen3-0.6b,"),
    ("GPT-OSS-120B", "--model 'GPT-OSS-120B': unknown model (not one of the presets). Known presets: qwen3-0.6b,"),
    ("Qwen/Qwen3.5-99B", "could not fetch from the Hugging Face hub the model config of --model 'Qwen/Qwen3.5-99B'"),
])
def test_plan_script_names_the_presets_for_an_unknown_model(name, message, tmp_path, monkeypatch, capsys):
    """A bare name that reads as one of our presets is no hub name: it gets the list of presets, not the hub's
    connection error (it used to). An org/name is still asked of the hub (real ones work with the network); when
    it cannot be fetched (offline here), the line says so and lists the presets too. A local folder of that name
    is still read (the control)."""
    from ulysses_train.model.presets import PRESETS

    monkeypatch.chdir(tmp_path)
    assert load_script("scripts/plan.py").main(["--model", name, "--no-story"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and all(preset in lines[0] for preset in PRESETS), lines
    model_folder(tmp_path, "qwen3.5-99b")
    assert load_script("scripts/plan.py").main(["--model", "qwen3.5-99b", "--no-story"]) in (0, 1)  # planned: fits or not


def test_plan_script_refuses_unknown_type_and_custom_code(tmp_path, capsys):
    plan = load_script("scripts/plan.py")
    unknown = model_folder(tmp_path, "unknown", model_type="frobnicator")
    custom = model_folder(tmp_path, "custom", model_type="x_lm", auto_map={"AutoConfig": "c.C"})
    assert plan.main(["--model", unknown, "--no-story"]) == 2
    assert "does not know" in capsys.readouterr().err
    assert plan.main(["--model", custom, "--no-story"]) == 2
    assert "needs custom code" in capsys.readouterr().err


def test_plan_script_refuses_a_mixer_without_planner_terms(capsys, monkeypatch):
    """A model whose mixer has no planner terms (its registry entry's `planned` is False): one line, no traceback.
    Kimi Linear has its terms (a plan comes out); with its Kimi Delta Attention entry's kind emptied it is refused."""
    import dataclasses

    from ulysses_train.model import mixers

    plan = load_script("scripts/plan.py")
    assert plan.main(["--model", "kimi-linear-48b-a3b", "--seq-length", "131072", "--gpus-per-node", "8", "--sp", "8",
                      "--no-story"]) == 0
    assert "layer: Kimi Delta Attention backward" in capsys.readouterr().out
    unplanned = tuple(dataclasses.replace(m, planned=False) if m.name == "kimi_delta" else m for m in mixers.MIXERS)
    monkeypatch.setattr(mixers, "MIXERS", unplanned)
    assert plan.main(["--model", "kimi-linear-48b-a3b", "--no-story"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot model this architecture (the planner has no memory terms for " \
        "kimi_delta layers" in err and "Traceback" not in err, err


def test_a_folder_with_only_pickle_weights_is_refused_in_one_line(tmp_path):
    """pytorch_model.bin alone ended in transformers' UnpicklingError traceback; it is refused before anything
    loads, naming the file and the conversion. Control: the same folder with safetensors weights passes."""
    import torch
    from helpers import save_tiny_model, tiny_qwen3_config

    from ulysses_train.model.loading import read_hf_config

    folder = tmp_path / "m"
    tiny_qwen3_config().save_pretrained(folder)
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"holds its weights only as pickle files \(pytorch_model.bin\), which "
                                          r"ulysses-train does not load: a pickle can run code\. Fix: convert"):
        read_hf_config(str(folder), need_weights=True)
    save_tiny_model(str(tmp_path / "good"))
    read_hf_config(str(tmp_path / "good"), need_weights=True)
