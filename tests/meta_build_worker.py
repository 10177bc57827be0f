"""One rank with a ZeRO-3 `HfDeepSpeedConfig` alive, as in a process that has built an engine (bench plans its rows
then): LoRA's adapter count, which builds the model on the meta device (architecture.causal_lm_on_meta), and the
same meta build through transformers' `from_config`, which enters DeepSpeed's zero.Init there and fails (the
negative control). Prints one JSON line.

    python tests/meta_build_worker.py MODEL_DIR LORA_JSON
"""
import json
import sys

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from ulysses_train.model.lora import lora_parameter_count


def main(model_dir: str, lora: dict) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    config = AutoConfig.from_pretrained(model_dir)
    alive = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    count = lora_parameter_count(config, lora)
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
        failure = ""
    except NotImplementedError as error:  # "Cannot copy out of meta tensor; no data!"
        failure = str(error)
    print(json.dumps({"adapters": count, "from_config_failure": failure, "zero3": alive.is_zero3()}))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
