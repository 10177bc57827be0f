"""The FlashAttention 4 attention ('fa4', ulysses_train/model/fa4.py) on CPU: its ops' reference kernels against
autograd through math attention, a model built with it against the same model on SDPA (loss and gradients),
kept attention saving its output, and the choice of kernel. The CUDA kernels are checked on the GPU
(benchmarks/probe_attention.py --fa4, benchmarks/gpu_equality.py --set attn_implementation=fa4); the test
at the end runs only where FlashAttention 4 and a Hopper GPU are present."""

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error, tiny_qwen3_config
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_train.config import ConfigError
from ulysses_train.model import fa4
from ulysses_train.model.loading import enable_gradient_checkpointing, resolve_attn_implementation
from ulysses_train.model.recompute import apply_checkpoint_levers

FA4_OP = torch.ops.ulysses_train.fa4_forward.default
LAYERS = 3


def qkv(batch=2, tokens=37, heads=4, kv_heads=2, dim=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, tokens, n, dim, generator=gen, dtype=dtype, requires_grad=True)
            for n in (heads, kv_heads, kv_heads)]


def math_attention(q, k, v, scale, causal):
    """Plain SDPA on the math path, (batch, tokens, heads, dim) layout: the independent reference."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                                         is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernels_equal_autograd_through_math_attention(causal):
    q, k, v = qkv()
    grad = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    out, lse = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, causal, None, 0)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected_out = math_attention(q, k, v, 0.3, causal)
    expected = torch.autograd.grad(expected_out, (q, k, v), grad)
    assert (out - expected_out).abs().max() < 1e-5  # the reference kernels compute in fp32
    for name, a, b in zip("qkv", got, expected):
        assert relative_error(a, b) < 1e-5, name
    # log-sum-exp (batch, heads, tokens) of token 0, head 0: causal, it sees key 0 alone (KV head 0)
    if causal:
        score = 0.3 * (q[:, 0, 0] * k[:, 0, 0]).sum(-1)
        assert torch.allclose(lse[:, 0, 0].double(), score, atol=1e-5)
    # negative control: the other mask gives another output
    assert (out - math_attention(q, k, v, 0.3, not causal)).abs().max() > 1e-2


def test_ops_pass_torch_library_checks():
    q, k, v = (t.detach().float() for t in qkv())
    torch.library.opcheck(FA4_OP, (q, k, v, 0.25, True, None, 0))
    q, k, v = (t.detach().float() for t in qkv(batch=1))
    torch.library.opcheck(FA4_OP, (q, k, v, 0.25, True, torch.tensor([0, 10, 30, 37], dtype=torch.int32), 20))


def test_varlen_reference_equals_math_attention_run_on_each_document_alone():
    """The variable-length form (document packing): output and gradients equal plain causal attention computed
    on each document separately and concatenated. Negative control: without the document boundaries the
    output differs (tokens attend across documents)."""
    lengths = [5, 1, 17, 14]
    q, k, v = qkv(batch=1, tokens=sum(lengths))
    cu = torch.tensor([0, 5, 6, 23, 37], dtype=torch.int32)
    grad = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    out, lse = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, True, cu, max(lengths))
    got = torch.autograd.grad(out, (q, k, v), grad)
    pieces = [math_attention(*(t[:, a:b] for t in (q, k, v)), 0.3, True) for a, b in zip(cu[:-1], cu[1:])]
    expected_out = torch.cat(pieces, dim=1)
    expected = torch.autograd.grad(expected_out, (q, k, v), grad)
    assert (out - expected_out).abs().max() < 1e-5
    for name, a, b in zip("qkv", got, expected):
        assert relative_error(a, b) < 1e-5, name
    # the first token of each document sees itself alone: lse is its own score
    for start in cu[:-1].tolist():
        assert torch.allclose(lse[0, 0, start].double(), 0.3 * (q[0, start, 0] * k[0, start, 0]).sum(), atol=1e-5)
    whole, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, True, None, 0)
    assert (whole[:, 5:] - expected_out[:, 5:]).abs().max() > 1e-2


@pytest.mark.parametrize("documents", [False, True])
def test_sliding_window_reference_equals_masked_math_attention(documents):
    """`window_left` W-1 (transformers' sliding_window W): each query sees itself and the W-1 keys before it (and,
    with documents, only its own document's). The reference is SDPA's math path with that boolean mask written
    out; negative control: without the window the output differs."""
    q, k, v = qkv(batch=1, tokens=37)
    window_left = 5
    cu = torch.tensor([0, 5, 6, 23, 37], dtype=torch.int32) if documents else None
    grad = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    out, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, True, cu, 17 if documents else 0, window_left)
    got = torch.autograd.grad(out, (q, k, v), grad)
    position = torch.arange(37)
    allowed = (position[:, None] >= position[None, :]) & (position[:, None] - position[None, :] <= window_left)
    if documents:
        document = torch.bucketize(position, cu[1:].long(), right=True)
        allowed &= document[:, None] == document[None, :]
    expected_out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=allowed, scale=0.3, enable_gqa=True).transpose(1, 2)
    expected = torch.autograd.grad(expected_out, (q, k, v), grad)
    assert (out - expected_out).abs().max() < 1e-5
    for name, a, b in zip("qkv", got, expected):
        assert relative_error(a, b) < 1e-5, name
    unwindowed, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, True, cu, 17 if documents else 0)
    assert (unwindowed - expected_out).abs().max() > 1e-2
    torch.library.opcheck(FA4_OP, (q.detach(), k.detach(), v.detach(), 0.3, True, cu, 17, window_left))


@pytest.mark.parametrize("window_left", [-1, 5])
def test_attention_sinks_equal_the_softmax_with_a_sink_column(window_left):
    """GPT-OSS's learnable sinks: one logit per head joins every query's softmax and is dropped before the values
    (its eager attention, written out here with autograd: the reference, sinks' gradient included). Negative
    control: without the sinks the output differs."""
    q, k, v = qkv(batch=2, tokens=23)
    sinks = torch.randn(q.shape[2], dtype=torch.float32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    grad = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    out, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, True, None, 0, window_left, sinks)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    groups = q.shape[2] // k.shape[2]
    scores = (q.transpose(1, 2) @ k.repeat_interleave(groups, 2).transpose(1, 2).transpose(-1, -2)) * 0.3
    position = torch.arange(23)
    hidden = (position[:, None] < position[None, :]) | (position[:, None] - position[None, :] > (
        window_left if window_left >= 0 else 10**6))
    scores = scores.masked_fill(hidden, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    expected_out = (probs @ v.repeat_interleave(groups, 2).transpose(1, 2)).transpose(1, 2)
    expected = torch.autograd.grad(expected_out, (q, k, v, sinks), grad)
    assert (out - expected_out).abs().max() < 1e-5
    for name, a, b in zip(["q", "k", "v", "sinks"], got, expected):
        assert relative_error(a, b) < 1e-5, name
    plain, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, True, None, 0, window_left)
    assert (plain - expected_out).abs().max() > 1e-2
    torch.library.opcheck(FA4_OP, (q.detach(), k.detach(), v.detach(), 0.3, True, None, 0, window_left,
                                   sinks.detach()))


class CountFa4(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func is FA4_OP
        return func(*args, **(kwargs or {}))


def build(attn, checkpointing=False):
    from transformers import AutoModelForCausalLM

    resolve_attn_implementation(attn)  # registers 'fa4'
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(num_hidden_layers=LAYERS), dtype=torch.float32,
                                             attn_implementation=attn)
    if checkpointing:
        enable_gradient_checkpointing(model)
    return model.train()


def step(model, length=90):
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(3))
    counter = CountFa4()
    with counter:
        logits = model(input_ids=ids, position_ids=torch.arange(length)[None]).logits
        loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, counter.runs


def assert_same(result, reference):
    assert abs(result[0] - reference[0]) / reference[0] < 1e-5
    err, name = max((relative_error(result[1][n], reference[1][n]), n) for n in reference[1])
    assert err < 1e-4, f"gradient of {name} off by {err:.1e}"


@pytest.fixture(scope="module")
def sdpa_reference():
    return step(build("sdpa"))


def test_model_on_fa4_equals_sdpa_and_runs_the_op(sdpa_reference):
    model = build("fa4")
    assert model.config._attn_implementation == "fa4"
    result = step(model)
    assert_same(result, sdpa_reference)
    assert result[2] == LAYERS and sdpa_reference[2] == 0


def test_kept_attention_saves_the_fa4_output(sdpa_reference):
    plain = step(build("fa4", checkpointing=True))
    assert_same(plain, sdpa_reference)
    assert plain[2] == 2 * LAYERS  # negative control: checkpointing recomputes attention
    model = build("fa4", checkpointing=True)
    apply_checkpoint_levers(model, keep_attention_fraction=1.0)
    kept = step(model)
    assert_same(kept, sdpa_reference)
    assert kept[2] == LAYERS  # forward only


def test_choice_of_kernel(monkeypatch):
    assert resolve_attn_implementation("flash_attention_4") == "fa4"
    assert resolve_attn_implementation("fa4") == "fa4"
    monkeypatch.setattr(fa4, "fa4_supported_here", lambda: False)
    assert resolve_attn_implementation("auto") == "sdpa"
    monkeypatch.setattr(fa4, "fa4_supported_here", lambda: True)
    assert resolve_attn_implementation("auto") == "fa4"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa4, "fa4_importable", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # a GPU run: FlashAttention 4 must be installed
    with pytest.raises(ConfigError, match=r"pip install \"flash-attn-4==4\.0\.0b36\""):
        resolve_attn_implementation("fa4")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the same machine training on its CPU: the reference kernel
    assert resolve_attn_implementation("fa4") == "fa4"


def test_masks_and_dropout_are_refused_with_the_fix():
    q, k, v = (t.detach().float().transpose(1, 2) for t in qkv())
    with pytest.raises(ConfigError, match="use 'sdpa'"):
        fa4.fa4_attention(None, q, k, v, torch.ones(2, 37, dtype=torch.bool))
    with pytest.raises(ConfigError, match="dropout"):
        fa4.fa4_attention(None, q, k, v, None, dropout=0.1)
    out, weights = fa4.fa4_attention(None, q, k, v, None, scaling=0.5)
    assert weights is None and out.shape == (2, 37, 4, 8)  # (batch, tokens, heads, dim), as transformers wants


@pytest.mark.skipif(not fa4.fa4_supported_here(), reason="needs FlashAttention 4 and a Hopper-or-newer GPU")
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("window_left", [-1, 127], ids=["full", "window128"])
@pytest.mark.parametrize("documents", [None, [0, 300, 301, 777, 1000]], ids=["one-sequence", "varlen"])
@pytest.mark.parametrize("dim", [128, 256], ids=["hdim128", "hdim256"])
def test_cuda_kernels_match_the_reference_kernels(documents, window_left, sinks, dim):
    """FA4's kernels in bf16 against the CPU reference, dense and variable-length (document packing: the reference
    masks pairs from different documents), with and without a sliding window and attention sinks (their gradient
    too). Negative control: the other mask gives another output."""
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in qkv(batch=1, tokens=1000, dim=dim))
    cu = torch.tensor(documents, dtype=torch.int32) if documents else None
    longest = int(cu.diff().max()) if documents else 0
    grad = torch.randn_like(q)
    sink = torch.randn(q.shape[2], device="cuda", requires_grad=True) if sinks else None
    inputs = (q, k, v) + ((sink,) if sinks else ())
    out, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, dim ** -0.5, True, cu.cuda() if documents else None, longest,
                                                 window_left, sink)
    got = torch.autograd.grad(out, inputs, grad)
    cpu = [t.detach().cpu().float().requires_grad_() for t in inputs]
    ref_out, _ = torch.ops.ulysses_train.fa4_forward(*cpu[:3], dim ** -0.5, True, cu, longest, window_left,
                                                     cpu[3] if sinks else None)
    expected = torch.autograd.grad(ref_out, cpu, grad.cpu().float())
    assert relative_error(out.cpu(), ref_out) < 1e-2
    for name, a, b in zip(["q", "k", "v", "sinks"], got, expected):
        assert relative_error(a.cpu(), b) < 2e-2, name
    other = math_attention(*cpu[:3], dim ** -0.5, False) if documents is None else \
        torch.ops.ulysses_train.fa4_forward(*cpu[:3], dim ** -0.5, True, None, 0)[0]
    assert relative_error(out.cpu(), other) > 1e-1


def test_heads_fa4_does_not_take_on_hopper_run_the_wide_head_path_exactly():
    """FlashAttention 4 takes heads up to 256 wide on Hopper (Gemma 4's global layers are 512): fa4_takes says so
    by capability, and the wide-head path (SDPA's memory-efficient kernel on a GPU, math here), each packed
    document alone, equals the reference kernel's variable-length attention: output and gradients, with GQA. The
    negative control: without the document boundaries it differs."""
    assert fa4.fa4_takes(192, 128, (9, 0)) and fa4.fa4_takes(512, 512, (10, 0))
    assert not fa4.fa4_takes(512, 512, (9, 0))
    lengths = [5, 1, 17, 14]
    q, k, v = qkv(batch=1, tokens=sum(lengths), dim=16)
    cu = torch.tensor([0, 5, 6, 23, 37], dtype=torch.int32)
    grad = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    got = fa4.wide_head_attention(*(t.transpose(1, 2) for t in (q, k, v)), 0.3, cu, -1, None)
    expected, _ = torch.ops.ulysses_train.fa4_forward(q, k, v, 0.3, True, cu, max(lengths))
    assert (got - expected).abs().max() < 1e-5  # the reference kernel computes in fp32
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), grad),
                          torch.autograd.grad(expected, (q, k, v), grad)):
        assert relative_error(a, b) < 1e-5, name
    whole = fa4.wide_head_attention(*(t.transpose(1, 2) for t in (q, k, v)), 0.3, None, -1, None)
    assert (whole[:, 5:] - expected[:, 5:]).abs().max() > 1e-2
    with pytest.raises(ConfigError, match="sliding window or sinks"):
        fa4.wide_head_attention(*(t.transpose(1, 2) for t in (q, k, v)), 0.3, None, 7, None)


def test_the_cpu_fa4_warning_does_not_advise_what_windows_or_packing_refuse(caplog):
    """fa4 without a GPU warns that its reference kernel is slow; it advises 'sdpa' only where sdpa is taken (no
    sliding windows, no packed documents: those refuse sdpa, attention_checks.check_window_attention and
    check_document_attention), not as a blanket fix."""
    import logging

    from ulysses_train.model.loading import resolve_attn_implementation

    with caplog.at_level(logging.WARNING):
        assert resolve_attn_implementation("fa4") == "fa4"
    message = " ".join(record.getMessage() for record in caplog.records)
    assert "reference kernel" in message and "sliding windows" in message and "data.packing: documents" in message
    assert not message.rstrip(".").endswith("use 'sdpa' on CPU")
