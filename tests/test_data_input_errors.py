"""Data mistakes end as one `error:` line and exit code 2, never a traceback, with their negative controls (the
config, file and model mistakes: test_input_errors.py): tokenizer folders, the text field named as the script
that reads it names it, the early corpus checks, seq_length against sp and the documented demo lengths.
"""
import os

import pytest
from helpers import REPO, load_script, one_error_line, write_jsonl

from ulysses_train import cli
from ulysses_train.config import DataConfig, load_config
from ulysses_train.data.corpus import DataError, check_data_inputs, load_corpus, load_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---------------------------------------------------------------- 3c. tokenizer folders


def test_missing_tokenizer_folder_is_called_missing(tmp_path):
    with pytest.raises(DataError, match=r"data.tokenizer='/nonexistent/tok': the local path .* does not exist"):
        load_tokenizer("/nonexistent/tok", option="data.tokenizer")


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="the folder holds no usable tokenizer") as err:
        load_tokenizer(str(tmp_path / "empty"))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- 4. the text field: flag or key


def test_missing_text_field_names_the_config_key_for_train_py(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", [{"body": "hello world"}])
    with pytest.raises(DataError, match=r"no text field 'text'; its fields are body. Fix: data.text_field: NAME") \
            as err:
        load_corpus(source, cache_dir=tmp_path / "raw")
    assert "--text-field" not in str(err.value)


def test_missing_text_field_names_the_flag_for_prepare_data(bpe_tokenizer, tmp_path, capsys):
    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    source = write_jsonl(tmp_path / "c.jsonl", [{"body": "hello world"}])
    argv = ["--source", str(source), "--tokenizer", str(tmp_path / "tok"), "--seq-length", "64",
            "--cache-dir", str(tmp_path / "cache")]
    assert load_script("scripts/prepare_data.py").main(argv) == 2
    err = capsys.readouterr().err
    assert "Fix: --text-field NAME" in err and "data.text_field" not in err


def test_prepare_data_unwritable_cache_is_one_line(bpe_tokenizer, tmp_path, capsys):
    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    argv = ["--source", str(source), "--tokenizer", str(tmp_path / "tok"), "--seq-length", "64",
            "--cache-dir", str(blocker / "cache")]
    assert load_script("scripts/prepare_data.py").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the cache") and "Traceback" not in err


# ---------------------------------------------------------------- 5. early data checks


@pytest.fixture
def tokenizer_dir(bpe_tokenizer, tmp_path):
    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


def data(source, tokenizer="", **kwargs) -> DataConfig:
    return DataConfig(source=str(source), tokenizer=tokenizer, **kwargs)


def test_early_check_passes_a_good_corpus(tmp_path, tokenizer_dir):
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}, {"text": "world"}])
    check_data_inputs(data(source, tokenizer_dir, seq_length=128), "unused/model", pad_multiple=2)
    check_data_inputs(data("demo", seq_length=7), "", pad_multiple=4)  # the demo skips it


def test_early_check_missing_corpus(tmp_path, tokenizer_dir):
    with pytest.raises(DataError, match="does not exist"):
        check_data_inputs(data(tmp_path / "absent.jsonl", tokenizer_dir), "m", 1)


def test_early_check_text_field_in_jsonl_parquet_and_saved(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    source = write_jsonl(tmp_path / "c.jsonl", [{"body": "hello", "id": 1}])
    with pytest.raises(DataError, match="no text field 'text'; its fields are body, id. Fix: data.text_field: NAME"):
        check_data_inputs(data(source, tokenizer_dir), "m", 1)
    with pytest.raises(DataError, match="field 'id' of corpus .* holds int, not text"):
        check_data_inputs(data(source, tokenizer_dir, text_field="id"), "m", 1)
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match="no text field 'text'; its fields are body, n"):
        check_data_inputs(data(tmp_path / "c.parquet", tokenizer_dir), "m", 1)
    check_data_inputs(data(tmp_path / "c.parquet", tokenizer_dir, text_field="body"), "m", 1)
    Dataset.from_dict({"content": ["a", "b"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match="no text field 'text'; its fields are content"):
        check_data_inputs(data(tmp_path / "saved", tokenizer_dir), "m", 1)
    check_data_inputs(data(tmp_path / "saved", tokenizer_dir, text_field="content"), "m", 1)


def test_early_check_tokenizer_falls_back_to_the_model_and_says_so(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match=r"model.name_or_path='/nonexistent/m'.*does not exist.*data.tokenizer is "
                                        r"empty, so the model's tokenizer is used"):
        check_data_inputs(data(source), "/nonexistent/m", 1)


def test_early_check_tokenizer_without_eos(tmp_path, bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    no_eos = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer.backend_tokenizer)
    no_eos.save_pretrained(tmp_path / "no_eos")
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match="has no EOS token"):
        check_data_inputs(data(source, str(tmp_path / "no_eos")), "m", 1)


def test_early_check_seq_length_names_config_keys_and_nearest_lengths(tmp_path, tokenizer_dir):
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match=r"data.seq_length=1,000 is not a multiple of "
                                        r"parallel.sequence_parallel_size=16 .*Fix: data.seq_length=1,008 or 992"):
        check_data_inputs(data(source, tokenizer_dir, seq_length=1000), "m", 16)


# ---------------------------------------------------------------- 6. seq_length and sp agree with the README


def test_corpus_eval_lengths_not_multiple_of_sp_are_refused_early(tmp_path, tokenizer_dir):
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match=r"train.eval_lengths holds 4,098, not a multiple of "
                                        r"parallel.sequence_parallel_size=4 .*Fix: 4,100 or 4,096"):
        check_data_inputs(data(source, tokenizer_dir, seq_length=4096), "m", 4, eval_lengths=[4096, 4098])
    check_data_inputs(data(source, tokenizer_dir, seq_length=4096), "m", 4, eval_lengths=[4096, 8192])


def test_demo_seq_length_is_padded_not_refused_and_the_readme_says_which():
    cfg = load_config(None, ["data.seq_length=130", "parallel.sequence_parallel_size=4"])
    assert cfg.data.seq_length == 130
    readme = open(os.path.join(REPO, "docs", "configuration.md")).read()
    row = next(line for line in readme.splitlines() if line.startswith("| `data.seq_length`"))
    assert "multiple of" in row and "the demo pads" in row


def test_overrides_do_not_leak_into_the_demo_defaults(capsys):
    """In one process (tests, eval_positions), a bad --set must not stay in cli.DEMO_DEFAULTS for the next run."""
    one_error_line(["--set", "parallel.allow_sp_across_nodes=maybe"], capsys)
    assert "allow_sp_across_nodes" not in cli.DEMO_DEFAULTS["parallel"]
    assert load_config(None, [], defaults=cli.DEMO_DEFAULTS).parallel.allow_sp_across_nodes is False


@pytest.mark.parametrize("flag", ["--tflops", "--host-link-gbps", "--gpu-gib", "--host-gib"])
def test_plan_script_refuses_non_positive_hardware_numbers(flag, capsys):
    """--tflops 0 was a ZeroDivisionError traceback."""
    assert load_script("scripts/plan.py").main(["--model", "qwen3-0.6b", "--no-story", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}=0.0 must be a positive number." in err and "Traceback" not in err


def test_demo_seq_length_too_short_is_a_config_error(capsys):
    """Was a ValueError traceback from demo.RetrievalTask after the process group started."""
    line = one_error_line(["--set", "data.seq_length=8"], capsys)
    assert "data.seq_length=8 is too short for the demo task" in line and "Fix: data.seq_length >= " in line
    assert load_config(None, ["data.seq_length=128"]).data.seq_length == 128  # negative control


def test_a_device_as_the_corpus_is_named_as_such(tokenizer_dir):
    """data.source=/dev/zero was called an empty folder; it is named as what it is. Control: a missing path is
    still called missing (test_early_check_missing_corpus)."""
    with pytest.raises(DataError, match=r"^corpus '/dev/zero' is a character device, not a file or a folder\. Fix:"):
        check_data_inputs(data("/dev/zero", tokenizer_dir), "m", 1)


def test_a_corpus_smaller_than_one_sequence_is_named_with_the_repeats(tmp_path, bpe_tokenizer):
    """An empty and a whitespace-only .txt: a few tokens, packed into one padded sequence that every step trains
    again. The packing summary's notice says so in one line; control: a corpus of two full sequences gets none."""
    from ulysses_train.data.corpus import build_packed_dataset

    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "a.txt").write_text("")
    (tmp_path / "small" / "b.txt").write_text("   \n")
    _, summary = build_packed_dataset(tmp_path / "small", bpe_tokenizer, 64, cache_dir=tmp_path / "cache")
    notice = summary.repeats_notice(sequences_per_step=2, steps=3)
    held = summary.document_tokens + summary.separator_tokens
    assert notice == (f"note: corpus {summary.source} holds {held} tokens, less than one sequence of 64 "
                      f"({64 - held} tokens of it padding): every step trains that one sequence again, 6 times in "
                      f"train.steps=3") and 0 < held < 10
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "a.txt").write_text("abc def ghi " * 200)
    _, summary = build_packed_dataset(tmp_path / "big", bpe_tokenizer, 64, cache_dir=tmp_path / "cache")
    assert summary.sequences >= 2 and summary.repeats_notice(2, 3) is None
