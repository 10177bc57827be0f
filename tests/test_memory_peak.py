"""diagnostics/memory_peak.py on hand-made allocator histories (the shape torch.cuda.memory._snapshot() gives),
whose peak and live blocks are counted by hand."""
from ulysses_train.constants import GIB
from ulysses_train.diagnostics.memory_peak import allocations_at_peak, site_of

MODEL = [{"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
         {"filename": "/x/site-packages/transformers/models/gemma4/modeling_gemma4.py", "line": 7, "name": "forward"}]
OURS = [{"filename": "/x/torch/autograd/__init__.py", "line": 3, "name": "backward"},
        {"filename": "/repo/ulysses_train/training/step.py", "line": 9, "name": "train_step"},
        {"filename": "/repo/scripts/bench_point.py", "line": 2, "name": "run_steps"}]


def snapshot(trace: list, alive_now: list) -> dict:
    """A snapshot of one device: `trace` its history, `alive_now` the block sizes in use when it was taken."""
    blocks = [{"size": int(gib * GIB), "state": "active_allocated"} for gib in alive_now]
    return {"segments": [{"device": 0, "total_size": sum(b["size"] for b in blocks), "blocks": blocks}],
            "device_traces": [trace]}


def alloc(addr, gib, frames=None):
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": frames or []}


def free(addr, gib):
    return {"action": "free_completed", "addr": addr, "size": int(gib * GIB)}


def test_the_peak_holds_the_blocks_alive_then_and_what_was_alive_before_recording():
    # before recording: 2 GiB (at 0xA, freed in the trace) and 3 GiB (kept); in the trace: q 4 GiB from the model,
    # a 1 GiB marker, the backward's 5 GiB, free q, 0.5 GiB. By hand: levels 9, 10, 15 (peak: 5 + 4 + 1 + 5),
    # then 11, 9 (0xA freed), 9.5; at the peak 5 GiB from before recording are alive.
    trace = [alloc(1, 4, MODEL), alloc(2, 1), alloc(3, 5, OURS), free(1, 4), free(0xA, 2), alloc(4, 0.5, MODEL)]
    peak = allocations_at_peak(snapshot(trace, [3, 1, 5, 0.5]), markers=[{"name": "backward", "addr": 2}])
    assert abs(peak["peak_gib"] - 15) < 1e-9 and peak["event_index"] == 2
    assert abs(peak["alive_before_recording_gib"] - 5) < 1e-9
    assert peak["phase"] == "backward"
    sites = {s["site"]: s["gib"] for s in peak["by_site"]}
    assert sites == {"ulysses_train/training/step.py:9 train_step": 5,
                     "transformers/models/gemma4/modeling_gemma4.py:7 forward": 4, "no stack": 1}
    assert [b["gib"] for b in peak["largest_blocks"]] == [5, 4, 1]
    assert peak["largest_blocks"][0]["stack"] == ["ulysses_train/training/step.py:9 train_step", "scripts/bench_point.py:2 run_steps"]


def test_a_block_from_before_recording_freed_before_the_peak_is_not_counted_in_it():
    # control for the backwards derivation: the same blocks, but 0xA (2 GiB from before) is freed first, so the
    # peak is 3 + 4 + 1 + 5 = 13 GiB with 3 GiB from before recording
    trace = [free(0xA, 2), alloc(1, 4, MODEL), alloc(2, 1), alloc(3, 5, OURS), free(1, 4)]
    peak = allocations_at_peak(snapshot(trace, [3, 1, 5]))
    assert abs(peak["peak_gib"] - 13) < 1e-9 and abs(peak["alive_before_recording_gib"] - 3) < 1e-9
    assert peak["phase"] is None


def test_a_marker_address_reused_earlier_does_not_move_the_phase():
    # the allocator gave the marker's address to a short-lived tensor before the marker: the phase starts at the
    # marker's own (last) alloc, after the peak here
    trace = [alloc(7, 1), free(7, 1), alloc(1, 4, MODEL), alloc(7, 0.001)]
    peak = allocations_at_peak(snapshot(trace, [4, 0.001]), markers=[{"name": "loss", "addr": 7}])
    assert peak["event_index"] == 3 and peak["phase"] == "loss"
    early = allocations_at_peak(snapshot(trace[:3] + [free(1, 4), alloc(7, 0.001)], [0.001]),
                                markers=[{"name": "loss", "addr": 7}])
    assert early["event_index"] == 2 and early["phase"] is None  # the peak came before the marker


def test_sites_skip_torch_frames_and_name_the_first_line_outside():
    assert site_of(MODEL)[0] == "transformers/models/gemma4/modeling_gemma4.py:7 forward"
    assert site_of(MODEL[:1])[0] == "torch internals" and site_of([])[0] == "no stack"
    # a kept-attention layer's ops all pass through the dispatch mode: the model's line is named, not the mode's
    dispatch = {"filename": "/repo/ulysses_train/model/recompute.py", "line": 104, "name": "__torch_dispatch__"}
    assert site_of([dispatch, *MODEL])[0] == "transformers/models/gemma4/modeling_gemma4.py:7 forward"
    other = {**dispatch, "name": "checkpoint_layer"}  # the same file's other functions are code, not plumbing
    assert site_of([other, *MODEL])[0] == "ulysses_train/model/recompute.py:104 checkpoint_layer"
