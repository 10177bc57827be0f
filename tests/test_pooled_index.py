"""GLM-5.3-Flash's pieces beyond the exactness test (tests/test_indexed_attention.py trains it under sp): its KPool
indexer's choice against transformers' own, its image-text release built as the package's text model, and what is
refused in one line.

Near-ties, as for the token indexer: the trainer's hidden states differ from the plain model's by fp32 rounding, so a
query whose k-th and (k+1)-th visible pool scores were closer than that could pick another pool. The choice test
compares the package's pools with transformers' on the same inputs, query for query, and checks that on the
sequences the steps train every query's k-th and (k+1)-th visible pool scores are apart by more than MARGIN of the
scores' spread."""
import pytest
import torch
from helpers import TINY_SHAPE, save_tiny_model
from test_indexed_attention import (GLM5_NEXT, MARGIN, assert_image_text_release_loads_as_text_model,  # noqa: F401
                                    indexed_models, plain_model, trained_sequences)

FAMILY = "glm5_next_text"


def captured_pooled_calls(model, ids) -> list:
    """(indexer, its keyword inputs, its chosen tokens) of every call of the plain model's indexers on `ids`."""
    calls = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer"):
            module.register_forward_hook(lambda m, args, kwargs, out: calls.append((m, kwargs, out)), with_kwargs=True)
    model(input_ids=ids)
    return calls


def pool_scores(indexer, form, hidden, q_resid, keys_and_gates):
    """Every query's scores of every complete pool [T, n] and which pools it sees [T, n]."""
    from ulysses_train.model.mixers import indexed_kernels, pooled_index

    total = hidden.shape[1]
    tokens = pooled_index.complete_pools(total, indexer.index_kpool, None, hidden.device)
    keys = pooled_index.pool_keys(indexer, keys_and_gates, tokens)
    with torch.no_grad():
        scores = indexed_kernels.scores_of(form, indexer.softmax_scale,
                                           indexed_kernels.index_queries(indexer, form, q_resid, None, None),
                                           indexed_kernels.head_weights(indexer, form, hidden), keys)[0]
    return scores, tokens[:, -1][None, :] <= torch.arange(total)[:, None]


def least_pool_gap(scores, visible, top: int) -> float:
    """The smallest gap between a query's top-th and next visible pool score (queries seeing more than `top`),
    relative to the spread of all visible scores."""
    gaps = [float(row[visible[i]].topk(top + 1).values[-2:].diff().abs()) for i, row in enumerate(scores)
            if int(visible[i].sum()) > top]
    return min(gaps) / float(scores[visible].std()) if gaps else float("inf")


def same_tokens(got, want) -> bool:
    """Each query attends to the same set of tokens (-1: an empty place)."""
    return all(sorted(a[a >= 0].tolist()) == sorted(b[b >= 0].tolist()) for a, b in zip(got, want))


def test_the_pooled_indexer_chooses_as_transformers(indexed_models, monkeypatch):
    """pooled_index.select_pooled_keys on the inputs transformers' indexer got (index keys and gate scores from two
    halves of the sequence, as two ranks gather them; queries in chunks of 7) attends each query to the same tokens,
    its top pools and its own incomplete one; every choice is kept apart from the next pool by MARGIN. Control: pools
    counted from the second half's start (a pool cut at the edge) change the choice."""
    from ulysses_train.model.mixers import indexed_kernels, pooled_index
    from ulysses_train.model.mixers.indexed_attention import indexer_form

    model = plain_model(indexed_models[FAMILY])
    monkeypatch.setattr(pooled_index, "INDEX_SCORE_BUDGET", 7 * 4 * 8 * 100)
    gaps, cut_differs, calls = [], 0, 0
    for ids in trained_sequences():
        for indexer, inputs, want in captured_pooled_calls(model, ids):
            hidden, q_resid, form = inputs["hidden_states"], inputs["q_resid"], indexer_form(indexer)
            half, queries = hidden.shape[1] // 2, torch.arange(hidden.shape[1])
            keys = torch.cat([indexed_kernels.index_keys(indexer, form, hidden[:, part], None, None)
                              for part in (slice(0, half), slice(half, None))], dim=1)
            got = pooled_index.select_pooled_keys(indexer, form, hidden, q_resid, keys, queries, None)
            assert same_tokens(got[0], want[0].long())
            gaps.append(least_pool_gap(*pool_scores(indexer, form, hidden, q_resid, keys),
                                       indexer.index_topk // indexer.index_kpool))
            if half % indexer.index_kpool:  # the control: pools restart at the second half
                with monkeypatch.context() as patched:
                    patched.setattr(pooled_index, "document_starts",
                                    lambda total, documents, device: (torch.arange(total) >= half) * half)
                    cut = pooled_index.select_pooled_keys(indexer, form, hidden, q_resid, keys, queries, None)
                cut_differs += not same_tokens(cut[0], want[0].long())
            calls += 1
    print(f"{FAMILY}: least gap between a chosen and the next pool {min(gaps):.1e} of the scores' spread")
    assert calls >= 10 and min(gaps) > MARGIN and cut_differs >= 2


def test_the_glm5_next_image_text_release_loads_as_its_text_model(tmp_path, monkeypatch):
    """A hub-layout GLM-5.3-Flash checkpoint (`Glm5NextForConditionalGeneration`: a vision tower beside the language
    model) builds as the package's text model (`Glm5NextTextForCausalLM`, model/text_head.py: transformers has none),
    its vision tower left unused (control: refused without its names allowed)."""
    from transformers import AutoConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                  projection_intermediate_size=32, patch_size=2, temporal_patch_size=1, image_size=8)
    config = AutoConfig.for_model("glm5_next", text_config={**TINY_SHAPE, **GLM5_NEXT}, vision_config=vision)
    assert_image_text_release_loads_as_text_model(tmp_path, monkeypatch, config, Glm5NextForConditionalGeneration,
                                                  "Glm5NextTextForCausalLM", "model.visual")


def test_what_glm5_next_configs_are_refused_in_one_line():
    """A pooled indexer without its tail (a query before its document's first pool would see no key) is refused in
    one line; the release's head_dim of 0 passes where the attention is latent (its widths are the qk_nope/qk_rope
    and v head dims), and is refused where not (the control of the width rule)."""
    from types import SimpleNamespace

    from helpers import tiny_family_config
    from ulysses_train.errors import ConfigError
    from ulysses_train.model.config_fields import width_problem
    from ulysses_train.model.loading import check_supported_architecture

    check_supported_architecture(tiny_family_config(FAMILY, **GLM5_NEXT, head_dim=0), allow_untested=False)
    with pytest.raises(ConfigError, match="index_kpool_always_select_tail false leaves the first 2 queries of each "
                                          "document no key to attend to.*Fix: index_kpool_always_select_tail true"):
        check_supported_architecture(tiny_family_config(FAMILY, **GLM5_NEXT, index_kpool_always_select_tail=False),
                                     allow_untested=False)
    assert width_problem(SimpleNamespace(head_dim=0, kv_lora_rank=16)) == ""
    assert width_problem(SimpleNamespace(head_dim=0)) == "head_dim=0 must be a whole number > 0"


def test_the_indexer_loss_is_refused_for_a_pooled_indexer():
    """No KL target over pools is defined, so model.indexer_loss_coef > 0 is refused in one line (control: 0 passes)."""
    from helpers import tiny_family_config
    from ulysses_train.errors import ConfigError
    from ulysses_train.model.mixers.indexed_attention import check_indexer_loss

    config = tiny_family_config(FAMILY, **GLM5_NEXT)
    check_indexer_loss(config, 0.0)
    with pytest.raises(ConfigError, match="scores pooled keys .index_kpool=3., for which no indexer loss is built"):
        check_indexer_loss(config, 0.1)
