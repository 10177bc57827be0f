"""Which answer tokens survive YaRN zero-shot: a plain Hugging Face forward of the model trained at 256 tokens
(OUT/train/hf_model of benchmarks/yarn_heatmaps.sh) with its RoPE replaced, 4 passkey probes per depth 0-100% by 10
at 256 and 1,024 tokens (eval_context's probes, seed 0). Prints, per length, the exact-match rate and the share of
probes whose answer token i is the argmax (i = 0: the space, 1-7: the digits in order).
    PYTHONPATH=. python benchmarks/results/yarn_heatmaps/per_token_check.py OUT/train/hf_model
"""
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences

path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
seqs = probe_sequences(tok, Haystack(tok), ["passkey"], [256, 1024], list(range(0, 101, 10)), 4, 0, False)
base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
variants = [("none (as trained)", {"rope_type": "default", "rope_theta": 10000.0}), ("yarn x4", base),
            ("yarn x4, attention_factor 1", {**base, "attention_factor": 1.0}), ("yarn x2", {**base, "factor": 2.0})]
for name, rope in variants:
    cfg = AutoConfig.from_pretrained(path)
    cfg.rope_parameters, cfg.max_position_embeddings = rope, int(256 * rope.get("factor", 4))
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    res = {}
    for s in seqs:
        with torch.no_grad():
            logits = model(s.input_ids).logits[0]
        for p in s.probes:
            rows = logits[p.answer_start - 1:p.answer_start - 1 + len(p.answer_ids)]
            hits = rows.argmax(-1) == torch.tensor(p.answer_ids)
            r = res.setdefault(p.length, [0, 0, [0] * len(hits)])
            r[0], r[1] = r[0] + bool(hits.all()), r[1] + 1
            r[2] = [a + int(h) for a, h in zip(r[2], hits.tolist())]
    for length, (exact, count, per_token) in res.items():
        print(f"{name:28s} {length:5d}: exact {exact / count:.2f}, per token " +
              " ".join(f"{x / count:.2f}" for x in per_token), flush=True)
