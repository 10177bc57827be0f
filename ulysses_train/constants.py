"""Facts every part of the package shares, each defined once."""

IGNORE_INDEX = -100
"""The label of a position that adds nothing to the loss (torch's cross_entropy and Hugging Face use -100)."""

GIB = 2**30

LOSS_CHUNK_ROWS = 1024
"""Rows per chunk of the fused chunked loss (`loss.chunk_rows`). Each chunk's weight-gradient GEMM reads and writes
the whole fp32 vocab x hidden accumulator, so fewer, larger chunks cost less: on an H200 at 131,072 rows of
Qwen3-4B's lm_head the loss takes 1.29 s at 256 rows, 0.86 s at 1,024 with the same peak memory, and 0.81 s at
2,048 with 0.7 GiB more (benchmarks/RESULTS.md, "The loss's chunk size")."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""The parameter dtypes a run may choose (`model.dtype`), with their size."""

REUSE_DISTANCE_LAYERS = 2
"""`zero_optimization.stage3_max_reuse_distance: auto` (or absent) becomes this many decoder layers' parameters.

ZeRO-3 keeps a gathered parameter instead of releasing it when the module trace shows it used again within
that many parameters. The reuse worth catching is a layer's recompute followed at once by that layer's backward:
at most two layers' parameters apart. DeepSpeed's default (1e9) spans 5 layers of Qwen3-8B but 66 of Qwen3-0.6B,
and DeepSpeed decides each release by scanning the trace ahead over that distance once per trace entry, in the
first step that uses the trace (then cached): at Qwen3-0.6B / 64K tokens that step took 2.6 s longer than the
others (benchmarks/RESULTS.md, 'The slow second step')."""
