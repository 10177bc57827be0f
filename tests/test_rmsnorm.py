"""The low-memory RMSNorm against Hugging Face's Qwen3RMSNorm: same outputs and gradients (fp32 and bf16,
one chunk and many), and what autograd keeps for backward (the point of it) measured by saved-tensor hooks."""
import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from ulysses_train.model import rmsnorm
from ulysses_train.model.rmsnorm import replace_rmsnorms


def reference_and_low_memory(width: int, dtype: torch.dtype):
    torch.manual_seed(0)
    ref = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(width))
    low = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
    low.load_state_dict(ref.state_dict())
    assert replace_rmsnorms(low) == 1
    return ref, low


def run(module, x, grad):
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(grad)
    return y.detach(), x.grad, module.weight.grad


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 1 << 24), (torch.float32, 96), (torch.bfloat16, 1 << 24),
                                         (torch.bfloat16, 96)])
def test_outputs_and_gradients_equal_hugging_face(monkeypatch, dtype, chunk):
    monkeypatch.setattr(rmsnorm, "CHUNK_ELEMENTS", chunk)  # 96 elements: 3 rows of 32 per chunk, 22 chunks
    ref, low = reference_and_low_memory(32, dtype)
    x = (3 * torch.randn(2, 33, 32)).to(dtype)
    grad = torch.randn(2, 33, 32).to(dtype)
    y_ref, gx_ref, gw_ref = run(ref, x, grad)
    y, gx, gw = run(low, x, grad)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)  # same arithmetic, bit for bit
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (gx.float() - gx_ref.float()).abs().max() <= tol * gx_ref.float().abs().max()
    assert (gw.float() - gw_ref.float()).abs().max() <= tol * gw_ref.float().abs().max()
    # negative control: a gradient without the mean term fails the comparison by far more than ours misses it
    wrong = (grad.float() * low.weight.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
    ours_err = (gx.float() - gx_ref.float()).abs().max()
    assert (wrong - gx_ref.float()).abs().max() > max(5 * ours_err, tol * gx_ref.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_leaves_its_input_untouched(monkeypatch, dtype):
    """The saved input is the caller's tensor (for fp32, `.float()` returns it as is): the backward's in-place
    arithmetic must never write to it."""
    monkeypatch.setattr(rmsnorm, "CHUNK_ELEMENTS", 96)
    _, low = reference_and_low_memory(32, dtype)
    x = torch.randn(2, 33, 32).to(dtype).requires_grad_(True)
    before = x.detach().clone()
    low(x).backward(torch.randn(2, 33, 32).to(dtype))
    assert torch.equal(x.detach(), before)


def test_per_head_norm_on_a_4d_view():
    """q_norm and k_norm normalise each head of a [batch, seq, heads, head_dim] view."""
    ref, low = reference_and_low_memory(8, torch.float32)
    x = torch.randn(1, 5, 4, 8)
    grad = torch.randn(1, 5, 4, 8)
    for a, b in zip(run(ref, x, grad), run(low, x, grad)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def saved_bytes(module, x) -> int:
    """Bytes autograd keeps for backward (distinct storages) in one forward of `module`."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


def test_keeps_only_the_bf16_input_and_one_scale_per_row():
    ref, low = reference_and_low_memory(256, torch.bfloat16)
    x = torch.randn(1, 1024, 256).to(torch.bfloat16)
    input_bytes = x.numel() * 2
    got = saved_bytes(low, x)
    assert got == input_bytes + 1024 * 4 + 256 * 2  # input, fp32 scale per row, the weight
    assert saved_bytes(ref, x) >= 3 * input_bytes  # Hugging Face: fp32 input + bf16 normalized, at least


def test_model_swap_counts_and_leaves_unknown_norms():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=50)
    model = Qwen3ForCausalLM(cfg)
    assert replace_rmsnorms(model) == 2 * 4 + 1  # per layer: input, post-attention, q, k; final norm

    class GemmaLikeRMSNorm(torch.nn.Module):
        def forward(self, x):
            return x

    assert replace_rmsnorms(torch.nn.Sequential(GemmaLikeRMSNorm())) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kernel_matches_hugging_face(dtype):
    """model.rmsnorm: torch. In fp32 the same function as Hugging Face's; in bf16 it applies the weight
    before its single cast, so outputs may differ by one bf16 rounding step, and no more."""
    torch.manual_seed(0)
    ref = Qwen3RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(32))
    fused = Qwen3RMSNorm(32, eps=1e-6).to(dtype)
    fused.load_state_dict(ref.state_dict())
    assert replace_rmsnorms(fused, kernel="torch") == 1
    x = (3 * torch.randn(2, 33, 4, 32)).to(dtype)  # a per-head [batch, seq, heads, head_dim] shape too
    grad = torch.randn(2, 33, 4, 32).to(dtype)
    y_ref, gx_ref, gw_ref = run(ref, x, grad)
    y, gx, gw = run(fused, x, grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        assert got.dtype == want.dtype
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    # negative control: without the weight the outputs are far off
    unweighted = torch.nn.functional.rms_norm(x, (32,), None, 1e-6)
    assert (unweighted.float() - y_ref.float()).abs().max() > 10 * tol * y_ref.float().abs().max()


def test_the_built_model_uses_the_configured_kernel_and_shows_it():
    from ulysses_train.config import Config, ConfigError, ModelConfig
    from ulysses_train.model.loading import build_causal_lm
    from ulysses_train.model.presets import qwen3_config
    from ulysses_train.model.swap import stock_class
    from ulysses_train.model.transform import apply_memory_levers

    config = qwen3_config("qwen3-0.6b", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64)
    for kernel, forward, name in (("chunked", rmsnorm._forward, "ChunkedQwen3RMSNorm"),
                                  ("torch", rmsnorm._torch_forward, "FusedQwen3RMSNorm")):
        model_cfg = ModelConfig(random_init=True, dtype="float32", rmsnorm=kernel)
        model, _ = build_causal_lm(config, model_cfg, "sdpa", None)
        apply_memory_levers(model, model_cfg, None)
        norms = [m for m in model.modules() if stock_class(m).__name__ == "Qwen3RMSNorm"]
        assert len(norms) == 9 and all(type(m).forward is forward and type(m).__name__ == name for m in norms)
        assert f"{name}((32,)" in str(model) or f"{name}(" in str(model)  # print(model) shows the change
    model_cfg = ModelConfig(random_init=True, dtype="float32", rmsnorm="hf")
    model, _ = build_causal_lm(config, model_cfg, "sdpa", None)
    apply_memory_levers(model, model_cfg, None)
    assert sum(type(m).__name__ == "Qwen3RMSNorm" for m in model.modules()) == 9  # Hugging Face's, untouched
    with pytest.raises(ConfigError, match="model.rmsnorm='triton' is not valid; choose one of torch, chunked, hf"):
        Config(model=ModelConfig(rmsnorm="triton"))


def offset_reference(x, weight, eps):
    """Qwen3.5's (1 + w) RMSNorm written out by hand: fp32 throughout, one cast at the end."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.float())).to(x.dtype)


class LigerStandIn(torch.autograd.Function):
    """Liger's RMSNormFunction's signature on CPU (Liger's kernels need a GPU): records each call's arguments and
    computes offset_reference, honouring the offset it was given (so a call with the wrong offset changes outputs)."""
    calls = []

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place):
        LigerStandIn.calls.append((eps, offset, casting_mode, in_place))
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.offset = eps, offset
        return offset_reference(x, weight + (offset - 1.0), eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = offset_reference(x, weight + (ctx.offset - 1.0), ctx.eps)
            gx, gw = torch.autograd.grad(out, (x, weight), grad)
        return gx, gw, None, None, None, None


def test_offset_norms_run_as_liger_where_it_runs(monkeypatch):
    """Qwen3.5's (1 + w) norms: with Liger available they are swapped for Liger's kernel called with offset 1,
    `gemma` casting and not in place, and the step's outputs and gradients are Hugging Face's; without it (no
    CUDA here, or `chunked`) they stay Hugging Face's modules. Negative control: offset 0 changes the outputs."""
    from tests.helpers import tiny_family_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.architecture import OFFSET_RMSNORMS

    torch.manual_seed(0)
    config = tiny_family_config("qwen3_5_text", layer_types=["linear_attention", "full_attention"],
                                num_hidden_layers=2)
    plain = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for module in plain.modules():
            if type(module).__name__ in OFFSET_RMSNORMS:
                module.weight.normal_(0, 0.3)
    ids = torch.randint(0, config.vocab_size, (1, 12))
    norms = sum(type(m).__name__ in OFFSET_RMSNORMS for m in plain.modules())
    assert norms == 2 * 2 + 2 + 1  # input and post-attention per layer, q and k of the attention layer, final
    assert replace_rmsnorms(plain, "torch") == 0  # no CUDA here: left as they are

    ours = AutoModelForCausalLM.from_config(config).float()
    ours.load_state_dict(plain.state_dict())
    monkeypatch.setattr(rmsnorm, "offset_norm_kernel_runs", lambda: True)
    monkeypatch.setattr(rmsnorm, "liger_rms_norm_function", lambda: LigerStandIn)
    assert replace_rmsnorms(ours, "chunked") == 0  # chunked promises bit-equal outputs: not Liger's
    assert replace_rmsnorms(ours, "torch") == norms
    assert all(type(m).__name__.startswith("Liger") for m in ours.modules() if type(m).__name__.endswith("RMSNorm"))
    LigerStandIn.calls.clear()
    ours(ids, labels=ids).loss.backward()
    loss = plain(ids, labels=ids).loss
    loss.backward()
    assert set(LigerStandIn.calls) == {(1e-6, 1.0, "gemma", False)} and len(LigerStandIn.calls) == norms
    mine = dict(ours.named_parameters())
    for name, param in plain.named_parameters():
        torch.testing.assert_close(mine[name].grad, param.grad, rtol=1e-5, atol=1e-6, msg=name)

    wrong = lambda self, x: LigerStandIn.apply(x, self.weight, self.eps, 0.0, "gemma", False)  # noqa: E731
    for module in ours.modules():
        if type(module).__name__.startswith("Liger"):
            type(module).forward = wrong
    assert (ours(ids, labels=ids).loss - loss).abs() > 1e-3


def norm_classes() -> dict:
    """{name: class} of every RMSNorm class a family record's transformers modeling module defines, and Llama's and
    Gemma's (the reference and the control)."""
    import importlib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ulysses_train.families import FAMILIES

    classes = {}
    for model_type in (*(t for family in FAMILIES for t in family.model_types), "llama", "gemma"):
        module = importlib.import_module(CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_"))
        classes.update({name: cls for name, cls in vars(module).items()
                        if name.endswith("RMSNorm") and isinstance(cls, type) and cls.__module__ == module.__name__})
    return classes


def test_the_llama_style_norms_are_exactly_the_families_norms_with_llamas_forward():
    """The kernels replace exactly the norms whose forward is LlamaRMSNorm's line for line, and every recorded
    family's such norm is listed, so `model.rmsnorm: torch` reaches it (DeepSeek-V3's, MiniMax-M2's, GLM-4.5's and
    EXAONE 4's were left as Hugging Face's); a family added later joins the list or fails here. Control: Gemma's
    (1 + w) norm reads differently, and is not in the list."""
    import inspect

    from ulysses_train.model.architecture import LLAMA_STYLE_RMSNORMS

    classes = norm_classes()
    llama = inspect.getsource(classes["LlamaRMSNorm"].forward)
    llama_style = {name for name, cls in classes.items() if inspect.getsource(cls.forward) == llama}
    assert set(LLAMA_STYLE_RMSNORMS) == llama_style
    assert "GemmaRMSNorm" in classes and "GemmaRMSNorm" not in llama_style
