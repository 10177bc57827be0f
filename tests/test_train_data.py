"""scripts/train.py on real data, on CPU: a text corpus with a local tokenizer, chat sessions packed as documents
(loss on the assistant turns), and document packing refused with SDPA in one line (test_train_script.py: the
demo; test_document_packing.py: the packing itself)."""
import json
import os
import subprocess
import sys

from helpers import REPO, read_metrics
from train_runs import env, train_ranks


def test_trains_on_a_text_corpus_with_a_local_tokenizer(tmp_path, bpe_tokenizer):
    """Folder of .txt -> tokenizer -> packed, cached sequences -> 2-process sp=2 training of a local model."""
    import math
    import random

    from helpers import save_tiny_model

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    tokenizer_dir = str(tmp_path / "tokenizer")
    bpe_tokenizer.save_pretrained(tokenizer_dir)
    model_dir = save_tiny_model(str(tmp_path / "model"), vocab_size=len(bpe_tokenizer))
    config = tmp_path / "run.yaml"
    config.write_text(f"""
model: {{name_or_path: {model_dir}, dtype: float32, attn_implementation: sdpa}}
parallel: {{sequence_parallel_size: 2}}
data: {{source: {corpus}, tokenizer: {tokenizer_dir}, seq_length: 256, num_proc: 1}}
train: {{steps: 3, output_dir: {tmp_path / 'out'}, export_hf: false}}
""")
    shared = dict(env(), ULYSSES_TRAIN_DATA_CACHE=str(tmp_path / "shared_cache"))
    proc = train_ranks(2, "--config", str(config), run_env=shared)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(str(tmp_path / "out"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert abs(records[0]["loss"] - math.log(len(bpe_tokenizer))) < 1.5  # a random model is near ln(vocab)
    assert records[0]["num_tokens"] == 255  # one 256-token sequence per step: 255 labels
    cache_line = [line for line in proc.stdout.splitlines() if line.strip().startswith("cache ")]
    assert cache_line and str(tmp_path / "shared_cache") in cache_line[0]  # the default location, printed
    # prepare_data.py with the same options finds the trainer's cache in the same default place
    prepare = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_data.py"), "--source", str(corpus),
                              "--tokenizer", tokenizer_dir, "--seq-length", "256", "--pad-multiple", "2"],
                             env=shared, capture_output=True, text=True, timeout=300)
    assert prepare.returncode == 0 and "(reused)" in prepare.stdout, prepare.stdout + prepare.stderr[-2000:]


def test_trains_on_chat_sessions_packed_as_documents(tmp_path, bpe_tokenizer):
    """JSONL of sessions -> chat template -> assistant-only labels, whole sessions per sequence -> 2-process
    sp=2 training with FlashAttention 4's variable-length op (its CPU reference kernel). The step's label count
    is the packed row's, less each document's last label (it would cross into the next document)."""
    from helpers import save_tiny_model
    from test_document_packing import write_sessions
    from chat_sessions import QWEN3, chat_tokenizer

    tokenizer = chat_tokenizer(bpe_tokenizer, QWEN3)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    model_dir = save_tiny_model(str(tmp_path / "model"), vocab_size=len(tokenizer))
    source = write_sessions(tmp_path / "sessions.jsonl")
    config = tmp_path / "run.yaml"
    config.write_text(f"""
model: {{name_or_path: {model_dir}, dtype: float32, attn_implementation: fa4}}
parallel: {{sequence_parallel_size: 2}}
data: {{source: {source}, tokenizer: {tmp_path / 'tokenizer'}, format: chat, packing: documents, seq_length: 512,
       num_proc: 1, cache_dir: {tmp_path / 'cache'}}}
train: {{steps: 2, output_dir: {tmp_path / 'out'}}}
""")
    proc = train_ranks(2, "--config", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "whole documents per sequence" in proc.stdout and "without an assistant turn, skipped" in proc.stdout
    # the export is a complete Hugging Face folder: the run's tokenizer (chat template included) and the model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoTokenizer.from_pretrained(tmp_path / "out" / "hf_model")
    assert exported.get_vocab() == tokenizer.get_vocab() and exported.chat_template == QWEN3
    prompt = exported.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf_model")
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4
    records = read_metrics(str(tmp_path / "out"))
    assert [r["step"] for r in records] == [1, 2]
    from datasets import Dataset

    rows = [row for path in sorted((tmp_path / "cache").glob("packed-*/*.arrow")) for row in Dataset.from_file(str(path))]
    counts = {sum(1 for label in row["labels"] if label != -100) for row in rows}
    assert all(r["num_tokens"] in counts for r in records), (records, counts)


def test_document_packing_with_sdpa_is_one_line(tmp_path, bpe_tokenizer, capsys):
    from helpers import save_tiny_model
    from helpers import one_error_line

    bpe_tokenizer.save_pretrained(tmp_path / "tokenizer")
    source = tmp_path / "t.jsonl"
    source.write_text(json.dumps({"text": "hello world"}) + "\n")
    model_dir = save_tiny_model(str(tmp_path / "model"), vocab_size=len(bpe_tokenizer))
    capsys.readouterr()
    line = one_error_line(["--set", f"model.name_or_path={model_dir}", "--set", "model.attn_implementation=sdpa",
                           "--set", "parallel.sequence_parallel_size=1",
                           "--set", f"data.source={source}", "--set", f"data.tokenizer={tmp_path / 'tokenizer'}",
                           "--set", "data.packing=documents", "--set", f"train.output_dir={tmp_path / 'out'}",
                           "--set", f"data.cache_dir={tmp_path / 'cache'}"], capsys)
    assert "data.packing=documents needs variable-length attention" in line and "fa4" in line
