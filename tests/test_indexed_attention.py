"""Indexed attention (DeepSeek Sparse Attention on MLA: DeepSeek-V3.2, GLM-5, HY-V4, dots3) through the core exactness
test: one step on gloo processes equals the plain single-process Hugging Face model (loss, every trained gradient,
the parameters after SGD). dots3 (DOTS3) has a sliding MLA layer of its own widths between its indexed ones.

Tiny configs as released in kind: MLA (q latent 16, kv latent 16, q/k heads 8 + 8, v heads 12, YaRN with its mscale
for DeepSeek-V3.2), a lightning indexer of 16 heads of 16 keeping the top 8 keys of every query (far fewer than the
sequences' 30 to 200 tokens, so the choice matters in every slice), a dense first layer then experts; GLM-5's second
layer `shared` (it reuses the first layer's choice), and its indexer's RoPE interleaved where DeepSeek-V3.2's is
half-split. The indexer is frozen, as transformers trains it (its forward runs under `no_grad`: the reference checks
that it gets no gradient and leaves it out, as the trainer does). HY-V4 (`hy_v4`) as GLM-5, with what it adds: its
indexer's rotated channels last and its scale on the head weights, a sink logit per head in the attention's softmax
and a sigmoid gate on each head's output (both perturbed from their equal initial values, as are the hyper-connections'
scales and biases, whose initial 0.01 scale leaves the streams near-equal: a stream mixed in the wrong order would
hardly show), and three hyper-connected residual streams [B, t, 3, hidden] through every layer: token-local, so the
package's slices carry them as they are, the checkpoint and offload levers included. No padding token (transformers
zeroes its embedding row, and a zero hidden state ties every indexer score).

Near-ties: the trainer's hidden states differ from the plain model's by fp32 rounding (~1e-7), so a query whose k-th
and (k+1)-th indexer scores were closer than that could pick another key. test_the_indexer_chooses_as_transformers
compares the package's choice with transformers' own indexer index for index on the same inputs, and checks that on
these models and samples (the sequences and the packed documents the steps below train) every query's k-th and
(k+1)-th visible scores are apart by more than 1e-5 of the scores' spread: 100 times what rounding moves them.

Negative controls, each one thing the sp forward must get right: the indexer scoring only the rank's own slice of
keys, the latent not gathered from the other ranks, GLM-5's shared layer not reusing the previous choice, every
rank's queries taken as the first slice's; HY-V4's sinks left out of the softmax, its streams reaching a layer in
reverse order, and (test_the_indexer_chooses_as_transformers) its indexer read in GLM-5's form."""
import pytest
import torch
from helpers import assert_step_matches, save_tiny_model, sgd_reference, tiny_family_config, worst_relative_error
from test_mamba2_families import EDGE_DOCUMENTS
from test_model_families import LEVERS, LR, family_step, uneven_samples
from test_packed_step import packed_samples, packed_step

DSA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
           moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
           index_n_heads=16, index_head_dim=16, index_topk=8, mlp_layer_types=["dense", "sparse"])
DEEPSEEK_V32 = dict(DSA, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024,
                                          "beta_fast": 32.0, "beta_slow": 1.0})
GLM_5 = dict(DSA, indexer_types=["full", "shared"])
HY_V4 = dict({k: v for k, v in GLM_5.items() if k not in ("n_group", "topk_group")}, hc_mult=3, hc_magnitude=2.0,
             pad_token_id=None, bos_token_id=1, eos_token_id=2)  # no padding row: a zero embedding ties every score
DOTS3 = dict(DSA, num_hidden_layers=3, layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
             mlp_layer_types=["dense", "sparse", "sparse"], head_dim=16, sliding_window=24,
             swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=12, swa_kv_lora_rank=20,
             swa_head_dim=16, swa_qk_nope_head_dim=10, swa_v_head_dim=8, shared_experts_intermediate_size=24,
             pad_token_id=None, bos_token_id=1, eos_token_id=2)
"""dots3: indexed MLA layers around a sliding MLA layer of its own widths (4 heads, q/k 10 + 6, v 8, latents 12 and
20) whose window (24 tokens) crosses every slice edge."""
GLM5_NEXT = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=12,
                 num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 index_n_heads=8, index_head_dim=16, index_topk=9, index_kpool=3, num_hidden_layers=3,
                 layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                 indexer_types=["full", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse"],
                 linear_num_heads=4, linear_head_dim=16, hc_mult=3, pad_token_id=None, bos_token_id=1, eos_token_id=2)
"""GLM-5.3-Flash: a KDA layer, then an indexed NoPE MLA layer whose indexer scores pools of 3 keys (its top 3 pools
and the query's own incomplete pool), then a `shared` one; three hyper-connected streams (Sinkhorn-mixed). Pools of
3 are cut by every slice edge of the uneven sequences (slices of 100, 91, 50 and 46 tokens)."""
INDEXED_FAMILIES = {"deepseek_v32": DEEPSEEK_V32, "glm_moe_dsa": GLM_5, "hy_v4": HY_V4, "dots3_note_text": DOTS3,
                    "glm5_next_text": GLM5_NEXT}
POOLED_FAMILIES = ("glm5_next_text",)
"""Families whose indexer scores pools of keys (tests/test_pooled_index.py compares its choice with transformers')."""
"""The families with indexed-attention layers (their records in ulysses_train/families.py name this table)."""
FAMILY_ARGS = {"dots3_note_text": ("--set", "model.attn_implementation=fa4")}
"""Run-config overrides a family's steps need: dots3's sliding layers take their window from FlashAttention 4's op
(its fp32 reference on CPU), as every windowed family's do."""
MARGIN = 1e-5
"""The least gap between a query's k-th and (k+1)-th visible indexer scores, relative to the scores' spread: 100
times what the trainer's rounding moves them (its logits and hidden states are within 2e-7 of the plain model's)."""


@pytest.fixture(scope="module")
def indexed_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexed")
    return {family: save_tiny_model(str(root / family), config=tiny_family_config(family, **shape))
            for family, shape in INDEXED_FAMILIES.items()}


def plain_model(model_dir):
    """transformers' model in fp32 with SDPA, or eager where its classes refuse SDPA (HY-V4's)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")


def indexed_reference(model, sequences):
    """sgd_reference over every parameter but the indexers', after checking transformers gives them no gradient."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad and ".indexer." not in n}
    result = sgd_reference(model, sequences, LR, named=named)
    indexer = [n for n, p in model.named_parameters() if ".indexer." in n]
    assert indexer and all(model.get_parameter(n).grad is None for n in indexer)
    return result


def document_sequences(samples) -> list:
    """(input ids, labels) of every packed document of `samples`, each alone (the reference's view)."""
    documents = []
    for sample in samples:
        ends = torch.as_tensor(sample["document_lengths"]).cumsum(0).tolist()
        documents += [(sample["input_ids"][:, start:end], sample["labels"][:, start:end])
                      for start, end in zip([0, *ends[:-1]], ends)]
    return documents


@pytest.mark.parametrize("family,nproc,sp,levers", [
    ("deepseek_v32", 2, 2, True), ("deepseek_v32", 4, 4, False), ("glm_moe_dsa", 4, 2, False),
    ("glm_moe_dsa", 4, 4, True), ("hy_v4", 4, 4, True), ("hy_v4", 4, 2, False), ("dots3_note_text", 4, 4, True),
    ("dots3_note_text", 4, 2, False), ("glm5_next_text", 4, 4, True), ("glm5_next_text", 4, 2, False)],
    ids=["deepseek_v32-sp2-levers", "deepseek_v32-sp4-uneven", "glm_moe_dsa-sp2xdp2", "glm_moe_dsa-sp4-uneven-levers",
         "hy_v4-sp4-uneven-levers", "hy_v4-sp2xdp2", "dots3-sp4-uneven-levers", "dots3-sp2xdp2",
         "glm5_next-sp4-uneven-levers", "glm5_next-sp2xdp2"])
def test_indexed_attention_step_equals_single_process(tmp_path, indexed_models, family, nproc, sp, levers):
    samples, result = family_step(tmp_path, indexed_models[family], nproc, sp,
                                  (*FAMILY_ARGS.get(family, ()), *(LEVERS if levers else ())), offload=levers,
                                  samples=uneven_samples(nproc // sp))
    reference = indexed_reference(plain_model(indexed_models[family]),
                                  [(s["input_ids"], s["labels"]) for s in samples])
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} sp={sp} x dp={nproc // sp}{' levers' if levers else ''}: loss rel err {loss_error:.1e}, worst "
          f"grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("family,nproc,sp,levers,control", [
    ("glm_moe_dsa", 4, 4, True, ""), ("deepseek_v32", 4, 2, False, ""), ("hy_v4", 4, 2, True, ""),
    ("dots3_note_text", 4, 2, True, ""), ("glm5_next_text", 4, 2, True, ""),
    ("deepseek_v32", 2, 2, False, "--indexed-across-documents")],
    ids=["glm_moe_dsa-sp4-levers", "deepseek_v32-sp2xdp2", "hy_v4-sp2xdp2-levers", "dots3-sp2xdp2-levers",
         "glm5_next-sp2xdp2-levers", "control-across-documents"])
def test_packed_indexed_attention_equals_each_document_run_alone(tmp_path, indexed_models, family, nproc, sp,
                                                                  levers, control):
    """Documents of 1 to 24 tokens packed into 48, 1-token documents on slice edges: a query's indexer choice and
    attention stay inside its document. The control (queries see earlier documents) differs."""
    samples = packed_samples(EDGE_DOCUMENTS, seed=5, labelled=0.7)
    result = packed_step(tmp_path, indexed_models[family], nproc, sp, samples, levers=levers,
                         extra=(*FAMILY_ARGS.get(family, ()), *((control,) if control else ())))
    reference = indexed_reference(plain_model(indexed_models[family]), document_sequences(samples))
    if control:
        err, name = worst_relative_error(result["grads"], reference[1])
        assert err > 1e-3, (control, err, name)
        return
    loss_error, grad_error = assert_step_matches(result, *reference)
    print(f"{family} packed sp={sp}: loss rel err {loss_error:.1e}, worst grad rel err {grad_error:.1e}")


@pytest.mark.parametrize("family,control", [
    ("glm_moe_dsa", "--indexer-on-local-slice"), ("glm_moe_dsa", "--latent-not-gathered"),
    ("glm_moe_dsa", "--shared-layer-dense"), ("glm_moe_dsa", "--queries-at-slice-zero"),
    ("hy_v4", "--indexed-without-sinks"), ("hy_v4", "--hc-streams-reversed"), ("dots3_note_text", "--no-window"),
    ("glm5_next_text", "--kpool-at-slice-start"), ("glm5_next_text", "--hc-streams-reversed")])
def test_negative_controls_indexed_attention_differs(tmp_path, indexed_models, family, control):
    model_dir = indexed_models[family]
    samples, result = family_step(tmp_path, model_dir, 2, 2, (*FAMILY_ARGS.get(family, ()), control),
                                  samples=uneven_samples(1))
    _, grads, _, _ = indexed_reference(plain_model(model_dir), [(s["input_ids"], s["labels"]) for s in samples])
    err, name = worst_relative_error(result["grads"], grads)
    print(f"{family} {control}: worst grad rel err {err:.2e} ({name})")
    assert err > 1e-3, (control, err, name)


def assert_image_text_release_loads_as_text_model(tmp_path, monkeypatch, config, release_class, built_class: str,
                                                  unused: str) -> None:
    """A hub-layout image-text checkpoint (`release_class` of `config`) builds as its text model `built_class`, every
    text tensor the release's language model's (and lm_head), its towers left as unused checkpoint tensors
    (weight_check.ALLOWED_UNUSED). Control: without the towers' names allowed, the load is refused in one line
    naming `unused`."""
    from ulysses_train.config import ConfigError, ModelConfig
    from ulysses_train.model import weight_check
    from ulysses_train.model.loading import build_causal_lm, load_model_config

    folder = save_tiny_model(str(tmp_path / "image_text"), config=config, model_class=release_class)
    release = release_class.from_pretrained(folder).state_dict()
    model_cfg = ModelConfig(name_or_path=folder, dtype="float32")
    loaded, _ = build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)
    assert type(loaded).__name__ == built_class
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, release[name.replace("model.", "model.language_model.", 1)], rtol=0, atol=0)
    monkeypatch.setattr(weight_check, "ALLOWED_UNUSED", {k: v for k, v in weight_check.ALLOWED_UNUSED.items()
                                                         if "tower" not in k})
    with pytest.raises(ConfigError, match=f"tensors are not used by the model .e.g. {unused}"):
        build_causal_lm(load_model_config(model_cfg), model_cfg, "sdpa", None)


def test_the_dots3_image_text_release_loads_as_its_text_model(tmp_path, monkeypatch):
    """A hub-layout dots3 checkpoint (`Dots3NoteForConditionalGeneration`: vision and audio encoders beside the
    language model) builds as its text model, `Dots3NoteForCausalLM` (transformers maps the names); the text model
    itself is the exactness test's."""
    from transformers import AutoConfig
    from transformers.models.dots3_note.modeling_dots3_note import Dots3NoteForConditionalGeneration

    from helpers import TINY_SHAPE

    vision = dict(hidden_size=32, num_attention_heads=2, intermediate_size=32, moe_intermediate_size=16,
                  adapter_in_dim=32, adapter_out_dim=64)
    audio = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=32,
                 adapter_input_size=32, adapter_out_dim=64)
    config = AutoConfig.for_model("dots3_note", text_config={**TINY_SHAPE, **DOTS3}, vision_config=vision,
                                  audio_config=audio)
    assert_image_text_release_loads_as_text_model(tmp_path, monkeypatch, config, Dots3NoteForConditionalGeneration,
                                                  "Dots3NoteForCausalLM", "audio_encoder")


def captured_indexer_calls(model, ids) -> list:
    """(indexer, its inputs, its chosen keys) of every call of the plain model's indexers on `ids`."""
    calls = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer"):
            module.register_forward_hook(lambda m, args, out: calls.append((m, args, out)))
    model(input_ids=ids)
    return calls


@pytest.mark.parametrize("family", sorted(set(INDEXED_FAMILIES) - set(POOLED_FAMILIES)))
def test_the_indexer_chooses_as_transformers(indexed_models, family):
    """indexed_kernels.select_keys on the inputs transformers' indexer got (keys from two halves of the sequence,
    as two ranks gather them, and queries in chunks of 7) chooses the same keys, index for index; and every
    choice is kept apart from the next key by MARGIN (module docstring). Control: a choice from the first half's
    keys alone differs."""
    from ulysses_train.model.mixers import indexed_kernels
    from ulysses_train.model.mixers.indexed_attention import indexer_form

    model = plain_model(indexed_models[family])
    gaps, controls, eligible, other_form = [], 0, 0, 0
    for ids in trained_sequences():
        for indexer, (hidden, q_resid, (cos, sin), *_), want in captured_indexer_calls(model, ids):
            form = indexer_form(indexer)
            half = hidden.shape[1] // 2
            keys = torch.cat([indexed_kernels.index_keys(indexer, form, hidden[:, part], cos[:, part], sin[:, part])
                              for part in (slice(0, half), slice(half, None))], dim=1)
            queries = torch.arange(hidden.shape[1])
            budget, indexed_kernels.INDEX_SCORE_BUDGET = indexed_kernels.INDEX_SCORE_BUDGET, 7 * 4 * 16 * len(queries)
            try:
                got = indexed_kernels.select_keys(indexer, form, hidden, q_resid, keys, cos, sin, queries, None)
            finally:
                indexed_kernels.INDEX_SCORE_BUDGET = budget
            visible = indexed_kernels.visible_keys(queries, len(queries), None)
            assert_same_visible_choice(got[0], want[0].long(), visible)
            with torch.no_grad():
                scores = indexed_kernels.index_scores(indexer, form, hidden, q_resid, keys, cos, sin)[0]
            gaps.append(least_gap(scores, visible, indexer.index_topk))
            if len(queries) > 2 * indexer.index_topk:  # the control: the second half's keys not gathered
                eligible += 1
                control = keys.clone()
                control[:, half:] = 0.0
                wrong = indexed_kernels.select_keys(indexer, form, hidden, q_resid, control, cos, sin, queries, None)
                controls += not torch.equal(wrong, got)
            if form.rope_last:  # the control: HY-V4's indexer read in GLM-5's form (its first channels rotated)
                plain = indexed_kernels.IndexerForm(form.rope)
                glm_keys = indexed_kernels.index_keys(indexer, plain, hidden, cos, sin)
                other_form += not torch.equal(
                    indexed_kernels.select_keys(indexer, plain, hidden, q_resid, glm_keys, cos, sin, queries, None), got)
    print(f"{family}: least gap between a chosen and the next key {min(gaps):.1e} of the scores' spread")
    assert min(gaps) > MARGIN and controls == eligible >= 2
    assert other_form > 0 or not form.rope_last


def trained_sequences() -> list:
    """Every token sequence the steps here train: the uneven sequences and each packed document alone."""
    packed = document_sequences(packed_samples(EDGE_DOCUMENTS, seed=5, labelled=0.7))
    return [sample["input_ids"] for sample in uneven_samples(2)] + [ids for ids, _ in packed]


def assert_same_visible_choice(got, want, visible):
    """Each query's chosen keys it may see are the same set (the rest are keys it cannot see, masked either way)."""
    for row, (mine, theirs) in enumerate(zip(got, want)):
        mine, theirs = mine[visible[row, mine]], theirs[visible[row, theirs]]
        assert sorted(mine.tolist()) == sorted(theirs.tolist()), row


def least_gap(scores, visible, top: int) -> float:
    """The smallest gap between a query's top-th and next visible score, over queries that see more than `top`
    keys, relative to the spread of all visible scores."""
    gaps = [float(row[visible[i]].topk(top + 1).values[-2:].diff().abs()) for i, row in enumerate(scores)
            if int(visible[i].sum()) > top]
    return min(gaps) / float(scores[visible].std()) if gaps else float("inf")  # no query chooses among more


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_the_reference_sparse_attention_backward_is_its_forwards_gradient(monkeypatch, with_sinks):
    """indexed_kernels.SparseLatentAttention's own backward (chunks recomputed from the saved query and keys)
    against autograd's numerical gradient in fp64, in chunks of 3 queries, with unseen chosen keys, and with HY-V4's
    attention sinks (a logit per head in the softmax, no value); its forward against the plain formula (the chosen
    keys gathered, a softmax over the seen ones and the sink, the sink's share dropped, as transformers' eager
    attention does)."""
    from ulysses_train.model.mixers import indexed_kernels

    monkeypatch.setattr(indexed_kernels, "ATTENTION_PICK_BUDGET", 1)  # one query a chunk
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 7, 2, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    keys = torch.randn(1, 9, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    sinks = torch.tensor([0.7, -0.4], dtype=torch.float64, requires_grad=True) if with_sinks else None
    chosen = torch.stack([torch.randperm(9, generator=gen)[:4] for _ in range(7)])[None]
    visible = chosen <= torch.arange(7)[None, :, None] + 1
    visible[..., 0] = True
    run = lambda q, k, s=None: indexed_kernels.SparseLatentAttention.apply(q, k, chosen, visible, 0.3, 3, s)  # noqa: E731
    assert torch.autograd.gradcheck(run, (query, keys, sinks) if with_sinks else (query, keys))
    picked = keys[0][chosen[0]]  # [t, k, D]
    scores = torch.einsum("thd,tkd->thk", query[0], picked) * 0.3
    scores = scores.masked_fill(~visible[0][:, None, :], float("-inf"))
    if with_sinks:
        scores = torch.cat([scores, sinks[None, :, None].expand(7, 2, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :4]
    torch.testing.assert_close(run(query, keys, sinks)[0], torch.einsum("thk,tkr->thr", probs, picked[..., :3]))


def test_each_indexer_projection_runs_once_a_layer_whatever_the_chunks(indexed_models, monkeypatch):
    """The indexer's projections run once per layer forward, not once per chunk of queries: each module call is an
    entry in ZeRO-3's trace, which its first traced step scans once per entry (a 262,144-token HY-V4 step took 242
    s against 33 s for the step before it with a call per chunk: benchmarks/RESULTS.md). The chunks are made many
    here; the control is that they are."""
    from collections import Counter

    from ulysses_train.model.mixers import indexed_kernels
    from ulysses_train.model.mixers.indexed_attention import install_indexed_attention
    from ulysses_train.sequence_parallel import SequenceParallel

    model = plain_model(indexed_models["glm_moe_dsa"])
    install_indexed_attention(model, SequenceParallel(), "")
    calls, chunks = Counter(), []
    for name, module in model.named_modules():
        if ".indexer." in name:
            module.register_forward_hook(lambda m, args, out, n=name: calls.update([n]))
    query_chunks = indexed_kernels.query_chunks
    monkeypatch.setattr(indexed_kernels, "INDEX_SCORE_BUDGET", 4 * 16 * 200 * 7)  # 7 queries a chunk
    monkeypatch.setattr(indexed_kernels, "query_chunks", lambda *a: chunks.append(query_chunks(*a)) or chunks[-1])
    model(input_ids=uneven_samples(1)[0]["input_ids"], use_cache=False)
    assert calls and set(calls.values()) == {1}, calls
    assert len(chunks[0]) >= 20  # the control: the queries did run in many chunks


def test_lora_dropout_on_the_latent_projection_is_refused():
    """kv_b_proj runs on an identity matrix in the absorbed form, so LoRA's dropout there would drop rows of its
    weight: refused in one line naming the fix. Control: dropout 0 installs."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ulysses_train.errors import ConfigError
    from ulysses_train.model.mixers.indexed_attention import install_indexed_attention
    from ulysses_train.sequence_parallel import SequenceParallel

    base = AutoModelForCausalLM.from_config(tiny_family_config("glm_moe_dsa", **GLM_5))
    for dropout, refused in ((0.1, True), (0.0, False)):
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_dropout=dropout, target_modules=["kv_b_proj"]))
        if refused:
            with pytest.raises(ConfigError, match="^model.lora has dropout on kv_b_proj.*Fix: model.lora dropout 0"):
                install_indexed_attention(model.base_model.model, SequenceParallel(), "")
        else:
            assert "2 indexed-attention layers" in install_indexed_attention(model.base_model.model,
                                                                             SequenceParallel(), "")


def test_the_gpu_check_script_runs_on_cpu(tmp_path):
    """benchmarks/indexed_check.py's plumbing at GLM-5.2's released widths, one tiny length in fp32 on CPU: the
    package's layer equals transformers' (every gradient compared, none missing)."""
    from helpers import load_script

    script = load_script("benchmarks/indexed_check.py")
    result = script.main(["--device", "cpu", "--json", str(tmp_path / "rows.json")])
    fp32 = result["rows"][0]["fp32"]
    assert fp32["output"] < 1e-5 and fp32["grad_worst"] < 1e-4 and fp32["grads_compared"] == 7  # the MLA projections and norms; the indexer is frozen
    assert fp32["grads_missing"] == []
