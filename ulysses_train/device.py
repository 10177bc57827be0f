"""Which device a run trains on: one rule for every part that places tensors or picks kernels.

A run trains on CUDA when a GPU is there and DeepSpeed's accelerator is not set to another: `DS_ACCELERATOR=cpu`
runs on the CPU even on a GPU machine (gloo, as many processes as asked, the CPU reference kernels), which is
how the README's demo command runs anywhere.
"""
from __future__ import annotations

import os

import torch


def cuda_training() -> bool:
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"


def collective_device() -> torch.device:
    """Where small tensors for collectives live: the GPU under NCCL, the host under gloo."""
    return torch.device("cuda") if cuda_training() else torch.device("cpu")
