"""docs/configuration.md's table is the reference: every config key is in it, with its real default."""
import dataclasses
import os

from helpers import REPO
from ulysses_train.config import Config

# defaults the table states in words, because they are derived at run time
DERIVED = {"model.rope_factor": "derived", "data.tokenizer": "model", "data.cache_dir": "~/.cache/ulysses_train/data",
           "model.name_or_path": ""}


def table_rows() -> dict:
    with open(os.path.join(REPO, "docs", "configuration.md")) as fh:
        text = fh.read()
    table = text[text.index("| key | default | meaning |"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        key, default = (cell.strip() for cell in line.split("|")[1:3])
        rows[key.strip("`")] = default.strip("`")
    return rows


def config_defaults() -> dict:
    out = {}
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(section.default_factory()):
            out[f"{section.name}.{field.name}"] = getattr(section.default_factory(), field.name)
    return out


def shown(value) -> str:
    """A default as YAML writes it (true, 0, [], {})."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "[]" if value == [] else "{}" if value == {} else str(value)


def table_problems(rows: dict, defaults: dict) -> list:
    """Keys missing from the table or from the config, and defaults the table states wrongly."""
    problems = [f"not in the table: {key}" for key in sorted(set(defaults) - set(rows))]
    problems += [f"not a config key: {key}" for key in sorted(set(rows) - set(defaults))]
    problems += [f"{key}: table says {rows[key]!r}, the config {shown(value)!r}" for key, value in defaults.items()
                 if key in rows and rows[key] != DERIVED.get(key, shown(value))]
    return problems


def test_every_config_key_is_in_the_configuration_table_with_its_default():
    assert table_problems(table_rows(), config_defaults()) == []


def test_the_table_check_catches_a_missing_row_and_a_wrong_default():
    """Negative control: the same comparison on a table without one key, or with one default changed."""
    missing = table_rows()
    del missing["train.eval_bucket"]
    assert table_problems(missing, config_defaults()) == ["not in the table: train.eval_bucket"]
    changed = {**table_rows(), "train.steps": "11"}
    assert table_problems(changed, config_defaults()) == ["train.steps: table says '11', the config '10'"]


def test_every_shipped_config_loads_and_validates():
    """configs/*.yaml go through the same loader and checks as scripts/train.py (a typo or a retired key fails)."""
    import glob

    from ulysses_train.config import load_config

    paths = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
    assert len(paths) >= 5
    for path in paths:
        load_config(path)
    sessions = load_config(os.path.join(REPO, "configs", "qwen3_8b_sessions_1m_8gpu.yaml"))
    assert (sessions.data.format, sessions.data.packing, sessions.model.attn_implementation) == ("chat", "documents", "fa4")


def test_train_help_points_to_the_config_table(capsys):
    import pytest

    from ulysses_train import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    assert "docs/configuration.md" in capsys.readouterr().out


def docs_text() -> str:
    """The README and every page under docs/, as one text."""
    import glob

    paths = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    return "\n".join(open(path).read() for path in paths)


def test_resume_text_agrees_with_resuming_on_another_gpu_count():
    """The Resume paragraph said a resume "needs the same number of GPUs and the same sp" while its own section
    "Resuming on another number of GPUs" (and the test behind it) says otherwise."""
    text = " ".join(docs_text().split())
    assert "## Resuming on another number of GPUs" in text
    assert "needs the same number of GPUs" not in text and "the same number of GPUs and the same sp" not in text
