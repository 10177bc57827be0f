"""The output folder: what counts as holding a run, which flags may use it, which paths cannot be written,
what --overwrite clears. File checks only: no processes."""
import errno
import os

import pytest

from ulysses_train.config import ConfigError
from ulysses_train.training import run_folder


def test_a_fresh_or_missing_folder_is_accepted_and_created(tmp_path):
    run_folder.check_output_dir(str(tmp_path / "new"), resume=False, overwrite=False)
    # the probe is gone; the run's lock stays while this process lives
    assert os.path.isdir(tmp_path / "new") and os.listdir(tmp_path / "new") == [run_folder.LOCK]
    run_folder.release_output_dir(str(tmp_path / "new"))


@pytest.mark.parametrize("leftover,words", [
    ("metrics.jsonl", "metrics.jsonl of a run without a checkpoint"),
    ("run_config.json", "run_config.json of a run without a checkpoint"),
    ("checkpoints/step_00000003/x", "an incomplete checkpoint folder"),
    ("checkpoints/latest_good", "an incomplete checkpoint folder"),
    ("checkpoints/step_00000003/COMPLETE", "checkpoint step_00000003"),
])
def test_any_trace_of_a_run_refuses_a_new_run_without_resume_or_overwrite(tmp_path, leftover, words):
    path = tmp_path / leftover
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}\n")
    with pytest.raises(ConfigError, match=f"already holds a run \\({words}\\); pass --resume"):
        run_folder.check_output_dir(str(tmp_path), resume=False, overwrite=False)
    if "COMPLETE" in leftover:
        run_folder.check_output_dir(str(tmp_path), resume=True, overwrite=False)
    else:  # nothing to continue from: --resume says so; --resume-if-present starts the run there
        with pytest.raises(ConfigError, match=f"has no complete checkpoint to continue from \\(it holds {words}\\)"):
            run_folder.check_output_dir(str(tmp_path), resume=True, overwrite=False)
    run_folder.check_output_dir(str(tmp_path), resume=False, overwrite=False, resume_if_present=True)
    run_folder.check_output_dir(str(tmp_path), resume=False, overwrite=True)


def test_resume_into_a_folder_without_a_run_says_nothing_was_saved_and_stops(tmp_path, capsys):
    """`scripts/train.py --resume` into a new folder: one line naming the folder and both fixes, exit 2 (it trained
    from step 1 before, in silence). Control: --resume-if-present passes the folder check."""
    with pytest.raises(ConfigError, match=r"^--resume: train.output_dir='.*' has no complete checkpoint to continue "
                                          r"from \(nothing was saved there\). Fix: run without --resume to start the "
                                          r"run, or pass --resume-if-present"):
        run_folder.check_output_dir(str(tmp_path / "new"), resume=True, overwrite=False)
    run_folder.check_output_dir(str(tmp_path / "new"), resume=False, overwrite=False, resume_if_present=True)


def test_unrelated_files_do_not_count_as_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    run_folder.check_output_dir(str(tmp_path), resume=False, overwrite=False)


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--resume and --overwrite contradict each other"):
        run_folder.check_output_dir(str(tmp_path), resume=True, overwrite=True)


def test_an_output_path_that_is_a_file_is_named(tmp_path):
    (tmp_path / "out").write_text("")
    with pytest.raises(ConfigError, match="train.output_dir='.*out' is a file, not a folder"):
        run_folder.check_output_dir(str(tmp_path / "out"), resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="cannot be written: a part of the path is a file, not a folder"):
        run_folder.check_writable(str(tmp_path / "out" / "sub"), "data.cache_dir")


def test_a_folder_the_process_may_not_write_is_named():
    # /sys refuses new folders even to root (permission bits alone would not stop root)
    with pytest.raises(ConfigError, match="train.output_dir='/sys/ulysses_probe' cannot be written: permission denied"):
        run_folder.check_writable("/sys/ulysses_probe", "train.output_dir")


@pytest.mark.parametrize("code,words", [(errno.EROFS, "the file system is read-only"),
                                        (errno.ENOSPC, "no space left on the device")])
def test_read_only_and_full_devices_are_named(tmp_path, monkeypatch, code, words):
    import builtins

    real_open = builtins.open

    def failing_open(path, *args, **kwargs):
        if ".write_probe." in str(path):
            raise OSError(code, os.strerror(code))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing_open)
    with pytest.raises(ConfigError, match=f"data.cache_dir='.*' cannot be written: {words}"):
        run_folder.check_writable(str(tmp_path), "data.cache_dir")


def test_overwrite_clears_everything_a_run_wrote_and_nothing_else(tmp_path):
    for name in ("metrics.jsonl", "run_config.json", "checkpoints/step_00000001/COMPLETE", "hf_model/config.json",
                 "eval/step_00000001.json", "memory/snapshot.pickle", "mine.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    run_folder.clear_run(str(tmp_path))
    assert os.listdir(tmp_path) == ["mine.txt"]
    assert run_folder.run_evidence(str(tmp_path)) is None


def test_overwrite_refuses_a_linked_output_part_before_removing_anything(tmp_path):
    """hf_model a symbolic link (to a shared model store) ended in shutil.rmtree's traceback mid-deletion; now
    --overwrite refuses in one line first, and the store and the run's files are untouched. Control: without the
    link, --overwrite passes the same check."""
    store, run = tmp_path / "store", tmp_path / "run"
    store.mkdir()
    (store / "model.safetensors").write_text("weights")
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "step_00000001" / "COMPLETE").write_text("1")
    (run / "hf_model").symlink_to(store)
    with pytest.raises(ConfigError, match=r"^--overwrite: .*hf_model is a symbolic link \(to .*store\); overwriting "
                                          r"deletes what a run wrote here and does not follow or remove links"):
        run_folder.check_output_dir(str(run), resume=False, overwrite=True)
    assert (store / "model.safetensors").read_text() == "weights" and (run / "checkpoints").is_dir()
    (run / "hf_model").unlink()
    run_folder.check_output_dir(str(run), resume=False, overwrite=True)
    run_folder.release_output_dir(str(run))


def image_text_identity(folder, edit=None):
    """The run identity of a tiny Qwen3.5 image-text config.json in `folder`, after `edit(config_dict)` if given:
    what train.py computes from the files before a resume."""
    import json

    from helpers import TINY_SHAPE
    from helpers import GATED_DELTANET
    from transformers import Qwen3_5Config

    from ulysses_train.config import load_config
    from ulysses_train.training.resolved_run import resolve_run
    from ulysses_train.training.run_identity import run_identity

    if not os.path.exists(folder / "config.json"):
        Qwen3_5Config(text_config={**TINY_SHAPE, **GATED_DELTANET}, vision_config={"depth": 1}).save_pretrained(folder)
    if edit:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    cfg = load_config(None, [f"model.name_or_path={folder}", "model.random_init=true"])
    run = resolve_run(cfg)
    return run_identity(run.cfg, run.hf_config, {"source": "demo"})


def times_ten(config):
    config["text_config"]["rope_parameters"]["rope_theta"] *= 10


def reversed_layers(config):
    config["text_config"]["layer_types"].reverse()


@pytest.mark.parametrize("edit,words", [(times_ten, "rope_parameters.rope_theta: 10000.0 -> 100000.0"),
                                        (reversed_layers, 'layer_types: ["linear_attention", "full_attention"] -> '
                                                          '["full_attention", "linear_attention"]')])
def test_an_image_text_model_is_identified_by_its_text_model(tmp_path, edit, words):
    """An image-text checkpoint's decoder fields live in `text_config`: the identity records them (they were
    null, so an edited config.json resumed silently, or failed at the state_dict load), and a resume after an edit
    is refused naming the field."""
    import json

    from ulysses_train.training.run_identity import check_resume

    model, out = tmp_path / "model", tmp_path / "out"
    out.mkdir()
    identity = image_text_identity(model)
    assert (identity["hidden_size"], identity["num_hidden_layers"], identity["vocab_size"]) == (64, 2, 256)
    assert identity["layer_types"] == ["linear_attention", "full_attention"]
    (out / run_folder.RUN_CONFIG).write_text(json.dumps({"identity": identity}))
    assert check_resume(str(out), image_text_identity(model), False) == []  # the control: nothing changed
    with pytest.raises(ConfigError, match="holds a run of a different model") as refused:
        check_resume(str(out), image_text_identity(model, edit), False)
    assert words in str(refused.value)


def test_a_folder_recorded_before_the_text_model_fields_still_resumes(tmp_path):
    """Identities written before the text model's fields were read hold none of them and null for the image-text
    shapes: the same model still resumes; a field they did record still refuses when it changes."""
    import json

    from ulysses_train.training.run_identity import MODEL_KEYS, TEXT_MODEL_KEYS, check_resume

    model, out = tmp_path / "model", tmp_path / "out"
    out.mkdir()
    identity = image_text_identity(model)
    old = {k: (None if k in MODEL_KEYS and k != "model_type" else v) for k, v in identity.items()
           if k not in TEXT_MODEL_KEYS}
    (out / run_folder.RUN_CONFIG).write_text(json.dumps({"identity": old}))
    assert check_resume(str(out), identity, False) == []
    with pytest.raises(ConfigError, match="seed: 0 -> 1"):
        check_resume(str(out), {**identity, "seed": 1}, False)


def test_a_resume_drops_a_metrics_line_cut_short_by_a_crash(tmp_path):
    """metrics.jsonl after a crash mid-write (a full disk, a killed process): steps 1-3 whole, step 4 cut off. The
    resume from step 2 keeps steps 1-2 and continues; the cut line is dropped, not a crash of the resume. Control:
    that line is not JSON (the reader before this raised on it)."""
    import json

    import pytest

    from ulysses_train.training.metrics import MetricsLog

    torn = '{"step": 4, "loss": 2.'
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n"
                                                    for s in (1, 2, 3)) + torn)
    with pytest.raises(json.JSONDecodeError):
        json.loads(torn)
    log = MetricsLog(str(tmp_path), start_step=2)
    log.write({"step": 3, "loss": 2.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3] and json.loads(lines[-1])["loss"] == 2.5
