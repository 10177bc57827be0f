"""scripts/bench.py end to end on CPU (gloo), the multi-process path the GPU stages of benchmarks/multi_gpu.sh use:
2 processes, sp=2, a tiny shape; one warm timed step and the all-to-all share from DeepSpeed's comms logger."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def test_bench_two_processes_sp2_with_all_to_all_share(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "scripts", "bench.py"), "--model", "qwen3-0.6b",
           "--shape-overrides", json.dumps(TINY), "--lengths", "256", "--levers", "chunked", "--sp", "2",
           "--nproc", "2", "--steps", "1", "--comm-share", "--json", str(out)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok", row["status"]
    assert row["sp"] == 2 and row["s_per_step"] > 0 and row["tokens_per_s"] > 0
    # 2 layers x 4 exchanges (q, k, v out; attention output back) in forward, again in the checkpoint's
    # recompute, and once more in backward (the exchange's gradient is an all-to-all too)
    assert row["all_to_all_calls"] == 2 * 4 * 3
    assert 0 < row["all_to_all_s"] and 0 < row["all_to_all_share"] < 1
    assert "all-to-all" in proc.stdout
