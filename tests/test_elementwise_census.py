"""benchmarks/elementwise_census.py: the fixed / per-token split solved by hand, and one op's bytes on a tiny
model checked against what TiledMLP with checkpointing must do (the census is the plan for the MFU work)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from elementwise_census import op_kind, predict_bytes, split_costs  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 512}


def test_split_recovers_fixed_and_per_token_terms():
    # an op moving 1000 + 7 T bytes per step and 50 + 3 T per layer
    def moved(layers, tokens):
        return {"op": {"calls": layers, "bytes": 1000 + 7 * tokens + layers * (50 + 3 * tokens)}}

    runs = {(layers, t): moved(layers, t) for layers in (1, 2) for t in (100, 200)}
    c = split_costs(runs, 100, 200)["op"]
    assert (c["step_fixed"], c["step_per_token"], c["layer_fixed"], c["layer_per_token"]) == (1000, 7, 50, 3)
    assert predict_bytes({"op": c}, layers=12, tokens=1000) == 1000 + 7000 + 12 * (50 + 3000)


def test_op_kinds():
    assert op_kind("mm") == "matmul" and op_kind("view") == "view"
    assert op_kind("_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_kind("mul") == "elementwise" and op_kind("_to_copy") == "elementwise"


def test_census_counts_the_mlp_activation_by_hand(tmp_path):
    """SiLU over the gate projection (tokens x intermediate, bf16 in and out: 4 x 128 bytes per token) runs
    three times per layer: TiledMLP's forward, the checkpoint's recompute, and TiledMLP's backward, which
    runs its tile forward once more; nothing of it is per step. Its backward runs once. --ablate attributes
    bytes to a part by removing it."""
    out = tmp_path / "census.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "elementwise_census.py"), "--model",
                           "qwen3-0.6b", "--shape-overrides", json.dumps(TINY), "--tokens", "64", "--json", str(out),
                           "--ablate", "mlp_activation,norms"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ops = report["ops"]
    silu = ops["silu"]
    assert silu["calls_per_layer_t1"] == 3
    assert abs(silu["layer_per_token"] - 3 * 4 * 128) < 1e-6 and abs(silu["layer_fixed"]) < 1e-6
    assert abs(silu["step_per_token"]) < 1e-6 and abs(silu["step_fixed"]) < 1e-6
    assert "predicted elementwise time" in proc.stdout
    # removing the activation removes exactly its forward and backward bytes, and nothing else
    tokens, layers = report["predict"]["tokens"], report["predict"]["layers"]

    def predicted(name):
        c = ops[name]
        return c["step_fixed"] + c["step_per_token"] * tokens + layers * (c["layer_fixed"] + c["layer_per_token"] * tokens)

    assert report["parts"]["mlp_activation"]["bytes"] == predicted("silu") + predicted("silu_backward")
    # the norms are the largest part on this shape too (and no ablation can remove more than everything)
    assert 0.3 < report["parts"]["norms"]["share"] < 1
