"""Facts every part of the package shares, each defined once."""

IGNORE_INDEX = -100
"""The label of a position that adds nothing to the loss (torch's cross_entropy and Hugging Face use -100)."""

GIB = 2**30

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""The parameter dtypes a run may choose (`model.dtype`), with their size."""
