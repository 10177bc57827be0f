"""One rank of the retrieval-probe exactness test: the probe grid scored through the evaluation engine (ZeRO-3,
Ulysses, the answer rows of the head only), then again with the all-to-all taken out (negative control: every
rank attends within its own slice, as an evaluation that switches sequence parallelism off in eval mode would).
Rank 0 writes both record lists.

Launched by tests/helpers.run_workers (torchrun, gloo, CPU); the test builds the same probes for its reference.
"""
import argparse
import json

import torch

from ulysses_train.config import load_config
from ulysses_train.training.eval_engine import build_eval_engine
from ulysses_train.diagnostics.probe_scoring import records_as_dicts, score_probes
from ulysses_train.parallel.layout import exit_process


def grid(model_dir: str, spec: dict) -> list:
    """The probe sequences of `spec` (tasks, lengths, depths, samples, seed, chat) from the model's tokenizer."""
    from transformers import AutoTokenizer

    from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return probe_sequences(tokenizer, Haystack(tokenizer), spec["tasks"], spec["lengths"], spec["depths"],
                           spec.get("samples", 1), spec.get("seed", 0), spec.get("chat", False))


def without_all_to_all() -> None:
    """Replace the Ulysses wrapper in transformers' attention registry by causal SDPA on the local slice."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def local_attention(module, q, k, v, mask, *args, scaling=None, **kwargs):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = local_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--spec", required=True, help="JSON: tasks, lengths, depths, samples, seed, chat")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    spec = json.loads(args.spec)
    sequences = grid(args.model_dir, spec)
    cfg = load_config(None, [f"model.name_or_path={args.model_dir}", "model.dtype=float32",
                             "model.attn_implementation=sdpa", f"train.deepspeed_config={args.ds_config}", *args.set])
    run, _ = build_eval_engine(cfg, args.model_dir, max(spec["lengths"]))
    records = score_probes(run, sequences, chunk_rows=5)
    without_all_to_all()
    control = score_probes(run, sequences, chunk_rows=5)
    if run.dims.rank == 0:
        torch.save({"records": records_as_dicts(records), "control": records_as_dicts(control),
                    "sp": run.dims.sp, "dp": run.dims.dp, "mine": len(range(0, len(sequences), run.dims.dp))},
                   args.out)
    exit_process(0)


if __name__ == "__main__":
    main()
