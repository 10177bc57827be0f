"""ulysses-train: fine-tune Hugging Face causal LMs on single sequences of 256K to 1M+ tokens."""
import os
import runpy

from setuptools import find_packages, setup

# the GPU kernels at the versions measured together: one definition, shared with the trainer's kernel checks
PINS = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ulysses_train", "kernel_pins.py"))

setup(
    name="ulysses-train",
    version="0.1.0",
    description="Long-context fine-tuning with DeepSpeed ZeRO-3 and Ulysses sequence parallelism",
    packages=find_packages(include=["ulysses_train", "ulysses_train.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19",
        "transformers>=5.17",
        "accelerate",
        "datasets",
        "einops",
        "pyyaml",
        "tqdm",
        "safetensors",
        "psutil",
        "xxhash",  # content digests of corpus files (data/fingerprint.py); datasets needs it too
    ],
    extras_require={
        # pytest-xdist: scripts/test.sh runs the suite's files on two workers (a 2-core machine idles ~25% on one)
        "test": ["pytest", "pytest-xdist", "tokenizers", "matplotlib", "tensorboard", "peft", "kernels"],
        # DeepSpeed's monitor sections in the DeepSpeed JSON: "tensorboard" (below), "wandb" (pip install wandb)
        "tensorboard": ["tensorboard"],
        # model.lora
        "lora": ["peft"],
        # model.attn_implementation: fa4 (Hopper or newer GPUs), pinned: flash-attn-4 has only pre-releases
        PINS["FA4_EXTRA"]: PINS["fa4_extra"](),
        # every GPU kernel the trainer uses, at the versions measured together (ulysses_train/kernel_pins.py)
        PINS["GPU_EXTRA"]: PINS["gpu_extra"](),
    },
)
