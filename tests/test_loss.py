"""Chunked cross-entropy against PyTorch's own full-logits cross-entropy, and its memory claim."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ulysses_train.model.loss import chunked_nll_sum, full_logits_nll_sum


def make_inputs(rows=50, hidden=16, vocab=97, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (rows,), generator=gen)
    y[::7] = -100
    return h, w, y


@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 50, 1000])
def test_chunked_equals_plain_value_and_gradients(chunk_rows):
    h, w, y = make_inputs()
    ref = torch.nn.functional.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum")
    gh_ref, gw_ref = torch.autograd.grad(ref * 0.37, (h, w))
    got = chunked_nll_sum(h, w, y, chunk_rows)
    gh, gw = torch.autograd.grad(got * 0.37, (h, w))  # a non-unit upstream gradient is scaled through
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-10, atol=1e-12)


def test_full_logits_path_equals_reference():
    h, w, y = make_inputs()
    ref = torch.nn.functional.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(full_logits_nll_sum(h @ w.t(), y), ref.float())


def test_all_labels_ignored_gives_zero_loss_and_gradient():
    h, w, y = make_inputs()
    y[:] = -100
    got = chunked_nll_sum(h, w, y, 8)
    got.backward()
    assert got.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_negative_control_wrong_label_changes_loss():
    h, w, y = make_inputs()
    ref = chunked_nll_sum(h, w, y, 8).item()
    y2 = y.clone()
    y2[1] = (y2[1] + 1) % w.shape[0]
    assert abs(chunked_nll_sum(h, w, y2, 8).item() - ref) > 1e-6


def saved_bytes(fn) -> int:
    """Bytes of tensors autograd keeps for backward while `fn` runs (distinct storages)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_chunked_loss_saves_far_less_for_backward():
    """Vocab 32K, 4K tokens: plain cross-entropy keeps seq x vocab fp32 logits (512 MiB) for backward;
    the chunked loss keeps only gradients of the hidden states and of the weight."""
    rows, hidden, vocab = 4096, 64, 32768
    h = torch.randn(rows, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (rows,))
    plain = saved_bytes(lambda: torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="sum"))
    chunked = saved_bytes(lambda: chunked_nll_sum(h, w, y, 256))
    logits_bytes = rows * vocab * 4
    print(f"saved for backward: plain {plain / 2**20:.1f} MiB, chunked {chunked / 2**20:.1f} MiB")
    assert plain >= logits_bytes
    assert chunked <= (rows * hidden + vocab * hidden) * 4 + 1024
    assert chunked * 40 < plain


class VocabProducts(TorchDispatchMode):
    """Counts the matrix products with an operand or result that has a dimension of the vocabulary's size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            tensors = [a for a in (*args, *(kwargs or {}).values(), out) if isinstance(a, torch.Tensor)]
            self.count += any(self.vocab in t.shape for t in tensors)
        return out


def lm_head_products(loss_fn, rows=250, hidden=16, vocab=97) -> int:
    h, w, y = make_inputs(rows, hidden, vocab, dtype=torch.float32)
    with VocabProducts(vocab) as counter:
        loss_fn(h, w, y).backward()
    return counter.count


def test_fused_loss_forms_each_chunks_logits_once():
    """Three lm_head products per chunk (logits, the hidden states' gradient, the weight's), no recompute:
    what makes the fused loss cheaper than checkpointing each chunk (measured on an H200: "The loss alone,
    three ways" in benchmarks/RESULTS.md). Negative control: torch.utils.checkpoint per chunk forms each
    chunk's logits twice, four products per chunk."""
    chunks = 4  # 250 rows in chunks of 64, the last one short
    assert lm_head_products(lambda h, w, y: chunked_nll_sum(h, w, y, 64)) == 3 * chunks

    def checkpoint_per_chunk(h, w, y):
        return sum(checkpoint(lambda hc, yc: full_logits_nll_sum(hc @ w.t(), yc), h[s:s + 64], y[s:s + 64],
                              use_reentrant=False) for s in range(0, h.shape[0], 64))

    assert lm_head_products(checkpoint_per_chunk) == 4 * chunks


def test_weight_grad_accumulation_matches_fp64_and_keeps_fp32_sums():
    """accumulate_weight_grad adds grad_logits.T @ h into an fp32 accumulator (the fused CUDA GEMM was checked
    on the GPU by `benchmarks/loss_weight_grad.py` (removed; it ran at commit 6916872, `git show
    6916872:benchmarks/loss_weight_grad.py`); here the portable form). Many small bf16 chunk products
    must survive the fp32 sum: the negative control accumulates in bf16 and loses them."""
    from ulysses_train.model.loss import accumulate_weight_grad, fused_fp32_gemm_available

    assert not fused_fp32_gemm_available(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(16, 8, generator=gen).bfloat16(), torch.randn(16, 4, generator=gen).bfloat16())
              for _ in range(200)]
    acc = torch.full((8, 4), 100.0)  # a large running total: bf16 (8 bits of mantissa) drops small additions
    acc_bf16 = acc.bfloat16()
    expected = acc.double().clone()
    for g, h in chunks:
        accumulate_weight_grad(acc, g, h)
        acc_bf16 += g.t() @ h
        expected += g.double().t() @ h.double()
    assert acc.dtype == torch.float32
    err = ((acc.double() - expected).norm() / expected.norm()).item()
    err_bf16 = ((acc_bf16.double() - expected).norm() / expected.norm()).item()
    assert err < 2e-3, err
    assert err_bf16 > 5 * err, (err_bf16, err)


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.25, None), (0.25, 3.0), (1.0, 2.0)])
def test_fused_loss_applies_the_heads_scale_and_softcap(scale, softcap):
    """Against the heads' own formula (Cohere: z * logit_scale, Granite: z / logits_scaling, Gemma:
    cap * tanh(z / cap)) written out here in fp64 with autograd; chunks of 8 rows, ignored labels."""
    from ulysses_train.model.architecture import LogitTransform
    from ulysses_train.model.loss import chunked_nll_sum

    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    y[:5] = -100
    logits = (h @ w.T) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    want = torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    want_h, want_w = torch.autograd.grad(want, (h, w))
    got = chunked_nll_sum(h, w, y, 8, LogitTransform(scale, softcap))
    got_h, got_w = torch.autograd.grad(got, (h, w))
    assert abs(float(got - want)) < 1e-10 * float(want)
    assert torch.allclose(got_h, want_h, rtol=1e-10, atol=1e-12) and torch.allclose(got_w, want_w, rtol=1e-10,
                                                                                     atol=1e-12)
    if scale != 1.0 or softcap:  # negative control: the plain loss is not the transformed one
        plain = chunked_nll_sum(h, w, y, 8)
        assert abs(float(plain - want)) > 1e-3 * float(want)


def test_logit_post_processing_is_applied_only_where_its_meaning_is_known():
    from transformers import AutoConfig

    from ulysses_train.config import ConfigError
    from ulysses_train.model.architecture import logit_transform
    from ulysses_train.model.loading import check_supported_architecture

    assert logit_transform(AutoConfig.for_model("cohere", logit_scale=0.25)).scale == 0.25
    assert logit_transform(AutoConfig.for_model("granite", logits_scaling=4.0)).scale == 0.25
    assert logit_transform(AutoConfig.for_model("qwen3")).identity
    odd = AutoConfig.for_model("qwen3")
    odd.logit_scale = 0.5  # a key Qwen3's forward never reads: refused, not guessed
    with pytest.raises(ConfigError, match="logit_scale=0.5"):
        check_supported_architecture(odd)
    odd = AutoConfig.for_model("qwen3")
    odd.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0"):
        check_supported_architecture(odd)
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):  # Gemma 2: its attention soft-cap, not yet
        check_supported_architecture(AutoConfig.for_model("gemma2"))
