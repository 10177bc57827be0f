import sys, json, torch
sys.path.insert(0, "scripts")
import bench_point as bp
point = {"model": "deepseek-v3", "layers": 4, "length": 16384, "levers": "all", "sp": 8, "emulate_sp": 8,
         "emulate_gpus_per_node": 8, "documents": 0, "config": "", "sets": [], "attn": "sdpa", "steps": 1,
         "optimizer": sys.argv[1], "keep_fraction": 1.0, "offload_fraction": 1.0, "chunk_rows": 1024,
         "shape_overrides": {}, "out": "/tmp/d.json"}
run, cfg, sample, *_ = bp.build_point(point)
opt = run.deepspeed.optimizer
print("comm", opt.communication_data_type, "dtype", opt.dtype, "accum", getattr(opt, "gradient_accumulation_dtype", None),
      "ds comm", run.deepspeed.communication_data_type, "bf16", run.deepspeed.bfloat16_enabled())
big = sorted(((p.ds_numel, n, p.dtype) for n, p in run.module.named_parameters()), reverse=True)[:4]
print(big)
print("first", opt.optimizer.param_groups[0]["params"][0].dtype)
