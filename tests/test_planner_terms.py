"""Planner terms checked by hand and against what the libraries do when the term was added: a latent mixture of
experts' routed copies (transformers' Nemotron 3 Super block, saved-tensor hooks) and a host AdamW step's
temporaries (torch's own step, the process's peak measured)."""
import dataclasses
import os

from ulysses_train.planner import ModelShape, PlanOptions, load_model_shape


def test_latent_experts_route_latent_wide_copies_by_hand():
    """Nemotron 3 Super's latent experts (`moe_latent_size`, ModelShape.expert_width): a token's k routed copies and
    the experts' outputs are latent-wide: 2kbL + 4E bytes per token, against 2kbH + 4E for the same block without the
    latent (the control). Against transformers' own block (saved-tensor hooks on the two tiny blocks, CPU's eager
    experts): the latent one saves latent-wide bytes within the plain one's hidden-wide bytes narrowed to the latent."""
    import torch
    from helpers import tiny_family_config
    from test_mamba2_families import MAMBA2_FAMILIES
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    from ulysses_train.planner.layer import routed_copies_per_token

    config = tiny_family_config("nemotron_h", **MAMBA2_FAMILIES["nemotron_h-super"])
    latent = ModelShape.from_hf_config(config)
    h, width, k, experts = latent.hidden, latent.expert_width, latent.experts_per_token, latent.experts
    assert (h, width, k, experts) == (64, 16, 2, 4)
    o = PlanOptions(seq_length=1024)
    assert routed_copies_per_token(latent, o) == 2 * k * 2 * width + 4 * experts
    assert routed_copies_per_token(dataclasses.replace(latent, expert_width=0), o) == 2 * k * 2 * h + 4 * experts

    def wide_saved_per_token(block_config, wide: int) -> float:
        """Bytes per token of the bf16 tensors `wide` channels wide the block saves for backward, beyond its input
        (counted with the norm) and its weights."""
        torch.manual_seed(0)
        block, x = NemotronHMoE(block_config).to(torch.bfloat16), torch.randn(1, 256, h, dtype=torch.bfloat16)
        skip, seen = {p.untyped_storage().data_ptr() for p in [*block.parameters(), x]}, {}

        def keep(t):
            if t.untyped_storage().data_ptr() not in skip and t.dtype == torch.bfloat16 and t.shape[-1] == wide:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            block(x.requires_grad_())
        return sum(seen.values()) / 256

    plain = tiny_family_config("nemotron_h", **{**MAMBA2_FAMILIES["nemotron_h-super"], "moe_latent_size": None})
    hidden_wide, latent_wide = wide_saved_per_token(plain, h), wide_saved_per_token(config, width)
    assert hidden_wide >= 2 * k * 2 * h  # at least the k copies in and out
    assert 0 < latent_wide <= hidden_wide * width / h  # 5 latent-wide tensors a token against 6 hidden-wide


ADAM_STEP = """
import sys, torch
n = int(sys.argv[1])
p = torch.nn.Parameter(torch.zeros(n)); p.grad = torch.ones(n)
opt = torch.optim.AdamW([p], lr=1e-3)
opt.step()  # its m and v now exist


def status(key):  # bytes
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key))) * 1024


try:
    with open("/proc/self/clear_refs", "w") as reset:  # the peak (VmHWM) starts again from now
        reset.write("5")
except OSError:  # a kernel without the reset: the peak since start, as the step's own is no lower
    pass
resident = status("VmRSS:")
opt.step()
print(status("VmHWM:") - resident)
"""


def test_a_host_adam_steps_temporaries_are_planned_as_measured():
    """With the optimizer on the host, torch's AdamW step (ds_configs' `torch_adam`) holds two fp32 copies of the
    sub-group it updates: 8 bytes x min(this rank's parameters, sub_group_size) beside the states. Measured: one
    AdamW step of a 32M-element CPU tensor raises the process's peak 8 bytes an element above what it held just before
    (a subprocess, its peak reset before the step: the peak since start would count library pages the kernel may
    drop later under another process's load, as it seemingly did once in a CI run: 25 bytes an element). Controls:
    DeepSpeed's cpu_adam (torch_adam false) and states on the GPU plan none."""
    import subprocess
    import sys

    from ulysses_train.planner.estimate import _per_rank, optimizer_states
    from ulysses_train.planner.options import deepspeed_torch_adam

    n = 32 * 2**20
    peak = int(subprocess.run([sys.executable, "-c", ADAM_STEP, str(n)], capture_output=True, text=True,
                              check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout)
    assert abs(peak - 8 * n) < 0.1 * 8 * n, peak / n
    m = load_model_shape("qwen3-8b")
    host = PlanOptions(seq_length=65536, sp=8, offload_optimizer=True)
    temporaries = {c.name: c.host for c in optimizer_states(m, host)}["optimizer step's temporaries"]
    assert temporaries == 8 * min(_per_rank(m, host), host.sub_group_size) > 0
    assert len(optimizer_states(m, dataclasses.replace(host, torch_adam=False))) == 1
    assert len(optimizer_states(m, dataclasses.replace(host, offload_optimizer=False))) == 1
    assert deepspeed_torch_adam({"optimizer": {"params": {"torch_adam": True}}})
    assert not deepspeed_torch_adam({"optimizer": {"type": "AdamW"}}) and not deepspeed_torch_adam({})


def test_each_families_hyper_connection_saves_are_measured_on_its_own_module():
    """What a hyper-connection saves for backward beyond its input streams (ModelShape.hc_saved) is read off the
    family's own module, each saved storage once, and agrees with its forward read by hand (4 streams of 4096):
    HY-V4's is its fp32 copy of the flattened streams (4 n h, the term its GPU row was validated with:
    benchmarks/RESULTS.md "Hy4") within 2%; GLM-5.3-Flash's casts the streams to fp32 and normalizes them into a
    second fp32 copy (2 x 4 n h), and its 20 Sinkhorn iterations add n x n weights (under 8% more). Control: a model
    without streams plans none."""
    from helpers import tiny_family_config
    from test_indexed_attention import GLM5_NEXT, HY_V4

    from ulysses_train.model.architecture import causal_lm_on_meta
    from ulysses_train.planner.model_counts import hyper_connection_saved

    ratios = {}
    for family, shape in (("hy_v4", HY_V4), ("glm5_next_text", GLM5_NEXT)):
        config = tiny_family_config(family, **{**shape, "hidden_size": 4096, "hc_mult": 4})
        ratios[family] = hyper_connection_saved(causal_lm_on_meta(config).get_decoder().layers, config) / (4 * 4 * 4096)
    assert 1.0 <= ratios["hy_v4"] < 1.02 and 2.0 <= ratios["glm5_next_text"] < 2.16, ratios
    plain = tiny_family_config("glm_moe_dsa")
    assert hyper_connection_saved(causal_lm_on_meta(plain).get_decoder().layers, plain) == 0
