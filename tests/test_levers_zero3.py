"""The memory levers under 2-process ZeRO-3 (gloo): sp=2 with every lever equals the single-process reference
(loss, gradients), TiledMLP fetches each MLP's projections once per pass (the negative control without leaf
modules fetches them per tile), and dp=2 with uneven lengths agrees on the tile count (test_levers.py: the
same levers in one process)."""
import os

import pytest
import torch
from helpers import assert_step_matches, reference_step, run_workers, save_tiny_model, write_ds_config
from test_levers import LAYERS

LR = 0.1
LEVER_WORKER = os.path.join(os.path.dirname(__file__), "lever_worker.py")

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"), num_hidden_layers=LAYERS)


def lever_step(tmp_path, model_dir, samples, sp, keep_attention, offload_fraction=1.0, attn="sdpa", extra=()):
    data = str(tmp_path / "data.pt")
    torch.save(samples, data)
    ds = write_ds_config(str(tmp_path / "ds.json"), offload_activations=True)
    out = str(tmp_path / "out.pt")
    run_workers(2, ["--model-dir", model_dir, "--data", data, "--ds-config", ds, "--out", out, "--lr", str(LR),
                    "--set", f"parallel.sequence_parallel_size={sp}",
                    "--set", f"model.keep_attention_fraction={keep_attention}",
                    "--set", f"model.activation_offload_fraction={offload_fraction}",
                    "--set", f"model.attn_implementation={attn}", *extra],
                script=LEVER_WORKER)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    return torch.load(out), ranks


def assert_matches_reference(model_dir, samples, result):
    assert_step_matches(result, *reference_step(model_dir, samples, LR))


def make_sample(length, seed):
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("attn", ["sdpa", "fa4"])
def test_sp2_step_with_all_levers_equals_single_process(tmp_path, model_dir, attn):
    """sp=2 through the Ulysses all-to-all: offload, attention kept in layers 0 and 2, 3 MLP tiles; with SDPA
    and with the FlashAttention 4 op (its CPU reference kernel here; the reference model runs SDPA)."""
    samples = [make_sample(300, seed=5)]
    result, ranks = lever_step(tmp_path, model_dir, samples, sp=2, keep_attention=0.7, attn=attn)
    assert_matches_reference(model_dir, samples, result)
    for rank in ranks:
        assert rank["counts"].get("fa4", 0) == (4 if attn == "fa4" else 0)  # the op really ran (no fallback)
        assert rank["agreed"] == 7  # proposals 3 and 7
        assert rank["num_tiles"] == 3  # ceil(150 local tokens / hidden 64)
        # attention: 3 forward + 1 recompute (layer 1); the other kept layers are not recomputed
        assert rank["counts"]["attention"] == 4
        # all-to-alls: q, k, v and output in forward, again in every recompute (kept layers included:
        # attention's backward needs the gathered q, k, v), and once more in backward -> 12 per layer
        assert rank["counts"]["all_to_all"] == 12 * LAYERS
        assert rank["offload"]["fetched_on_demand"] == 0 and rank["offload"]["prefetched"] == 4
        assert_mlp_fetched_once_per_pass(rank)


def assert_mlp_fetched_once_per_pass(rank):
    """ZeRO-3 gathers a tiled MLP's weights once per pass (forward, recompute, backward), whatever the tile
    count: its projections never join ZeRO-3's module trace (model/tiling.py: why the trace must stay short).
    The only Linear fetches are attention's four projections, once per pass."""
    fetches = rank["zero3_fetches"]
    assert fetches["TiledQwen3MLP"] == 3 * LAYERS
    assert fetches["Linear"] == 4 * 3 * LAYERS


def test_negative_control_without_leaf_modules_every_tile_fetches_the_projections(tmp_path, model_dir):
    """The same sp=2 step with the tiled MLPs left as ordinary ZeRO-3 modules: still exact, but each of the
    3 tiles fetches the 3 projections in every one of 4 passes (forward, recompute, the tile's forward again
    and its backward), so the check above would fail."""
    samples = [make_sample(300, seed=5)]
    result, ranks = lever_step(tmp_path, model_dir, samples, sp=2, keep_attention=0.7,
                               extra=["--tiles-as-zero3-modules"])
    assert_matches_reference(model_dir, samples, result)
    assert ranks[0]["zero3_fetches"]["Linear"] == 4 * 3 * LAYERS + 3 * 3 * 4 * LAYERS
    with pytest.raises(AssertionError):
        assert_mlp_fetched_once_per_pass(ranks[0])


def test_dp2_uneven_lengths_agree_on_tiles_and_equal_single_process(tmp_path, model_dir):
    """Data parallel with 300 and 12 tokens: both ranks run ceil(300 / 64) = 5 tiles (the short one pads),
    so ZeRO-3's weight gathers match and nothing deadlocks."""
    samples = [make_sample(300, seed=6), make_sample(12, seed=7)]
    # model.activation_offload_fraction through build_engine: 0.34 of 3 layers offloads layer 0 only
    result, ranks = lever_step(tmp_path, model_dir, samples, sp=1, keep_attention=1.0, offload_fraction=0.34)
    assert_matches_reference(model_dir, samples, result)
    assert [r["local_tokens"] for r in ranks] == [300, 12]
    assert [r["num_tiles"] for r in ranks] == [5, 5]
    assert [r["agreed"] for r in ranks] == [7, 7]
    assert all(r["counts"]["attention"] == LAYERS for r in ranks)
    # layer 0's input, attention output and log-sum-exp, prefetched; layers 1 and 2 stay on the device
    assert [r["offload"]["prefetched"] for r in ranks] == [3, 3]
    for rank in ranks:  # 5 tiles here, 3 in the sp=2 test: the same fetches
        assert_mlp_fetched_once_per_pass(rank)
