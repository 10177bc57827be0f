"""The DeepSpeed JSON: read the user's file, derive the values that follow from the run, check the rest.

The user's file is never rewritten. Values that follow from the run layout (batch sizes, precision,
sequence_parallel_size) are filled in where the file says "auto" or leaves them out, and the final
merged dict is what the trainer logs and saves next to the checkpoints. A value that contradicts the
run is an error that names the key, not a silent override.
"""
from __future__ import annotations

import copy
import json
import os

from ulysses_train.config import ConfigError
from ulysses_train.constants import REUSE_DISTANCE_LAYERS
from ulysses_train.parallel.layout import ParallelDims
from ulysses_train.training.run_folder import MONITOR
from ulysses_train.user_input import one_line

# the repository: the folder above the package (ulysses_train/training/ds_config.py -> the folder holding ds_configs/)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_path(path: str) -> str:
    """A path as given (a config file's relative paths are already made relative to its folder, see
    config.load_config), or relative to the repository root, so `ds_configs/zero3.json` works from any folder,
    also for `python /path/to/scripts/train.py` started elsewhere."""
    if os.path.isfile(path):
        return path
    candidate = os.path.join(REPO_ROOT, path)
    if os.path.isfile(candidate):
        return candidate
    if os.path.isdir(path) or os.path.isdir(candidate):
        raise ConfigError(f"train.deepspeed_config={path!r} is a folder; name a JSON file in it, e.g. "
                          f"ds_configs/zero3.json.")
    renamed = RENAMED_FILES.get(os.path.basename(path))
    if renamed:
        raise ConfigError(f"train.deepspeed_config={path!r} was renamed: use {renamed}.")
    raise ConfigError(f"train.deepspeed_config={path!r} does not exist (looked in the current folder and in "
                      f"{REPO_ROOT}); pick one of ds_configs/*.json.")


RENAMED_FILES = {"zero3_offload.json": "ds_configs/zero3_activation_offload.json (it offloads activations; the "
                                       "optimizer states stay on the GPU)"}


# sections of the DeepSpeed JSON that this module and offload.py read as objects, with an example each
OBJECT_SECTIONS = {"bf16": '{"enabled": "auto"}', "fp16": '{"enabled": "auto"}', "zero_optimization": '{"stage": 3}',
                   "activation_checkpointing": '{"cpu_checkpointing": false}'}


def load_deepspeed_config(path: str) -> dict:
    """The user's DeepSpeed JSON as a dict; a file that is not a JSON object (of objects where sections go)
    is a ConfigError naming it."""
    path = resolve_path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            ds = json.load(fh)
    except json.JSONDecodeError as err:
        raise ConfigError(f"train.deepspeed_config={path!r} is not valid JSON: {err}") from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"train.deepspeed_config={path!r} cannot be read as a JSON text file: {one_line(err)}.") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"train.deepspeed_config={path!r} holds a JSON {type(ds).__name__}, not an object "
                          f"{{...}} of DeepSpeed settings; start from one of ds_configs/*.json.")
    for key, example in OBJECT_SECTIONS.items():
        if key in ds and not isinstance(ds[key], dict):
            raise ConfigError(f"train.deepspeed_config={path!r}: \"{key}\" must be an object such as {example}, "
                              f"got {json.dumps(ds[key])}.")
    return ds


def _set_derived(ds: dict, key: str, value) -> None:
    """Fill `key` with the derived value unless the user set a different concrete value."""
    given = ds.get(key, "auto")
    if given == "auto" or given is None:
        ds[key] = value
    elif given != value:
        raise ConfigError(f"DeepSpeed config has {key}={given!r}, but this run needs {value!r} "
                          f"(derived from the run layout). Set it to \"auto\" or remove it.")


def finalize_deepspeed_config(user_ds: dict, dims: ParallelDims, gradient_accumulation_steps: int,
                              dtype: str, layer_params: int = 0) -> dict:
    """The merged config DeepSpeed gets. One sequence per micro-step per dp group:
    train_batch_size = micro (1) x accumulation x dp, where dp = world / sp (DeepSpeed's own arithmetic).
    `layer_params`: parameters of one decoder layer, for stage3_max_reuse_distance (REUSE_DISTANCE_LAYERS);
    0 leaves DeepSpeed's default."""
    ds = copy.deepcopy(user_ds)
    _set_derived(ds, "train_micro_batch_size_per_gpu", 1)
    _set_derived(ds, "gradient_accumulation_steps", gradient_accumulation_steps)
    _set_derived(ds, "train_batch_size", gradient_accumulation_steps * dims.dp)
    _set_derived(ds, "sequence_parallel_size", dims.sp)
    for precision, wanted in (("bf16", dtype == "bfloat16"), ("fp16", dtype == "float16")):
        section = ds.setdefault(precision, {})
        enabled = section.get("enabled", "auto")
        if enabled == "auto":
            section["enabled"] = wanted
        elif bool(enabled) != wanted:
            raise ConfigError(f"DeepSpeed config has {precision}.enabled={enabled} but model.dtype={dtype!r}; "
                              f"make them agree (or set {precision}.enabled to \"auto\").")
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage", 3) != 3:
        raise ConfigError(f"DeepSpeed config has zero_optimization.stage={zero.get('stage')}; ulysses-train "
                          f"runs ZeRO stage 3 only (set \"stage\": 3).")
    zero["stage"] = 3
    if zero.get("stage3_max_reuse_distance", "auto") == "auto":
        zero.pop("stage3_max_reuse_distance", None)
        if layer_params:
            zero["stage3_max_reuse_distance"] = REUSE_DISTANCE_LAYERS * layer_params
    leftover = [k for k, v in _walk(ds) if v == "auto"]
    if leftover:
        raise ConfigError(f"DeepSpeed config key {leftover[0]} is \"auto\", which ulysses-train cannot derive; "
                          f"give it a value.")
    return ds


MONITORS = ("tensorboard", "wandb", "csv_monitor")  # DeepSpeed's monitor sections the trainer feeds


def place_monitor_logs(ds: dict, output_dir: str) -> dict:
    """An enabled TensorBoard or CSV monitor without an `output_path` writes under <output_dir>/monitor (DeepSpeed
    would otherwise write into the working directory); `job_name` defaults to the run folder's name. W&B keeps
    its own settings. Returns `ds`, changed in place."""
    for name in ("tensorboard", "csv_monitor"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled") and not section.get("output_path"):
            section["output_path"] = os.path.join(os.path.abspath(output_dir), MONITOR)
            section.setdefault("job_name", os.path.basename(os.path.abspath(output_dir)) or "run")
    return ds


def check_monitor_paths(ds: dict) -> None:
    """Probe where each enabled TensorBoard or CSV monitor writes (<output_path>/<job_name>, DeepSpeed's layout),
    as run_folder.check_writable does for output_dir: a read-only folder or a path through a file is named now,
    not by a DeepSpeed traceback after the model is built."""
    from ulysses_train.training.run_folder import check_writable

    for name in ("tensorboard", "csv_monitor"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled") and section.get("output_path"):
            path = os.path.join(os.fspath(section["output_path"]), section.get("job_name", DEEPSPEED_JOB_NAME))
            check_writable(path, f"the DeepSpeed JSON's {name}.output_path (+ job_name)")


DEEPSPEED_JOB_NAME = "DeepSpeedJobName"  # DeepSpeed's default monitor job_name


def monitor_enabled(ds: dict) -> bool:
    return any(isinstance(ds.get(name), dict) and ds[name].get("enabled") for name in MONITORS)


def _walk(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def gradient_divisor(ds: dict, dims: ParallelDims) -> int:
    """What ZeRO-3 divides the sum of all ranks' gradients by, so the trainer can pre-multiply.

    DeepSpeed 0.19's stage 3 reduces a gradient bucket by one of two paths:
    - `reduce_scatter: true` (default), or a bucket larger than `reduce_bucket_size`: reduce-scatter,
      then divide by the world size;
    - `reduce_scatter: false` with contiguous gradients: all-reduce, then divide by world / sp.
    The trainer makes each rank's gradient a share of the exact global gradient (they sum to it), so it
    multiplies its loss by this divisor. `check_reduction_path` makes sure every bucket takes the same path.
    """
    zero = ds.get("zero_optimization", {})
    if zero.get("reduce_scatter", True):
        return dims.world_size
    return dims.world_size // dims.sp


def check_reduction_path(ds: dict, dims: ParallelDims, largest_param_numel: int) -> None:
    """Refuse settings under which ZeRO-3 would scale some gradients by sp and others not."""
    zero = ds.get("zero_optimization", {})
    if dims.sp == 1 or zero.get("reduce_scatter", True):
        return
    bucket = int(float(zero.get("reduce_bucket_size", 5e8)))
    if not zero.get("contiguous_gradients", True) or bucket < largest_param_numel:
        raise ConfigError(
            f"zero_optimization.reduce_scatter=false with sequence parallelism needs contiguous_gradients=true "
            f"and reduce_bucket_size >= the largest parameter ({largest_param_numel:,} elements; it is "
            f"{bucket:,}): otherwise DeepSpeed scales that parameter's gradient differently from the rest. "
            f"Set reduce_scatter=true (recommended) or raise reduce_bucket_size."
        )
