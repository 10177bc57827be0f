"""Train a causal LM on very long sequences.

    deepspeed --num_gpus 8 scripts/train.py --config configs/qwen3_8b_1m_8gpu.yaml
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 scripts/train.py          # the embedded demo, on CPU
    torchrun --standalone --nproc_per_node 2 scripts/train.py --set train.steps=50
    srun --ntasks-per-node 8 python scripts/train.py --config ...       # ranks from SLURM variables
"""
from ulysses_train.cli import main, run_script

if __name__ == "__main__":
    run_script(main)
