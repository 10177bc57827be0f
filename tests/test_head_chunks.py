"""Attention in head chunks (`model.attention_head_chunks`, model/mixers/head_chunks.py): the all-to-all and the
kernel run for one chunk of each rank's heads at a time.

Checked against the plain single-process Hugging Face model: one step on gloo processes (sp=4 with uneven lengths
and the levers; GPT-OSS's sinks and windows and DeepSeek-V3's MLA in chunks run in tests/test_model_families.py
and tests/test_latent_attention.py at sp=2 x dp=2), and in one process (sp=1, chunks splitting the KV heads or
sharing one). Negative control: a chunk that takes a contiguous run of the slice's heads (not the same share of
every rank's) sends heads to the wrong ranks, and the check catches it. The planner's terms for it, the rule of
which chunk counts split a model's heads, and the config's refusals."""
import copy

import pytest
import torch
from helpers import assert_step_matches, reference_step, save_tiny_model, tiny_qwen3_config, worst_relative_error
from test_model_families import LR, family_step, uneven_samples

from ulysses_train.config import Config, ConfigError, ModelConfig
from ulysses_train.constants import GIB
from ulysses_train.model.mixers import check_head_chunks, valid_head_chunks
from ulysses_train.model.mixers.head_chunks import chunk_problem
from ulysses_train.planner import PlanOptions, load_model_shape, plan
from ulysses_train.planner.layer import attention_backward_extra_per_token, attention_saved_per_token
from ulysses_train.planner.levers import choose_levers

EIGHT_HEADS = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)
"""A tiny Qwen3 with heads to chunk: at sp=4 each rank runs 2 query heads and one (repeated) KV head."""
CHUNKS = ("--set", "model.attention_head_chunks=2")


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("head_chunks") / "qwen3"), config=tiny_qwen3_config(**EIGHT_HEADS))


def test_head_chunked_step_equals_single_process(tmp_path, eight_heads):
    """sp=4, sequences of 200 and 181 tokens, activation offload and TiledMLP, 2 chunks sharing each rank's KV
    head."""
    extra = (*CHUNKS, "--set", "model.tiled_mlp=true", "--set", "model.keep_attention_fraction=0")
    samples, result = family_step(tmp_path, eight_heads, 4, 4, extra, offload=True, samples=uneven_samples(1))
    loss_error, grad_error = assert_step_matches(result, *reference_step(eight_heads, samples, LR))
    print(f"head chunks sp=4: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


def test_negative_control_contiguous_chunks_differ(tmp_path, eight_heads):
    samples, result = family_step(tmp_path, eight_heads, 2, 2, (*CHUNKS, "--head-chunks-contiguous"),
                                  samples=uneven_samples(1))
    loss, grads, _, _ = reference_step(eight_heads, samples, LR)
    err, name = worst_relative_error(result["grads"], grads)
    print(f"contiguous head chunks: loss {result['loss']:.6f} vs {loss:.6f}, worst grad rel err {err:.2e} ({name})")
    assert err > 1e-3, (err, name)


@pytest.mark.parametrize("kv_heads,chunks", [(4, 2), (2, 4), (2, 8)], ids=["kv-split", "kv-shared", "one-head-each"])
def test_chunks_in_one_process_equal_plain(kv_heads, chunks):
    """sp=1: the chunks' exchange is the identity, so this checks the chunking itself (heads selected, outputs
    placed, gradients written back: dq over q, dk and dv summed where chunks share a KV head)."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.model.mixers.attention_exchange import route_own_exchange
    from ulysses_train.sequence_parallel import SequenceParallel

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_qwen3_config(num_attention_heads=8, num_key_value_heads=kv_heads,
                                                               head_dim=8, attn_implementation="sdpa")).float()
    chunked = copy.deepcopy(plain)
    assert route_own_exchange(chunked, SequenceParallel(), chunks) == 2
    ids = torch.randint(0, 256, (1, 40))
    want, got = plain(ids, labels=ids).loss, chunked(ids, labels=ids).loss
    want.backward(), got.backward()
    assert torch.allclose(got, want, rtol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        assert torch.allclose(b.grad, a.grad, rtol=1e-5, atol=1e-7), name


def test_which_chunk_counts_split_the_heads():
    assert [n for n in range(1, 5) if not chunk_problem(32, 8, 8, n)] == [1, 2, 4]  # Qwen3-8B at sp=8
    assert "divide the 4 query heads" in chunk_problem(32, 8, 8, 3)
    assert chunk_problem(12, 6, 2, 2) and "KV heads" in chunk_problem(12, 6, 2, 2)  # 3 KV heads a rank: 2 chunks no
    assert not chunk_problem(12, 6, 2, 3) and not chunk_problem(12, 6, 2, 6)
    shape = load_model_shape("qwen3-8b")
    assert valid_head_chunks(shape, 8) == [1, 2, 4] and valid_head_chunks(shape, 1) == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ConfigError, match=r"attention_head_chunks=3 .*Use one of \[1, 2, 4\]"):
        check_head_chunks(shape, 8, 3)


def test_the_config_refuses_bad_chunk_counts():
    assert ModelConfig().attention_head_chunks == "auto"
    Config(model=ModelConfig(attention_head_chunks=4, keep_attention_fraction=0.0))
    for bad in (0, -2, 1.5, "two", True):
        with pytest.raises(ConfigError, match="attention_head_chunks"):
            Config(model=ModelConfig(attention_head_chunks=bad))
    with pytest.raises(ConfigError, match="keeps its attention or runs it in head chunks"):
        Config(model=ModelConfig(attention_head_chunks=2, keep_attention_fraction=0.5))


def test_planner_terms_of_head_chunks():
    """Hand-computed for Qwen3-8B at sp=8 (a rank: 4 query heads of 128, one KV head): chunks save q, k, v and the
    output of the slice instead of the whole sequence's layout plus o_proj's input and the logsumexp; in backward
    they hold the slice's dk, dv and output gradient, and one query head's turn."""
    m = load_model_shape("qwen3-8b")
    one = PlanOptions(seq_length=5_000_000, sp=8, attention_kernel="fa4", offload_activations=True, tiled_mlp=True,
                      offload_optimizer=True)
    four = one.replace(attention_head_chunks=4)
    b, q, kv, out = 2, 4096, 1024, 4096
    assert attention_saved_per_token(m, one) - attention_saved_per_token(m, four) == b * out + 4 * 32
    chunk_q = q // 4  # one query head of each of the 8 ranks, per local token
    per_head = 2 * b * (chunk_q + 2 * kv) + 3 * b * chunk_q + 4 * 8  # q, k, v copied and exchanged; out, dout x2
    kernel = b * (chunk_q + 2 * kv) + 4 * chunk_q + 2 * 4 * 8  # one query head per KV head: not grouped
    assert attention_backward_extra_per_token(m, four) == b * (2 * kv + out) + per_head + kernel
    assert attention_backward_extra_per_token(m, four) < attention_backward_extra_per_token(m, one)
    unchunked, chunked = plan(m, options=one), plan(m, options=four)
    assert chunked.recompute_flops > unchunked.recompute_flops  # each chunk's forward runs again in backward
    assert chunked.gpu_total < unchunked.gpu_total - 9 * GIB  # the peak: a recomputed layer's attention backward


def test_auto_chunks_heads_only_where_the_length_needs_it():
    """8 x H100 (80 GB), 2 TiB host, activation and optimizer offload: 5M tokens of Qwen3-8B fit only in 4 head
    chunks, which `auto` then picks; at 1M the extra attention forward is not worth paying and it picks 1."""
    m = load_model_shape("qwen3-8b")
    o = PlanOptions(seq_length=5_000_000, sp=8, attention_kernel="fa4", offload_activations=True,
                    offload_optimizer=True, gpu_memory_gib=80.0, host_memory_gib=2048.0)
    auto = {"keep_attention_fraction", "activation_offload_fraction", "tiled_mlp", "attention_head_chunks"}
    long = choose_levers(m, o, auto)
    assert long.fits and long.values["attention_head_chunks"] == 4 and "4 head chunks" in long.describe()
    assert not plan(m, options=long.options.replace(attention_head_chunks=1)).fits  # control: unchunked does not
    assert choose_levers(m, o.replace(seq_length=1_048_576), auto).values["attention_head_chunks"] == 1
