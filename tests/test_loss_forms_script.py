"""benchmarks/loss_forms.py on CPU: the three loss forms agree with an independent fp32 reference, and the
script counts the lm_head products each form runs (what makes the fused form cheaper than checkpointing)."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import loss_forms  # noqa: E402
import torch  # noqa: E402

TINY = ["--hidden", "32", "--vocab", "300", "--repeats", "1"]


def run(tmp_path, *args):
    out = tmp_path / "forms.json"
    assert loss_forms.main([*TINY, *args, "--json", str(out)]) == 0
    return {r["form"]: r for r in json.loads(out.read_text())["results"]}


def test_fp32_forms_equal_the_reference_and_products_counted(tmp_path):
    rows = run(tmp_path, "--rows", "250", "--chunk-rows", "64", "--dtype", "float32")  # 4 chunks, the last short
    assert all(r["status"] == "ok" for r in rows.values())
    for r in rows.values():
        assert r["loss_rel_err"] < 1e-6 and r["hidden_grad_rel_err"] < 1e-5 and r["weight_grad_rel_err"] < 1e-5
    # forward logits, gradient of hidden, gradient of weight; checkpointing forms each chunk's logits twice
    assert rows["full_logits"]["lm_head_products"] == 3
    assert rows["fused"]["lm_head_products"] == 3 * 4
    assert rows["checkpoint_per_chunk"]["lm_head_products"] == 4 * 4


def test_bf16_fused_weight_gradient_beats_bf16_accumulation(tmp_path):
    """Over many chunks autograd sums the checkpointed form's weight gradient in bf16; the fused form sums
    in fp32, so its error stays at one bf16 rounding of the result."""
    rows = run(tmp_path, "--rows", "1024", "--chunk-rows", "16", "--forms", "checkpoint_per_chunk,fused")
    fused, ckpt = rows["fused"], rows["checkpoint_per_chunk"]
    assert fused["weight_grad_rel_err"] < 4e-3  # ~ one bf16 rounding (2^-8 relative at most)
    assert ckpt["weight_grad_rel_err"] > 2 * fused["weight_grad_rel_err"]
    assert fused["hidden_grad_rel_err"] < 4e-3 and fused["loss_rel_err"] < 1e-3


def test_out_of_memory_is_a_row(tmp_path, monkeypatch):
    real = loss_forms.loss_and_grads

    def full_logits_too_big(form, *args):
        if form == "full_logits":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(form, *args)

    monkeypatch.setattr(loss_forms, "loss_and_grads", full_logits_too_big)
    rows = run(tmp_path, "--rows", "128", "--chunk-rows", "64", "--dtype", "float32")
    assert rows["full_logits"]["status"] == "OOM"
    assert rows["fused"]["status"] == "ok" and rows["checkpoint_per_chunk"]["status"] == "ok"
