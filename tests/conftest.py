"""Shared fixtures. Nothing can be downloaded here, so the tokenizer is trained locally."""
import os
import random
import tempfile

import pytest

# Runs that keep the default data cache write it here, not into the user's ~/.cache (the trainer and
# prepare_data.py read the variable; subprocesses inherit it).
os.environ["ULYSSES_TRAIN_DATA_CACHE"] = tempfile.mkdtemp(prefix="ulysses_train-test-cache-")
# Nothing here may reach the model hub: a test that tried would wait for network timeouts (and could pass or fail by
# the network). Set before huggingface_hub is imported, which reads it once; subprocesses inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def generated_words(seed: int = 0, count: int = 3000) -> list[str]:
    """A fixed pseudo-vocabulary of lowercase words, the material for generated documents."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, 10))) for _ in range(count)]


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """A byte-level BPE (vocab 1000) trained in ~0.1 s, wrapped as a transformers fast tokenizer
    with ``<eos>`` (id 1) and ``<pad>`` (id 2). Byte-level: any text, emoji included, encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    words = generated_words()
    texts = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(300)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<unk>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture
def clean_env(monkeypatch):
    """This process's environment without launcher or SLURM variables (the suite may itself run in a SLURM job)."""
    from slurm_helpers import LAUNCH_VARS

    for key in list(os.environ):
        if key.startswith("SLURM_") or key in LAUNCH_VARS:
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture
def fake_bin(tmp_path):
    """tests/fake_bin (scontrol, ssh, pdsh, srun) copied with the exec bit set, and a log of their calls."""
    import shutil

    from slurm_helpers import FAKE_BIN

    path = tmp_path / "fake_bin"
    shutil.copytree(FAKE_BIN, path)
    for name in os.listdir(path):
        os.chmod(path / name, 0o755)
    return str(path)


PROBE_CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"


@pytest.fixture(scope="module")
def probe_model_dir(tmp_path_factory, bpe_tokenizer):
    """A tiny random Qwen3 over the test BPE vocabulary, saved with that tokenizer (and a chat template): the
    retrieval probes' model (test_retrieval_probes.py, test_probe_stops.py)."""
    import copy

    from helpers import save_tiny_model

    path = save_tiny_model(str(tmp_path_factory.mktemp("probe_models") / "tiny"), vocab_size=1000)
    tokenizer = copy.deepcopy(bpe_tokenizer)  # the session's tokenizer stays as it is
    tokenizer.chat_template = PROBE_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


STALE_BUFFER_SECONDS = 60
"""A shared buffer of DeepSpeed's CPU all-reduce this old and mapped by no process belongs to a group that ended."""


def remove_stale_shared_buffers() -> int:
    """Unlink DeepSpeed's CPU all-reduce buffers (/dev/shm/deepspeed_allreduce_buffer_<uid>_<address>_<port>_<rank>,
    69 MB a rank) that no live process maps and that are older than STALE_BUFFER_SECONDS: ranks stopped by a signal
    (tests/test_train_stops.py) leave theirs, and over a machine's runs they filled its memory until a test was
    killed for it. A running group maps its buffers from the moment it makes them, so none of it is touched (the age
    covers the instant between making a file and mapping it). Returns how many were removed."""
    import glob
    import time

    buffers = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*")
    if not buffers:
        return 0
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as fh:
                mapped.update(line.split(None, 5)[-1].strip() for line in fh if "deepspeed_allreduce_buffer" in line)
        except OSError:  # a process that ended while listing, or one not ours to read
            pass
    removed = 0
    for path in buffers:
        try:
            if path not in mapped and time.time() - os.path.getmtime(path) > STALE_BUFFER_SECONDS:
                os.unlink(path)
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def pytest_sessionfinish(session, exitstatus):
    remove_stale_shared_buffers()
