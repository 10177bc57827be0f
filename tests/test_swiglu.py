"""SwiGLU MLPs as Liger's SiLU-and-multiply kernel (model/swiglu.py), checked on CPU with a stand-in of Liger's
autograd function (its kernels need a GPU; the GPU run is benchmarks/gpu_equality.py), and the planner's terms for
it against hand-counted bytes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from helpers import tiny_family_config
from ulysses_train.model import swiglu
from ulysses_train.model.swiglu import replace_swiglu_mlps
from ulysses_train.model.tiling import apply_tiled_mlp
from ulysses_train.planner import PlanOptions, load_model_shape
from ulysses_train.planner.layer import mlp_backward_extra_per_token, mlp_saved_per_token


class SiLUMulStandIn(torch.autograd.Function):
    """Liger's `LigerSiLUMulFunction(a, b)` on CPU: `silu(a) * b`, saving a and b only (as Liger does), counting
    calls. `activation` lets the negative control plant a wrong activation."""
    calls = 0
    activation = staticmethod(F.silu)

    @staticmethod
    def forward(ctx, a, b):
        SiLUMulStandIn.calls += 1
        ctx.save_for_backward(a, b)
        return SiLUMulStandIn.activation(a) * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        with torch.enable_grad():
            a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
            return torch.autograd.grad(SiLUMulStandIn.activation(a) * b, (a, b), grad)


def _pair(model_type: str, **overrides):
    torch.manual_seed(0)
    config = tiny_family_config(model_type, **overrides)
    plain = AutoModelForCausalLM.from_config(config).float()
    ours = AutoModelForCausalLM.from_config(config).float()
    ours.load_state_dict(plain.state_dict())
    return config, plain, ours


def _grads_equal(plain, ours, ids):
    loss = plain(ids, labels=ids).loss
    loss.backward()
    mine_loss = ours(ids, labels=ids).loss
    mine_loss.backward()
    torch.testing.assert_close(mine_loss, loss)
    mine = dict(ours.named_parameters())
    for name, param in plain.named_parameters():
        torch.testing.assert_close(mine[name].grad, param.grad, rtol=1e-5, atol=1e-6, msg=name)
    return loss


def test_swiglu_mlps_run_liger_kernel_where_it_runs(monkeypatch):
    """Every decoder layer's MLP (Qwen3.5: Gated DeltaNet and attention layers alike) becomes `Liger<MLP>`, calls
    the kernel once per forward, and the step's loss and gradients are Hugging Face's; without CUDA (here) nothing
    is swapped. Negative control: a wrong activation in the kernel changes the loss."""
    config, plain, ours = _pair("qwen3_5_text", layer_types=["linear_attention", "full_attention"],
                                num_hidden_layers=2)
    assert replace_swiglu_mlps(ours) == 0  # no CUDA here
    monkeypatch.setattr(swiglu, "swiglu_kernel_runs", lambda: True)
    monkeypatch.setattr(swiglu, "liger_silu_mul_function", lambda: SiLUMulStandIn)
    assert replace_swiglu_mlps(ours) == 2
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["LigerQwen3_5MLP"] * 2
    ids = torch.randint(0, config.vocab_size, (1, 12))
    SiLUMulStandIn.calls = 0
    loss = _grads_equal(plain, ours, ids)
    assert SiLUMulStandIn.calls == 2

    monkeypatch.setattr(SiLUMulStandIn, "activation", staticmethod(F.gelu))
    assert (ours(ids, labels=ids).loss - loss).abs() > 1e-4


def test_tiled_mlp_tiles_call_the_liger_kernel(monkeypatch):
    """TiledMLP after the swap: each tile calls Liger's kernel (TiledMLP calls the class the MLP had before its
    own swap), forward and again in backward, and gradients are Hugging Face's. Negative control: a model whose
    activation is not SiLU is left alone."""
    config, plain, ours = _pair("qwen3", num_hidden_layers=2)
    monkeypatch.setattr(swiglu, "swiglu_kernel_runs", lambda: True)
    monkeypatch.setattr(swiglu, "liger_silu_mul_function", lambda: SiLUMulStandIn)
    assert replace_swiglu_mlps(ours) == 2
    schedule = apply_tiled_mlp(ours, "true")
    assert type(ours.model.layers[0].mlp).__name__ == "TiledLigerQwen3MLP"
    ids = torch.randint(0, config.vocab_size, (1, 3 * config.hidden_size))  # TiledMLP: ceil(s / hidden) tiles
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    SiLUMulStandIn.calls = 0
    _grads_equal(plain, ours, ids)
    tiles = schedule.num_tiles
    assert tiles > 1 and SiLUMulStandIn.calls >= 2 * 2 * tiles  # 2 layers, forward and backward, every tile

    _, _, gelu = _pair("qwen3", num_hidden_layers=2, hidden_act="gelu")
    assert replace_swiglu_mlps(gelu) == 0


def test_planner_counts_the_kernels_saved_tensors():
    """Hand-counted at Qwen3.5-9B's width (intermediate 12,288, bf16): Hugging Face's MLP saves 4 s x
    intermediate tensors (98,304 bytes per token) and adds 2 in backward; Liger's kernel saves 3 (73,728) and adds
    1 (24,576). A mixture of experts' routed experts are not swapped: its terms ignore the option."""
    shape = load_model_shape("qwen3.5-9b")
    assert shape.intermediate == 12288 and not shape.experts
    hf = PlanOptions(seq_length=131072, gpus_per_node=1)
    liger = hf.replace(swiglu_kernel=True)
    assert (mlp_saved_per_token(shape, hf), mlp_backward_extra_per_token(shape, hf)) == (98304, 49152)
    assert (mlp_saved_per_token(shape, liger), mlp_backward_extra_per_token(shape, liger)) == (73728, 24576)
    moe = load_model_shape("qwen3.5-35b-a3b")
    assert moe.experts and mlp_saved_per_token(moe, hf) == mlp_saved_per_token(moe, hf.replace(swiglu_kernel=True))
