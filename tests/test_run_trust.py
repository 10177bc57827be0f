"""A run folder holds one run: two runs at once are refused (and a lock left by a killed run is taken over), a
resume onto other data or into another run's folder is refused before the model is built, naming what changed
(unless asked for), a tampered checkpoint is refused before the model too, a damaged pickle stream falls back to
the previous checkpoint, a corpus rewritten with the same size and mtime is tokenized again, and the export
never leaves a mix of two models in hf_model/.

One scenario of real processes (one-process runs of a local corpus, the cheapest that reach every path) checks
them in turn. "Before the model is built" is read from stdout: building the model prints its `model changes:`
line, so a refusal without it came first.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import time

from helpers import REPO, kill_tree, launch_ranks, save_tiny_model
from test_checkpoint import MARKER_NAME, _flip_in_pickle_stream, forge_manifest, plant_payload
from train_runs import env

from ulysses_train.training import checkpoint

TRAIN = os.path.join(REPO, "scripts", "train.py")
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
BUILT = "model changes:"   # printed while the model is built


def write_corpus(folder, count=12, words=300):
    folder.mkdir()
    rng = random.Random(0)
    for i in range(count):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    return folder


def rewrite_keeping_size_and_mtime(path):
    """New content, same byte count, and the old modification time put back (what cp -p or rsync -t do)."""
    before = os.stat(path)
    path.write_text(path.read_text().upper())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def train(config, *args, extra_env=None):
    """scripts/train.py as one rank, forked by the rank server (tests/helpers.launch_ranks: the imports paid once)."""
    return launch_ranks(1, [TRAIN, "--config", str(config), *args], dict(env(), **(extra_env or {})), 600)


def one_line_refusal(proc, *words):
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    assert BUILT not in proc.stdout, "refused only after the model was built"
    return errors[0]


def make_run(tmp_path, bpe_tokenizer):
    """A local corpus, tokenizer and model, a second tokenizer and a deeper model to change to, and the config."""
    corpus = write_corpus(tmp_path / "corpus")
    bpe_tokenizer.save_pretrained(tmp_path / "tokenizer")
    other_tokenizer = bpe_tokenizer.__class__.from_pretrained(tmp_path / "tokenizer")
    other_tokenizer.add_tokens(["<extra>"])
    other_tokenizer.save_pretrained(tmp_path / "other_tokenizer")
    vocab = len(bpe_tokenizer) + 8  # room for the second tokenizer's token (a tokenizer larger than the embeddings is refused)
    model = save_tiny_model(str(tmp_path / "model"), vocab_size=vocab)
    other_model = save_tiny_model(str(tmp_path / "other_model"), vocab_size=vocab, num_hidden_layers=3)
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(f"""
model: {{name_or_path: {model}, dtype: float32, attn_implementation: sdpa}}
parallel: {{sequence_parallel_size: 1}}
data: {{source: {corpus}, tokenizer: {tmp_path / 'tokenizer'}, seq_length: 256, num_proc: 1,
       cache_dir: {tmp_path / 'cache'}}}
train: {{output_dir: {out}, save_every: 2, keep_last: 2, export_hf: false}}
""")
    return config, out, corpus, other_model


def two_runs_at_once(config, out):
    """A second run into the folder of a live run is refused, and the live run's files stay; the live run is then
    killed with SIGKILL, leaving its lock file behind. Returns its two checkpoints, newest first."""
    first = subprocess.Popen([sys.executable, TRAIN, "--config", str(config), "--set", "train.steps=100000"],
                             env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while len(checkpoint.complete_tags(str(out))) < 2 and time.time() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert len(checkpoint.complete_tags(str(out))) >= 2, first.poll()
        second = train(config, "--overwrite")
        one_line_refusal(second, "is in use by another run", f"pid {first.pid} ")
        assert first.poll() is None and len(checkpoint.complete_tags(str(out))) >= 2
    finally:
        kill_tree(first.pid)   # kill -9: its lock file stays behind, stale
        first.wait()
    return checkpoint.complete_tags(str(out))[:2]


def test_one_run_per_folder_and_resume_checked_before_the_model(tmp_path, bpe_tokenizer):
    config, out, corpus, other_model = make_run(tmp_path, bpe_tokenizer)
    newest, older = two_runs_at_once(config, out)

    # 2. resume onto changed data: refused before the model, naming each change (the stale lock is taken over)
    rewrite_keeping_size_and_mtime(corpus / "doc03.txt")
    changed = train(config, "--resume", "--set", "data.drop_last=true", "--set",
                    f"data.tokenizer={tmp_path / 'other_tokenizer'}")
    one_line_refusal(changed, "data.drop_last: false -> true", "the tokenizer (its vocabulary", "the corpus content",
                     "train.resume_data_change=true")
    # 3. resume into the folder of another model: refused before the model, naming the difference
    other = train(config, "--resume", "--set", f"model.name_or_path={other_model}")
    one_line_refusal(other, "holds a run of a different model", "num_hidden_layers: 2 -> 3")

    # 4. a file holding code whose manifest was forged to match: refused before the model, nothing runs
    states = out / "checkpoints" / newest / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shutil.copy(states, tmp_path / "states.pt")
    shutil.copy(out / "checkpoints" / newest / "COMPLETE", tmp_path / "COMPLETE")
    plant_payload(str(states), tmp_path / MARKER_NAME)
    forge_manifest(str(out / "checkpoints" / newest))
    tampered = train(config, "--resume", "--set", "train.resume_data_change=true")
    one_line_refusal(tampered, f"refused to read {states}", "could run code")
    assert not (tmp_path / MARKER_NAME).exists()
    shutil.copy(tmp_path / "states.pt", states)
    shutil.copy(tmp_path / "COMPLETE", out / "checkpoints" / newest / "COMPLETE")
    damaged_resume_then_exports(config, out, newest, older)


def damaged_resume_then_exports(config, out, newest, older):
    """Steps 5 and 6 of the scenario above, on its run folder."""
    # 5. flipped bytes in a pickle stream: damage, passed over; the changed corpus accepted as asked and
    #    tokenized again; the export replaces a folder of the user's files whole
    _flip_in_pickle_stream(str(out / "checkpoints" / newest / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    user_files = {"model.safetensors.index.json": json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}),
                  "model-00001-of-00002.safetensors": "not weights", "notes.txt": "mine"}
    (out / "hf_model").mkdir()
    for name, text in user_files.items():
        (out / "hf_model" / name).write_text(text)
    step = int(older.split("_")[1])
    final = train(config, "--resume", "--set", "train.resume_data_change=true", "--set", f"train.steps={step + 2}",
                  "--set", "train.export_hf=true")
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"passed over damaged checkpoint {newest}" in final.stdout and "does not match the sha256" in final.stdout
    assert "could run code" not in final.stdout + final.stderr
    assert f"resumed from {older}" in final.stdout
    assert "warning: resuming on changed data (the corpus content (data.source) changed)" in final.stdout
    cache_line = next(line for line in final.stdout.splitlines() if line.strip().startswith("cache "))
    assert "(reused)" not in cache_line, cache_line   # the rewritten file was read again
    exported = sorted(os.listdir(out / "hf_model"))
    assert "model.safetensors" in exported and not any(name.startswith("model-0") or name.endswith("index.json")
                                                        for name in exported), exported
    assert {name: (out / "hf_model.previous" / name).read_text() for name in user_files} == user_files
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "hf_model")   # loads: no stale index pointing at a missing shard

    # 6. an export that failed (a full disk: the partial folder of a later one left, no hf_model/): --resume of the
    #    finished run says so and exports from its last checkpoint; nothing partial is left
    shutil.rmtree(out / "hf_model")
    (out / "hf_model.partial").mkdir()
    (out / "hf_model.partial" / "model.safetensors").write_text("cut short")
    again = train(config, "--resume", "--set", "train.resume_data_change=true", "--set", f"train.steps={step + 2}",
                  "--set", "train.export_hf=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Its Hugging Face export is missing (an earlier export failed): exporting it now" in again.stdout
    assert (out / "hf_model" / "model.safetensors").is_file() and not (out / "hf_model.partial").exists()
    AutoModelForCausalLM.from_pretrained(out / "hf_model")


def test_a_corpus_rewritten_with_the_same_size_and_mtime_is_tokenized_again(tmp_path, bpe_tokenizer):
    """The token cache is keyed on content. Negative control: the file's size and mtime, the old key, are equal."""
    import numpy as np

    from ulysses_train.data.corpus import build_packed_dataset
    from ulysses_train.data.sources import corpus_identity

    corpus = write_corpus(tmp_path / "corpus", count=3, words=50)
    _, summary = build_packed_dataset(corpus, bpe_tokenizer, 64, cache_dir=tmp_path / "cache")
    _, again = build_packed_dataset(corpus, bpe_tokenizer, 64, cache_dir=tmp_path / "cache")
    assert again.reused   # unchanged: reused (through the digest memo)
    old_key = corpus_identity(corpus)
    rewrite_keeping_size_and_mtime(corpus / "doc01.txt")
    assert corpus_identity(corpus) == old_key
    dataset, after = build_packed_dataset(corpus, bpe_tokenizer, 64, cache_dir=tmp_path / "cache")
    assert not after.reused and after.cache_path != summary.cache_path
    want = []
    for name in sorted(os.listdir(corpus)):
        want += bpe_tokenizer((corpus / name).read_text(), add_special_tokens=False)["input_ids"] + [1]
    ids = np.concatenate([row["input_ids"][row["labels"] != -100] for row in dataset])   # padding removed
    assert ids.tolist() == want


def test_an_export_that_fails_on_a_full_disk_is_one_line_and_leaves_nothing_partial(tmp_path, monkeypatch):
    """safetensors failing mid-write (a full disk) ended in its traceback with hf_model.partial/ left behind; now
    CheckpointError names the cause and the way back (--resume exports what a finished run is missing: the scenario
    above), and the partial folder is gone. Control: the same export on a disk with room writes the folder."""
    import errno

    import torch
    from transformers import Qwen3ForCausalLM

    from helpers import tiny_qwen3_config
    from ulysses_train.training import export
    from ulysses_train.training.checkpoint import CheckpointError

    model = Qwen3ForCausalLM(tiny_qwen3_config())

    class Engine:
        def _zero3_consolidated_16bit_state_dict(self):
            return {"causal_lm." + k: v for k, v in model.state_dict().items()}

    real = Qwen3ForCausalLM.save_pretrained

    def full_disk(self, folder, **kwargs):
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "model.safetensors"), "w").write("cut")
        raise OSError(errno.ENOSPC, "No space left on device")

    staged = export.staging_dir(str(tmp_path / "hf_model"))
    monkeypatch.setattr(Qwen3ForCausalLM, "save_pretrained", full_disk)
    try:
        export.export_hf_model(Engine(), model, staged, rank=0)
        raise AssertionError("the export did not fail")
    except CheckpointError as err:
        assert str(err).startswith("could not export the Hugging Face model: no space left on the device of ")
        assert "rerun with --resume" in str(err)
    assert not os.path.exists(staged)
    monkeypatch.setattr(Qwen3ForCausalLM, "save_pretrained", real)
    export.export_hf_model(Engine(), model, staged, rank=0)
    assert torch.equal(Qwen3ForCausalLM.from_pretrained(staged).lm_head.weight, model.lm_head.weight)
