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
