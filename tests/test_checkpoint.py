"""Run checkpoints without processes or DeepSpeed engines: the safe loader refuses pickled code, the manifest
finds damaged files, resume falls back to the newest intact checkpoint, a failed save says why.

The checkpoint folders here are built by hand in the layout `checkpoint.save` writes (real `torch.save` files,
a real manifest from `checkpoint._hash_share`), so each check meets the bytes it would meet in a run.
"""
import errno
import json
import os
import shutil

import pytest
import torch

from ulysses_train.training import checkpoint, checkpoint_read
from ulysses_train.training.checkpoint import CheckpointError
from ulysses_train.training.checkpoint_read import UnsafeCheckpointError

MARKER_NAME = "payload_ran"


class _Payload:
    """Unpickling this calls os.system: what a crafted checkpoint file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_payload(path, marker):
    torch.save({"torch": torch.zeros(3), "evil": _Payload(marker)}, path)


def make_checkpoint(output_dir, step, world_size=2, sp=2):
    """A step folder like checkpoint.save leaves: DeepSpeed-like files, RNG files, manifest, pointer."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    root = checkpoint.checkpoint_root(str(output_dir))
    tag = checkpoint.tag_for(step)
    folder = os.path.join(root, tag)
    os.makedirs(folder)
    for rank in range(world_size):
        torch.save({"module": None, "param_shapes": [{"w": torch.Size([4, 4])}], "ds_config": {"a": 1}},
                   os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
                                             "fp32": torch.randn(64)}},
                   os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        torch.save(checkpoint.rng_state(), os.path.join(folder, f"rng_rank{rank}.pt"))
    manifest = {"step": step, "world_size": world_size, "sp": sp, "files": checkpoint._hash_share(root, tag)}
    checkpoint._write_atomic(os.path.join(folder, checkpoint.COMPLETE), json.dumps(manifest))
    checkpoint._write_atomic(os.path.join(root, checkpoint.LATEST), tag)
    return folder


def forge_manifest(folder):
    """What an attacker who can write the folder can do too: make the manifest match the planted files."""
    root, tag = os.path.split(folder)
    manifest = json.loads(open(os.path.join(folder, checkpoint.COMPLETE)).read())
    manifest["files"] = checkpoint._hash_share(root, tag)
    checkpoint._write_atomic(os.path.join(folder, checkpoint.COMPLETE), json.dumps(manifest))


# ---------------------------------------------------------------- nothing runs from a file


@pytest.mark.parametrize("name", ["rng_rank0.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_pickle_payload_in_any_checkpoint_file_is_refused_and_nothing_runs(tmp_path, name):
    folder = make_checkpoint(tmp_path, 2)
    marker = tmp_path / MARKER_NAME
    plant_payload(os.path.join(folder, name), marker)
    forge_manifest(folder)
    with pytest.raises(UnsafeCheckpointError, match=f"refused to read .*{name}.*could run code"):
        checkpoint_read.choose_for_resume(str(tmp_path))
    with pytest.raises(UnsafeCheckpointError, match=name):
        checkpoint_read.safe_torch_load(os.path.join(folder, name))
    assert not marker.exists()
    # negative control: the plain loader DeepSpeed uses does run it
    torch.load(os.path.join(folder, name), weights_only=False)
    assert marker.exists()


def test_a_file_that_differs_from_its_manifest_is_damaged_never_read_and_passed_over(tmp_path):
    """A payload planted without forging the manifest is a file the run did not write: never read (nothing runs),
    the newest intact checkpoint is chosen. (A forged manifest is refused outright: the test above.)"""
    make_checkpoint(tmp_path, 1)
    folder = make_checkpoint(tmp_path, 2)
    plant_payload(os.path.join(folder, "rng_rank1.pt"), tmp_path / MARKER_NAME)  # manifest not forged
    tag, passed_over = checkpoint_read.choose_for_resume(str(tmp_path))
    assert tag == "step_00000001" and "rng_rank1.pt" in passed_over[0] and "not read" in passed_over[0]
    assert not (tmp_path / MARKER_NAME).exists()


def _flip_in_pickle_stream(path):
    """Overwrite the first opcode of the zip member data.pkl (the pickle stream, not the tensor data; after the
    2-byte protocol header) with 'c', GLOBAL: the stream then names a garbage global, as random damage often does
    (a flip elsewhere may still load, or fail as unreadable)."""
    import struct
    import zipfile

    data = bytearray(open(path, "rb").read())
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("data.pkl"))
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start + 2] = ord("c")
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("name", ["zero_pp_rank_1_mp_rank_00_model_states.pt",
                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_flipped_bytes_in_a_pickle_stream_are_damage_and_fall_back(tmp_path, name):
    """Bytes flipped inside data.pkl read, to the safe loader, like a file holding code; checked against the
    manifest first, the file is damaged, said so, and the previous checkpoint is chosen."""
    make_checkpoint(tmp_path, 1)
    folder = make_checkpoint(tmp_path, 2)
    _flip_in_pickle_stream(os.path.join(folder, name))
    with pytest.raises(UnsafeCheckpointError):  # negative control: the pickle alone looks like code
        checkpoint_read.safe_torch_load(os.path.join(folder, name))
    tag, passed_over = checkpoint_read.choose_for_resume(str(tmp_path))
    assert tag == "step_00000001" and name in passed_over[0] and "damaged" in passed_over[0]
    assert "could run code" not in passed_over[0]


def test_deepspeed_files_and_rng_state_load_with_the_safe_loader(tmp_path):
    folder = make_checkpoint(tmp_path, 1)
    state = checkpoint_read.safe_torch_load(os.path.join(folder, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert state["optimizer_state_dict"]["fp32"].shape == (64,)
    rng = checkpoint_read.safe_torch_load(os.path.join(folder, "rng_rank0.pt"))
    checkpoint.set_rng_state(rng)
    assert torch.equal(torch.get_rng_state(), rng["torch"])


def test_the_engine_reads_through_the_safe_loader():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class FakeEngine:
        checkpoint_engine = TorchCheckpointEngine()

    engine = FakeEngine()
    checkpoint_read.install_safe_loader(engine)
    assert engine.checkpoint_engine.load is checkpoint_read.safe_torch_load


def test_every_torch_load_inside_weights_only_loads_is_safe_as_deepspeed_calls_it(tmp_path):
    """DeepSpeed reads the universal format's files (stage3.load_hp_checkpoint_state) and its optimizer files with
    `torch.load(path, weights_only=False)`, past its checkpoint engine: inside `weights_only_loads` that very call
    is refused naming the file, and so is a reader holding torch's function under another name (torch's switch).
    Control: the same call outside runs the payload."""
    path, marker = str(tmp_path / "fp32.pt"), tmp_path / MARKER_NAME
    plant_payload(path, marker)
    original = torch.load
    with checkpoint_read.weights_only_loads():
        with pytest.raises(UnsafeCheckpointError, match="refused to read .*fp32.pt.*could run code"):
            torch.load(path, weights_only=False)
        assert torch.load(str(make_checkpoint(tmp_path, 1)) + "/rng_rank0.pt", weights_only=False)["torch"].numel()
    with pytest.raises(UnsafeCheckpointError, match=r"could run code \(.*GLOBAL posix.system.*Nothing from it was run"):
        with checkpoint_read.weights_only_loads():  # raised where DeepSpeed's whole load_checkpoint call ends
            torch.serialization.load(path, weights_only=False)
    assert not marker.exists()
    assert torch.load is original and checkpoint_read.FORCE_WEIGHTS_ONLY not in os.environ
    torch.load(path, weights_only=False)  # the control
    assert marker.exists()


READER = "import sys, torch\ntorch.load(sys.argv[1], weights_only=False)\n"


def test_the_universal_conversion_runs_deepspeed_with_every_load_safe(tmp_path):
    """`to_universal` runs DeepSpeed's `ds_to_universal` through `run_module_weights_only`: a module reading a file
    as ds_to_universal does (weights_only=False) is refused there and nothing runs. Control: run plainly, it runs."""
    import subprocess
    import sys

    (tmp_path / "plain_reader.py").write_text(READER)
    path, marker = str(tmp_path / "optim.pt"), tmp_path / MARKER_NAME
    plant_payload(path, marker)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    safe = subprocess.run([sys.executable, "-c", "from ulysses_train.training.checkpoint_read import "
                           "run_module_weights_only as run; run('plain_reader')", path],
                          env=env, capture_output=True, text=True)
    assert safe.returncode != 0 and "could run code" in safe.stderr and not marker.exists(), safe.stderr[-2000:]
    plain = subprocess.run([sys.executable, "-m", "plain_reader", path], env=env, capture_output=True, text=True)
    assert marker.exists(), plain.stderr[-2000:]


@pytest.mark.parametrize("linked", ["universal_step_00000001", "universal_step_00000001.partial"])
def test_a_linked_universal_folder_is_refused_naming_the_link_before_anything_is_written(tmp_path, linked):
    """A resume on another layout converts the checkpoint into checkpoints/universal_<tag> anew. Where that folder
    (or its `.partial`) is a symbolic link, the conversion would write where it points and the final rename fails
    (NotADirectoryError, the `.partial` left behind): refused in one line naming the link, nothing written or read
    on either side. Control: without the link the conversion runs (and fails here on a checkpoint that holds no
    DeepSpeed files, with the other message)."""
    make_checkpoint(tmp_path, 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.txt").write_text("mine")
    root = tmp_path / "checkpoints"
    (root / linked).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError, match=rf"^{root / linked} is a symbolic link \(to {elsewhere}\): .*Remove the "
                                              r"link and rerun with --resume\.$"):
        checkpoint_read.to_universal(str(tmp_path), "step_00000001", 0)
    assert os.listdir(elsewhere) == ["kept.txt"] and (root / linked).is_symlink()
    assert [n for n in os.listdir(root) if n.startswith("universal_") and n != linked] == []  # nothing written
    (root / linked).unlink()
    with pytest.raises(CheckpointError, match="could not convert checkpoint step_00000001"):
        checkpoint_read.to_universal(str(tmp_path), "step_00000001", 0)
    assert not os.path.exists(root / "universal_step_00000001.partial")


# ---------------------------------------------------------------- damaged checkpoints


def test_intact_checkpoint_is_chosen(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    assert checkpoint_read.choose_for_resume(str(tmp_path)) == ("step_00000002", [])


@pytest.mark.parametrize("damage,words", [
    ("truncate", "has .* bytes, the manifest says"),
    ("flip", "does not match the sha256"),
    ("delete", "is missing"),
    ("add", "is not in the manifest"),
    ("manifest", "COMPLETE is unreadable"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, words):
    make_checkpoint(tmp_path, 1)
    folder = make_checkpoint(tmp_path, 2)
    shard = os.path.join(folder, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    if damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif damage == "flip":
        data = bytearray(open(shard, "rb").read())
        data[-40] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    elif damage == "delete":
        os.remove(shard)
    elif damage == "add":
        open(os.path.join(folder, "extra.bin"), "wb").write(b"x")
    elif damage == "manifest":
        open(os.path.join(folder, checkpoint.COMPLETE), "w").write("{not json")
    tag, passed_over = checkpoint_read.choose_for_resume(str(tmp_path))
    assert tag == "step_00000001"
    assert len(passed_over) == 1 and passed_over[0].startswith("step_00000002: ")
    assert __import__("re").search(words, passed_over[0]), passed_over


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    folder = make_checkpoint(tmp_path, 1)
    os.truncate(os.path.join(folder, "rng_rank0.pt"), 10)
    with pytest.raises(CheckpointError, match="no intact checkpoint .*step_00000001: .*rng_rank0.pt.*--overwrite"):
        checkpoint_read.choose_for_resume(str(tmp_path))


def test_no_checkpoint_ever_completed_starts_from_zero(tmp_path):
    os.makedirs(os.path.join(checkpoint.checkpoint_root(str(tmp_path)), "step_00000003"))  # a save that died
    assert checkpoint_read.choose_for_resume(str(tmp_path)) == (None, [])


def test_a_damaged_pointer_falls_back_to_the_newest_complete_folder(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    pointer = os.path.join(checkpoint.checkpoint_root(str(tmp_path)), checkpoint.LATEST)
    for text in ("step_0000", "", "\x00\xff garbage"):
        open(pointer, "w").write(text)
        assert checkpoint.latest_good(str(tmp_path)) == "step_00000002"
    os.remove(pointer)
    assert checkpoint.latest_good(str(tmp_path)) == "step_00000002"
    assert checkpoint_read.choose_for_resume(str(tmp_path))[0] == "step_00000002"


def test_damaged_folders_are_set_aside_and_never_pruned(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2)
    root = checkpoint.checkpoint_root(str(tmp_path))
    checkpoint_read.set_aside_damaged(str(tmp_path), "step_00000001")
    assert sorted(os.listdir(root)) == ["damaged_step_00000002", "latest_good", "step_00000001"]
    assert checkpoint.latest_good(str(tmp_path)) == "step_00000001"
    checkpoint._prune(root, keep_last=1)
    assert os.path.isdir(os.path.join(root, "damaged_step_00000002"))


def test_old_checkpoints_without_a_manifest_still_resume_through_the_safe_loader(tmp_path):
    folder = make_checkpoint(tmp_path, 1)
    open(os.path.join(folder, checkpoint.COMPLETE), "w").write("1\n")  # the format before manifests
    assert checkpoint_read.choose_for_resume(str(tmp_path)) == ("step_00000001", [])
    plant_payload(os.path.join(folder, "rng_rank0.pt"), tmp_path / MARKER_NAME)
    with pytest.raises(UnsafeCheckpointError):
        checkpoint_read.choose_for_resume(str(tmp_path))
    assert not (tmp_path / MARKER_NAME).exists()


# ---------------------------------------------------------------- layout


def test_another_layout_is_recognised_for_a_universal_resume(tmp_path):
    """The manifest's layout decides whether a resume goes through the universal format (the end-to-end resume
    on another process count: test_train_script.py::test_resume_on_another_gpu_count_continues_the_run)."""
    make_checkpoint(tmp_path, 1, world_size=4, sp=2)
    assert checkpoint.saved_layout(str(tmp_path), "step_00000001", {"world_size": 4, "sp": 2}) is None
    assert checkpoint.saved_layout(str(tmp_path), "step_00000001", {"world_size": 2, "sp": 2}) == \
        {"world_size": 4, "sp": 2}
    assert checkpoint.layout_words({"world_size": 4, "sp": 2}) == "4 processes with parallel.sequence_parallel_size=2"


# ---------------------------------------------------------------- a save that fails


class _FailingEngine:
    def __init__(self, error):
        self.error = error
        self.module = torch.nn.Linear(1, 1)

    def save_checkpoint(self, root, tag, client_state, save_latest, exclude_frozen_parameters=False):
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        open(os.path.join(root, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"), "wb").write(b"partial")
        raise self.error


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 2816 vs 2708")])
def test_a_full_disk_during_a_save_names_the_problem_and_the_last_good_checkpoint(tmp_path, error, monkeypatch):
    make_checkpoint(tmp_path, 3, world_size=1, sp=1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 100, 1 << 20))
    with pytest.raises(CheckpointError) as info:
        checkpoint.save(_FailingEngine(error), str(tmp_path), 6, {"step": 6}, rank=0)
    message = str(info.value)
    assert "could not save checkpoint step_00000006: no space left on the device" in message
    assert "the last good checkpoint is " + os.path.join(checkpoint.checkpoint_root(str(tmp_path)), "step_00000003") in message
    assert not os.path.exists(os.path.join(checkpoint.checkpoint_root(str(tmp_path)), "step_00000006"))
    assert checkpoint.latest_good(str(tmp_path)) == "step_00000003"


def test_a_permission_error_during_a_save_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no permission to write .*step_00000001.*no checkpoint was written yet"):
        checkpoint.save(_FailingEngine(PermissionError(errno.EACCES, "Permission denied")), str(tmp_path), 1, {},
                        rank=0)
