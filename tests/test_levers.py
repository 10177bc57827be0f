"""The memory levers change memory and time, never the numbers: activation offload, kept (never recomputed)
attention and TiledMLP each give the loss and gradients of plain checkpointing, in one process and in
2-process ZeRO-3 runs (sp=2, and dp=2 with uneven lengths: test_levers_zero3.py); fp32, loss < 1e-5, gradients
< 1e-4."""
import copy
import json

import pytest
import torch
from helpers import relative_error, tiny_qwen3_config
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_train.config import Config, ConfigError, ModelConfig
from ulysses_train.model.architecture import text_config
from ulysses_train.model.loading import enable_gradient_checkpointing
from ulysses_train.model.offload import cpu_checkpointing_requested
from ulysses_train.model.recompute import (apply_checkpoint_levers, attention_ops, kept_attention_layers,
                                           offload_pinned_bytes, offloaded_layer_count)
from ulysses_train.model.tiling import AUTO_TOKENS_PER_HIDDEN, TiledMLPSchedule, apply_tiled_mlp, tiled_mlp_forward

LAYERS = 3


def offload_host_bytes(hf_config, local_tokens: int, keep_attention_fraction: float = 0.0,
                       dtype: torch.dtype = torch.bfloat16, offload_fraction: float = 1.0) -> int:
    """The reference, by hand: host memory the offload should pin for `local_tokens` tokens per rank: the
    input of every offloaded layer (offloaded_layer_count), and the attention output (dtype) and log-sum-exp
    (fp32) of each kept layer among them."""
    text = text_config(hf_config)
    layers, heads = text.num_hidden_layers, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    item = torch.empty((), dtype=dtype).element_size()
    offloaded = offloaded_layer_count(layers, offload_fraction)
    kept = [i for i in kept_attention_layers(layers, keep_attention_fraction) if i < offloaded]
    inputs = offloaded * local_tokens * text.hidden_size * item
    attention = len(kept) * local_tokens * heads * (head_dim * item + 4)
    return inputs + attention


LENGTH = 200  # > hidden (64): TiledMLP gets ceil(200 / 64) = 4 tiles


class CountAttention(TorchDispatchMode):
    """How many times an attention kernel really executes (a kept output handed back does not)."""

    def __init__(self):
        super().__init__()
        self.runs = 0
        self.ops = attention_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func in self.ops
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def base_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(num_hidden_layers=LAYERS), dtype=torch.float32,
                                             attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def train_steps(base_model, levers, lengths=(LENGTH, LENGTH)):
    """Checkpointed copy of the model with `levers(model)` applied; loss and gradients of the last step."""
    model = copy.deepcopy(base_model).train()
    enable_gradient_checkpointing(model)
    levers(model)
    gen = torch.Generator().manual_seed(3)
    counter = CountAttention()
    for length in lengths:
        ids = torch.randint(0, 256, (1, length), generator=gen)
        model.zero_grad()
        with counter:
            logits = model(input_ids=ids, position_ids=torch.arange(length)[None]).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, model, counter.runs // len(lengths)


@pytest.fixture(scope="module")
def plain(base_model):
    return train_steps(base_model, lambda model: None)


def assert_same(result, plain):
    loss, grads = result[0], result[1]
    assert abs(loss - plain[0]) / plain[0] < 1e-5, (loss, plain[0])
    err, name = max((relative_error(grads[n], plain[1][n]), n) for n in plain[1])
    assert err < 1e-4, f"gradient of {name} off by {err:.1e}"


# ---------------------------------------------------------------- one process


def test_offload_equals_plain_and_reuses_its_buffers(base_model, plain):
    result = train_steps(base_model, lambda m: apply_checkpoint_levers(m, offload=True))
    assert_same(result, plain)
    model = result[2]
    offloader = model.activation_offloader
    # every layer input but the last's, fetched back one layer ahead: never on demand
    assert offloader.pool.count == LAYERS - 1
    assert offloader.prefetched == 2 * (LAYERS - 1) and offloader.fetched_on_demand == 0
    assert offload_pinned_bytes(model) == offload_host_bytes(model.config, LENGTH, dtype=torch.float32)
    # a further step, shorter, allocates nothing new
    before = offloader.pinned_bytes()
    train_steps_on(model, LENGTH // 2)
    assert offloader.pinned_bytes() == before and offloader.pool.count == LAYERS - 1


def train_steps_on(model, length):
    ids = torch.randint(0, 256, (1, length))
    logits = model(input_ids=ids, position_ids=torch.arange(length)[None]).logits
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()


def test_kept_attention_equals_plain_and_is_not_recomputed(base_model, plain):
    assert plain[3] == 2 * LAYERS  # negative control: plain checkpointing runs attention twice per layer
    result = train_steps(base_model, lambda m: apply_checkpoint_levers(m, keep_attention_fraction=1.0))
    assert_same(result, plain)
    assert result[3] == LAYERS  # once per layer: forward only


def test_kept_attention_with_offload_equals_plain(base_model, plain):
    kept = kept_attention_layers(LAYERS, 0.7)
    assert kept == [0, 2]
    result = train_steps(base_model, lambda m: apply_checkpoint_levers(m, 0.7, offload=True))
    assert_same(result, plain)
    model = result[2]
    assert result[3] == LAYERS + (LAYERS - len(kept))
    # layer inputs 0 and 1, plus layer 0's attention output and log-sum-exp (layer 2 stays on the device)
    offloader = model.activation_offloader
    assert offloader.prefetched == 2 * 4 and offloader.fetched_on_demand == 0
    assert offloader.pinned_bytes() == offload_host_bytes(model.config, LENGTH, 0.7, dtype=torch.float32)


def test_partial_offload_moves_only_the_first_layers_and_equals_plain(base_model, plain):
    """model.activation_offload_fraction: round(share x layers) layers, the first ones, offload (with their
    kept attention outputs); the last layers keep theirs on the device."""
    assert [offloaded_layer_count(LAYERS, f) for f in (0.0, 0.2, 0.34, 0.5, 0.7, 1.0)] == [0, 1, 1, 2, 2, 2]
    assert offloaded_layer_count(36, 0.75) == 27 and offloaded_layer_count(1, 1.0) == 0
    result = train_steps(base_model, lambda m: apply_checkpoint_levers(m, 0.7, offload=True, offload_fraction=0.34))
    assert_same(result, plain)
    offloader = result[2].activation_offloader
    # layer 0 only: its input, attention output and log-sum-exp; prefetched while layer 1 runs backward
    assert offloader.pool.count == 3
    assert offloader.prefetched == 2 * 3 and offloader.fetched_on_demand == 0
    assert offloader.pinned_bytes() == offload_host_bytes(result[2].config, LENGTH, 0.7, dtype=torch.float32,
                                                          offload_fraction=0.34)
    # negative control: a share of 0 offloads nothing
    result = train_steps(base_model, lambda m: apply_checkpoint_levers(m, offload=True, offload_fraction=0.0))
    assert_same(result, plain)
    assert result[2].activation_offloader.pinned_bytes() == 0


def test_tiled_mlp_equals_plain(base_model, plain):
    result = train_steps(base_model, lambda m: apply_tiled_mlp(m, "true"))
    assert_same(result, plain)
    assert result[2].tiled_mlp_schedule.num_tiles == 4


def test_all_levers_together_equal_plain(base_model, plain):
    def levers(model):
        apply_checkpoint_levers(model, 0.5, offload=True)
        apply_tiled_mlp(model, True)
    assert_same(train_steps(base_model, levers), plain)


def test_tiled_mlp_runs_exactly_the_agreed_number_of_tiles(base_model):
    """A rank whose slice torch.chunk would cut into fewer pieces (12 rows into 5 -> 4) pads instead, so it
    gathers ZeRO-3 weights as often as the others; outputs and gradients are unchanged."""
    grad_out = torch.randn(1, 12, 64)

    def forward_backward(tiled):
        mlp = copy.deepcopy(base_model.model.layers[0].mlp)
        x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        calls = []
        mlp.gate_proj.register_forward_hook(lambda *a: calls.append(1))
        schedule = TiledMLPSchedule("true", 64)
        schedule.num_tiles = 5
        out = tiled_mlp_forward(mlp, schedule, x) if tiled else mlp(x)
        out.backward(grad_out)  # TiledMLP accumulates weight gradients into .grad inside its backward
        return out, [x.grad, *(p.grad for p in mlp.parameters())], len(calls)

    want, want_grads, _ = forward_backward(tiled=False)
    got, got_grads, calls = forward_backward(tiled=True)
    assert calls == 10  # 5 tiles in forward, 5 in backward
    assert relative_error(got, want) < 1e-6
    assert max(relative_error(g, w) for g, w in zip(got_grads, want_grads)) < 1e-5


def test_tiled_mlp_tile_rule_and_auto_threshold():
    auto, always = TiledMLPSchedule("auto", 64), TiledMLPSchedule("true", 64)
    assert auto.tiles_for(AUTO_TOKENS_PER_HIDDEN * 64) is None
    assert auto.tiles_for(AUTO_TOKENS_PER_HIDDEN * 64 + 1) == AUTO_TOKENS_PER_HIDDEN + 1
    assert always.tiles_for(10) == 1 and always.tiles_for(129) == 3


def test_lever_config_is_validated(base_model):
    assert ModelConfig().keep_attention_fraction == "auto"  # the planner's choice on GPUs (test_auto_levers.py)
    Config(model=ModelConfig(keep_attention_fraction="auto", gradient_checkpointing=False))
    for bad in (1.5, -0.1, True, "half"):
        with pytest.raises(ConfigError, match="keep_attention_fraction"):
            Config(model=ModelConfig(keep_attention_fraction=bad))
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        Config(model=ModelConfig(keep_attention_fraction=0.5, gradient_checkpointing=False))
    assert ModelConfig().activation_offload_fraction == "auto"
    for bad in (1.5, -0.1, True, "all"):
        with pytest.raises(ConfigError, match="activation_offload_fraction"):
            Config(model=ModelConfig(activation_offload_fraction=bad))
    with pytest.raises(ConfigError, match="cpu_checkpointing"):
        apply_checkpoint_levers(copy.deepcopy(base_model), offload=True)  # checkpointing not enabled
    with open("ds_configs/zero3_activation_offload.json") as fh:
        assert cpu_checkpointing_requested(json.load(fh))
    with open("ds_configs/zero3.json") as fh:
        assert not cpu_checkpointing_requested(json.load(fh))
    assert kept_attention_layers(36, 0.5) == list(range(1, 36, 2)) and kept_attention_layers(4, 0.0) == []


# ---------------------------------------------------------------- CUDA (runs only where a GPU is present)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: side-stream copies and pinned buffers")
def test_levers_on_cuda_equal_plain_with_pinned_buffers_and_prefetch():
    """The real offload path: copies on a side stream into page-locked buffers, fetched one layer ahead.
    Layers wide and long enough that a missing wait or a freed source would show in the gradients."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # as many KV heads as query heads: fp32 attention with GQA falls back to SDPA's math path (no kernel to keep)
    config = tiny_qwen3_config(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                               num_key_value_heads=8, head_dim=64, num_hidden_layers=4, vocab_size=512)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").cuda()
    ids = torch.randint(0, 512, (1, 4096), device="cuda")

    def step(levers):
        model = copy.deepcopy(base).train()
        enable_gradient_checkpointing(model)
        levers(model)
        counter = CountAttention()
        for _ in range(2):  # the second step reuses the buffers of the first
            model.zero_grad()
            with counter:
                logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device="cuda")[None]).logits
                loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
                loss.backward()
        torch.cuda.synchronize()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, model, counter.runs // 2

    want = step(lambda m: None)
    got = step(lambda m: apply_checkpoint_levers(m, 0.5, offload=True))
    assert_same(got, want)
    assert want[3] == 2 * 4 and got[3] == 4 + 2  # the kept layers' attention kernel ran once
    offloader = got[2].activation_offloader
    assert offloader.fetched_on_demand == 0
    assert all(buffer.is_pinned() for buffer in offloader.pool._all)
    estimate = offload_host_bytes(config, ids.shape[1], 0.5, dtype=torch.float32)
    assert estimate <= offloader.pinned_bytes() < estimate + 2**16  # plus the kernel's few-byte RNG state
    # half the layers offloaded (layers 0 and 1), the others on the device: the same gradients
    got = step(lambda m: apply_checkpoint_levers(m, 0.5, offload=True, offload_fraction=0.5))
    assert_same(got, want)
    offloader = got[2].activation_offloader
    estimate = offload_host_bytes(config, ids.shape[1], 0.5, dtype=torch.float32, offload_fraction=0.5)
    assert offloader.fetched_on_demand == 0 and estimate < offload_host_bytes(config, ids.shape[1], 0.5,
                                                                              dtype=torch.float32)
    assert estimate <= offloader.pinned_bytes() < estimate + 2**16


def test_the_no_kernel_warning_names_the_value_width_not_the_setting(monkeypatch, caplog):
    """Issue 51: with sdpa set, Kimi's MLA (value heads narrower than q/k) on CPU made the keep-attention lever warn
    "Use attn_implementation sdpa, fa4 or fla". The warning now names SDPA's math path and the value width; the
    negative control, equal widths, runs the fused CPU kernel and warns nothing."""
    import logging

    from ulysses_train.model import recompute

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    q, k = (torch.randn(1, 2, 16, 12, requires_grad=True) for _ in range(2))
    for width, warned in ((12, False), (6, True)):
        monkeypatch.setattr(recompute, "_warned_no_attention", False)
        caplog.clear()
        v = torch.randn(1, 2, 16, width, requires_grad=True)
        with caplog.at_level(logging.WARNING, logger=recompute.__name__):
            recompute.checkpoint_layer(attend, q, k, v, keep_attention=True).backward()
        assert [r.getMessage() for r in caplog.records] == ([recompute.NO_KERNEL_WARNING] if warned else []), width
    assert "value heads of another width than the query/key heads (MLA: Kimi Linear)" in recompute.NO_KERNEL_WARNING
    assert "Use attn_implementation" not in recompute.NO_KERNEL_WARNING


def test_tiled_mlp_tiles_both_feed_forward_blocks_of_a_layer():
    """GraniteMoeShared's layers call two feed-forward modules on the same input, experts (`block_sparse_moe`) and a
    fused gated `shared_mlp` (input_linear's halves: act(a) * b): both are tiled (architecture.feed_forward_blocks),
    and over 3 tiles (an uneven length, so a padded tile) the logits and every gradient equal the untiled model's.
    Control: before, a layer without `mlp` had no block found and tiled_mlp=true was refused; the planner counts the
    shared MLP's width (shared_intermediate_size) in the MLP width a token runs."""
    import copy

    from helpers import assert_same_logits_and_gradients, tiny_family_config
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.tiling import apply_tiled_mlp, tileable_blocks
    from ulysses_train.planner.shapes import ModelShape

    config = tiny_family_config("granitemoeshared", num_local_experts=4, num_experts_per_tok=2,
                                shared_intermediate_size=48, hidden_size=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    reference = copy.deepcopy(model)
    mlps, tileable = tileable_blocks(model)
    assert [type(m).__name__ for m in tileable] == ["GraniteMoeSharedMoE", "GraniteMoeSharedMLP"] * 2
    schedule = apply_tiled_mlp(model, "true")
    assert_same_logits_and_gradients(model, reference, torch.randint(0, 256, (1, 150)))
    assert schedule.num_tiles > 1
    shape = ModelShape.from_hf_config(config)
    assert shape.shared_expert_intermediate == 48 and shape.mlp_width == 2 * config.intermediate_size + 48
