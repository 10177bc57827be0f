"""The one home of sequence parallelism (ulysses_train/sequence_parallel.py): without sp it is a no-op object (so
single-GPU code runs the same lines), and no module exchanges through DeepSpeed's private all-to-all any more.

Its exchanges under sp are checked where they matter, against the plain transformers model: the multi-process
exactness tests of the linear mixers (tests/test_linear_hybrids.py), the router loss (test_router_balance.py) and
the probes (test_retrieval_probes.py); the emulation's loop-back of its all-to-all in test_emulate.py."""
import ast
import os

import torch

from helpers import REPO
from ulysses_train.sequence_parallel import SequenceParallel

PRIVATE_EXCHANGE = "_dim_zero_all_to_all"
"""DeepSpeed's private differentiable all-to-all, which the Gated DeltaNet and Kimi Delta exchanges called before."""


def names_used(source: str) -> set:
    """Every identifier the code uses: names, attributes, imported names (not docstrings or comments)."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.add(node.name.split(".")[-1])
    return used


def modules_using(root: str, name: str) -> list:
    """The .py files under `root` whose code uses `name`, relative to root."""
    found = []
    for folder, _, files in os.walk(root):
        for file in sorted(files):
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path, encoding="utf-8") as handle:
                    if name in names_used(handle.read()):
                        found.append(os.path.relpath(path, root))
    return sorted(found)


def test_without_sp_the_exchanges_return_their_input_and_the_sum_leaves_the_tensor():
    """SequenceParallel.from_group(None) is size 1, rank 0, no group; its exchanges hand back what they were
    given (the same tensors: no copy, no collective, and no process group needed) and its sum changes nothing."""
    single = SequenceParallel.from_group(None)
    assert single == SequenceParallel() and (single.group, single.size, single.rank) == (None, 1, 0)
    parts = [torch.randn(1, 6, 4, 3), torch.randn(1, 6, 4)]
    shards = single.to_head_shards(parts)
    assert len(shards) == 2 and all(a is b for a, b in zip(shards, parts))
    whole = torch.randn(1, 6, 4, 3)
    assert single.to_sequence_shards(whole) is whole
    totals = torch.tensor([1.0, 2.0, 3.0])
    assert single.sum(totals) is totals and totals.tolist() == [1.0, 2.0, 3.0]
    assert not torch.distributed.is_initialized()


def test_no_module_exchanges_through_deepspeeds_private_all_to_all(tmp_path):
    """The package's code never uses DeepSpeed's private `_dim_zero_all_to_all` (sequence_parallel.py exchanges
    through torch's public differentiable all-to-all). Negative control: the same scan finds it in a planted
    module that imports and calls it, and ignores a docstring that only names it."""
    assert modules_using(os.path.join(REPO, "ulysses_train"), PRIVATE_EXCHANGE) == []
    (tmp_path / "planted.py").write_text("from deepspeed.sequence.layer import _dim_zero_all_to_all\n\n\n"
                                         "def exchange(group, x):\n    return _dim_zero_all_to_all(group, x)\n")
    (tmp_path / "mentions.py").write_text('"""Once exchanged through _dim_zero_all_to_all."""\n')
    assert modules_using(str(tmp_path), PRIVATE_EXCHANGE) == ["planted.py"]
