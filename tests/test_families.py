"""The family records (ulysses_train/families.py) against the exactness tests and the model types transformers
builds: every record's types are listed by the exactness test its record names (one step under sp and sp x dp equals
the plain model), every type those tests list has a record, and a model type with no record is refused in one line
by the trainer's config check and by plan.py alike, or trained with a warning when asked. Controls: a recorded type
passes the same check; a record naming a table that lacks its type is caught."""
import importlib

import pytest
from helpers import load_script, tiny_family_config, tiny_qwen3_config

from ulysses_train.config import ConfigError, ModelConfig
from ulysses_train.families import FAMILIES, family_of

UNRECORDED = {
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0),
    "olmo": dict(pad_token_id=0),
    "starcoder2": dict(),
    "stablelm": dict(),
}
"""Model types transformers builds that have no exactness test here: refused."""


def listed_types(exactness: str) -> set:
    """The model types an exactness test's table lists (`module.NAME`: a dict keyed by type, or a tuple; a key
    `type-variant` lists the type: model types never hold a dash)."""
    module, name = exactness.split(".")
    return {key.split("-")[0] for key in getattr(importlib.import_module(module), name)}


def exactness_problems(families) -> list:
    return [f"{family.name}: {t} is not in {family.exactness}" for family in families for t in family.model_types
            if t not in listed_types(family.exactness)]


def test_every_record_is_listed_by_its_exactness_test_and_every_listed_type_has_a_record():
    assert exactness_problems(FAMILIES) == []
    listed = set().union(*(listed_types(family.exactness) for family in FAMILIES))
    assert sorted(t for t in listed if family_of(t) is None) == []
    import dataclasses

    wrong = dataclasses.replace(FAMILIES[0], exactness="test_model_families.WINDOWED_FAMILIES")  # the control
    assert exactness_problems([wrong]) == ["Qwen3: qwen3 is not in test_model_families.WINDOWED_FAMILIES"]


def test_the_core_exactness_test_runs_the_type_its_table_names():
    """test_step.MODEL_TYPES stands for the core test's tiny model: that model is a Qwen3."""
    import test_step

    assert tuple(test_step.MODEL_TYPES) == (tiny_qwen3_config().model_type,)


def unrecorded_configs() -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return {t: tiny_family_config(t, **fields) for t, fields in UNRECORDED.items() if t in CONFIG_MAPPING}


def test_a_model_type_without_a_record_is_refused_in_one_line_or_trained_with_a_warning_when_asked(capsys):
    from ulysses_train.model.loading import check_supported_architecture

    configs = unrecorded_configs()
    assert len(configs) >= 5  # transformers 5.17 builds fewer of them; 5.25 all
    for model_type, config in configs.items():
        with pytest.raises(ConfigError, match=rf"^model type '{model_type}' has no family record: .* Families that "
                                              rf"train: Qwen3, Llama, .*model.allow_untested_family: true"):
            check_supported_architecture(config)
        check_supported_architecture(config, allow_untested=True)
        err = capsys.readouterr().err
        assert f"warning: model type '{model_type}' has no family record" in err
        kinds = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        assert "Its layers: " in err and all(f"{kind} (the attention mixer)" in err for kind in kinds), err
        assert "anything else its attention class computes is what was not checked" in err  # the opt-in's honesty
    check_supported_architecture(tiny_qwen3_config())  # the control: a recorded family passes
    assert capsys.readouterr().err == ""


def test_train_and_plan_refuse_an_unrecorded_model_folder_alike(tmp_path, capsys):
    """The trainer's model check (load_model_config) and plan.py --model on the same folder: one line, exit 2 for
    plan.py; --allow-untested-family / model.allow_untested_family let both go on."""
    from ulysses_train.model.loading import load_model_config

    folder = tmp_path / "m"
    next(iter(unrecorded_configs().values())).save_pretrained(folder)
    with pytest.raises(ConfigError, match="has no family record"):
        load_model_config(ModelConfig(name_or_path=str(folder), random_init=True))
    load_model_config(ModelConfig(name_or_path=str(folder), random_init=True, allow_untested_family=True))
    plan = load_script("scripts/plan.py")
    capsys.readouterr()
    argv = ["--model", str(folder), "--seq-length", "4096", "--gpus-per-node", "1", "--no-story"]
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model type ") and "has no family record" in err and err.count("\n") == 1
    assert plan.main([*argv, "--allow-untested-family"]) in (0, 1)  # planned (fits or not)


ISSUE_TRACEBACKS = ("deepseek_v3", "longcat_flash", "gemma4_text", "mimo_v2_flash")
"""Model types that ended in tracebacks (DeepSpeed's Ulysses shape assertion for MLA's and MiMo-V2-Flash's head
widths, transformers' per-layer attribute error for Gemma 4's head dims): each now has a family record and its
exactness test (tests/test_latent_attention.py, tests/test_gemma4.py)."""


def test_the_types_that_ended_in_tracebacks_have_records_and_plan(tmp_path, capsys):
    """Each plans from a tiny config folder at sp=2 (exit 0: fits, or 1: does not; never a traceback) and loads
    for training. Control: with its record removed, plan.py refuses it in one line (exit 2)."""
    from test_gemma4 import GEMMA4_FAMILIES
    from test_latent_attention import LATENT_FAMILIES

    from ulysses_train import families
    from ulysses_train.model.loading import load_model_config

    shapes = {**LATENT_FAMILIES, **GEMMA4_FAMILIES}
    plan = load_script("scripts/plan.py")
    argv = ["--seq-length", "4096", "--gpus-per-node", "2", "--sp", "2", "--no-story"]
    for model_type in ISSUE_TRACEBACKS:
        assert families.family_of(model_type) is not None, model_type
        folder = tmp_path / model_type
        tiny_family_config(model_type, **shapes[model_type]).save_pretrained(folder)
        assert plan.main(["--model", str(folder), *argv]) in (0, 1), model_type
        load_model_config(ModelConfig(name_or_path=str(folder), random_init=True))
    capsys.readouterr()
    recorded = families.FAMILIES
    try:
        families.FAMILIES = tuple(f for f in recorded if "gemma4_text" not in f.model_types)
        assert plan.main(["--model", str(tmp_path / "gemma4_text"), *argv]) == 2
    finally:
        families.FAMILIES = recorded
    err = capsys.readouterr().err
    assert "has no family record" in err and err.count("\n") == 1


def own_exchange_problems(families) -> list:
    """Each record's own_exchange class that its model type's transformers module does not define (a misspelled
    name would leave the layer on DeepSpeed's wrapper, which stops at its shape check under sp)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    problems = []
    for family in families:
        for model_type in family.model_types if family.own_exchange else ():
            name = model_type_to_module_name(model_type)
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            problems += [f"{model_type}: {c}" for c in family.own_exchange if not hasattr(module, c)]
    return problems


def test_each_own_exchange_class_is_its_model_types_attention():
    """The attention classes the records send through the own exchange exist in their types' modules; control:
    a record naming another family's class is caught."""
    import dataclasses

    from ulysses_train.families import own_exchange_classes
    from ulysses_train.model.mixers.attention_exchange import OWN_EXCHANGE_CLASSES

    assert own_exchange_problems(FAMILIES) == []
    assert OWN_EXCHANGE_CLASSES == own_exchange_classes() and "Gemma4TextAttention" in OWN_EXCHANGE_CLASSES
    wrong = dataclasses.replace(family_of("gemma4_text"), own_exchange=("DeepseekV3Attention",))
    assert own_exchange_problems([wrong]) == ["gemma4_text: DeepseekV3Attention"]


def model_type_strings(source: str, types: set) -> list:
    """(line, string) of each string constant in `source` that is one of `types`."""
    import ast

    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in types]


def test_no_package_module_but_the_records_names_a_model_type():
    """A family's facts are written once: every model type a record covers appears as a string only in families.py
    and in presets.py (whose configs are data keyed by it); every table keyed by model type elsewhere derives from the
    records. Control: a compare the package once held (architecture.py's Nemotron-H expert count) is found."""
    import os

    from helpers import REPO

    types = {t for family in FAMILIES for t in family.model_types}
    allowed = {os.path.join("ulysses_train", "families.py"), os.path.join("ulysses_train", "model", "presets.py")}
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "ulysses_train")):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(folder, name)
            if os.path.relpath(path, REPO) not in allowed:
                found += [(os.path.relpath(path, REPO), *hit) for hit in model_type_strings(open(path).read(), types)]
    assert found == []
    held = 'if text.model_type == "nemotron_h" and "moe" not in text.layers_block_type:\n    pass\n'
    assert model_type_strings(held, types) == [(1, "nemotron_h")]


def test_each_linear_mixer_a_record_names_is_a_mixer_that_builds_its_types():
    """A record's `linear_mixer` names a registered mixer, and that mixer builds the record's linear-attention layers
    (its `model_types` come from the records). Control: attention's own type list is open (None), not derived."""
    from ulysses_train.model.mixers import MIXERS, mixer_of_layer

    by_name = {mixer.name: mixer for mixer in MIXERS}
    for family in (f for f in FAMILIES if f.linear_mixer):
        for model_type in family.model_types:
            assert mixer_of_layer(model_type, "linear_attention") is by_name[family.linear_mixer]
    assert mixer_of_layer("qwen3", "linear_attention") is None and by_name["attention"].model_types is None


def test_an_untested_attention_that_ulysses_cannot_exchange_is_refused_in_one_line(tmp_path, capsys):
    """`deepseek_v2` (no record) opted in: its MLA has q/k heads wider than its v heads, which DeepSpeed's wrapper
    takes only as one width (it ended in the wrapper's assertion at step 1). The trainer's layout check and plan.py
    refuse sp=2 in one line naming the widths and the fix. Controls: sp=1 passes; the recorded DeepSeek-V3 (its own
    exchange) passes at sp=2."""
    from test_latent_attention import DEEPSEEK_V3

    from ulysses_train.parallel.layout import validate_parallel_layout

    v2 = tiny_family_config("deepseek_v2", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                            v_head_dim=12, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, first_k_dense_replace=1)
    with pytest.raises(ConfigError, match=r"^model type 'deepseek_v2' has no family record and its attention has "
                                          r"q/k heads 16 wide and v heads 12 wide.*Fix: "
                                          r"parallel.sequence_parallel_size=1"):
        validate_parallel_layout(v2, 2, "sdpa")
    validate_parallel_layout(v2, 1, "sdpa")
    validate_parallel_layout(tiny_family_config("deepseek_v3", **DEEPSEEK_V3), 2, "sdpa")
    folder = tmp_path / "v2"
    v2.save_pretrained(folder)
    plan = load_script("scripts/plan.py")
    argv = ["--model", str(folder), "--seq-length", "4096", "--gpus-per-node", "2", "--no-story",
            "--allow-untested-family"]
    capsys.readouterr()
    assert plan.main([*argv, "--sp", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: model type 'deepseek_v2' has no family record and its attention has q/k")
    assert "Fix: --sp=1" in err[-1] and not any(line.startswith("Traceback") for line in err)
    assert plan.main([*argv, "--sp", "1"]) in (0, 1)


def walk_outcome(model_type: str) -> tuple:
    """(outcome, message) of the checks a run makes before loading (loading.check_supported_architecture on the
    config it builds, image_text.text_model_config) on `model_type`'s default config: ("trains", record name),
    ("refused", the one-line reason), ("no default config", why transformers cannot build one), or ("broken", the
    exception that is not a one-line refusal)."""
    from transformers import AutoConfig

    from ulysses_train.model.architecture import text_config
    from ulysses_train.model.image_text import text_model_config
    from ulysses_train.model.loading import check_supported_architecture

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as err:  # noqa: BLE001 - transformers' own validation of its defaults
        return "no default config", type(err).__name__
    try:
        built = text_model_config(config)
        check_supported_architecture(built, allow_untested=False)
        family = family_of(text_config(built).model_type)
        return ("trains", family.name) if family else ("broken", "accepted without a record")
    except ConfigError as err:
        message = str(err)
        one_line = "\n" not in message and ("model type" in message or "the model config's" in message)
        return ("refused", message) if one_line else ("broken", message)
    except Exception as err:  # noqa: BLE001 - what the test exists to find
        return "broken", f"{type(err).__name__}: {err}"


def test_every_causal_lm_type_transformers_ships_trains_or_is_refused_in_one_line(monkeypatch):
    """The coverage walk: every model type of the installed transformers' causal-LM mapping (so it cannot go stale)
    either passes the checks and has a family record (whose exactness test lists it: the test above), or is refused
    by one line naming the model type or the config key at fault (no family record, layers no mixer builds, a logit
    or score post-processing not built, an encoder-decoder model); none raises anything else. A type whose default
    config transformers itself cannot build is only counted (at most 3). Control: a config check that raises a bare
    AttributeError is found as broken."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    outcomes = {t: walk_outcome(t) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}
    kinds = [kind for kind, _ in outcomes.values()]
    assert {t: o for t, o in outcomes.items() if o[0] == "broken"} == {}
    assert kinds.count("trains") >= 50 and kinds.count("refused") >= 50 and kinds.count("no default config") <= 3
    print(f"{len(outcomes)} causal-LM types: {kinds.count('trains')} train, {kinds.count('refused')} refused in one "
          f"line, {kinds.count('no default config')} without a default config")
    from ulysses_train.model import config_fields

    monkeypatch.setattr(config_fields, "check_model_fields", lambda config: config.no_such_field)
    assert walk_outcome("qwen3")[0] == "broken"
