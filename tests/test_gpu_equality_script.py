"""benchmarks/gpu_equality.py (the bf16 gradient check on GPUs) runs on CPU too: sp=2 over gloo must pass its
criterion against the plain fp32 model, and the negative control (no all-to-all) must fail it."""
import json
import os

import pytest

from helpers import REPO, launch_ranks


BISECT_OPTIONS = ["--set", "rmsnorm=hf", "--set", "tiled_mlp=true", "--zero", "overlap_comm=false",
                  "--loss", "nll", "--torch-sdpa-order"]
ALL_LEVERS = ["--set", "keep_attention_fraction=1.0", "--set", "tiled_mlp=true", "--offload-activations"]
TORCH_NORM = ["--set", "rmsnorm=torch"]


@pytest.mark.parametrize("control,options", [(False, []), (True, []), (False, BISECT_OPTIONS), (False, ALL_LEVERS),
                                             (False, TORCH_NORM)],
                         ids=["sp2", "control", "bisect-options", "all-levers", "torch-rmsnorm"])
def test_gpu_equality_script_on_cpu(tmp_path, control, options):
    """The bisect options (used to find the bf16 RoPE trap on the H200) reach the run and change no result."""
    out = tmp_path / "report.json"
    cmd = [os.path.join(REPO, "benchmarks", "gpu_equality.py"), "--model", "tiny", "--length", "64", "--sp", "2",
           "--workdir", str(tmp_path / "work"), "--json", str(out)] + (["--control"] if control else []) + options
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = launch_ranks(2, cmd, env, 600)  # torchrun's variables, forked from the rank server (helpers)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] is (not control)
    assert report["set"] == options[1:4:2] and report["loss_type"] == ("nll" if "--loss" in options else "chunked")
    assert report["offload_activations"] is ("--offload-activations" in options)
    weights = report["loaded_weights_max_diff"]
    assert len(weights) == len(report["params"]) and all(d == 0.0 for d in weights.values())
    worst = max(r["sp_rel_err"] for r in report["params"])
    if control:
        assert worst > 1e-2 and len(report["failures"]) > len(report["params"]) // 2
    else:
        assert worst < 1e-5  # fp32 on CPU: the exact path
        assert abs(report["loss"]["sp"] - report["loss"]["fp32"]) < 1e-5
