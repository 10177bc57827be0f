"""Every change this package makes to a Hugging Face model, in one place and in the order it happens.

`build_long_context_model` is the only caller of the steps below, and it logs one line naming what each step
replaced. Changes to modules are visible in `print(model)`: a changed module's class is swapped for a subclass
named after the change (`FusedQwen3RMSNorm`, `TiledQwen3MLP`, `ChunkedLossHead`, ...) whose method differs from
the stock one; the module keeps its parameters, buffers and hooks, so ZeRO-3 still gathers its weights around
each call and `isinstance` checks still hold.

Order, and why it matters:
1. attention: DeepSpeed's Ulysses wrapper replaces the kernel's entry in transformers' attention registry; it
   must be in place before the model is built, because each attention layer looks its kernel up at build time
   (`mixers/attention.py`; it also makes the sp groups, from which the one `SequenceParallel` the other mixers,
   the router loss and the probes exchange and sum through is built: `sequence_parallel.py`);
2. build (random init or weights) under ZeRO-3 (`loading.build_causal_lm`), and with `model.lora` PEFT's LoRA
   layers injected and the rest frozen (`lora.py`), before the levers wrap the layers that hold them; Gated
   DeltaNet layers run over the whole sequence of each rank's heads (each mixer's `install`: `mixers/`); with
   `model.attention_head_chunks` > 1 each attention layer's exchange and kernel run over chunks of its heads in
   turn (`mixers/head_chunks.py`);
3. RoPE frequencies recomputed in fp32 (zero.Init made them in the training dtype: `rope.py`);
4. non-reentrant gradient checkpointing of every decoder layer (nothing else is recomputed without it);
5. each layer's checkpoint function: kept attention and activation offload (`recompute.py`, `offload.py`);
6. on GPUs with liger-kernel, each SwiGLU MLP's activation and product as Liger's kernel (`swiglu.py`), then TiledMLP
   on each dense MLP and mixture-of-experts block (`tiling.py`), whose tiles call the MLP's forward as it is then;
7. the RMSNorm kernel of each Llama-style norm (`rmsnorm.py`);
8. the lm_head becomes the chunked-loss head, called with labels by `LongContextCausalLM` (`loading.py`);
9. for a mixture-of-experts model whose config asks for the router's load-balancing loss, hooks on its routers
   that compute it over the whole sequence (`router_balance.py`; hooks, so the order with 6 does not matter).
"""
from __future__ import annotations

from typing import Optional

from ulysses_train.config import Config, ModelConfig
from ulysses_train.model.loading import LongContextCausalLM, build_causal_lm, enable_gradient_checkpointing
from ulysses_train.model.lora import apply_lora
from ulysses_train.model.mixers import install_mixers
from ulysses_train.model.mixers.attention import attention_phrase, register_ulysses_attention
from ulysses_train.model.mixers.attention_exchange import route_own_exchange
from ulysses_train.model.offload import cpu_checkpointing_requested
from ulysses_train.model.recompute import apply_checkpoint_levers, decoder_layers
from ulysses_train.lever_keys import fixed_levers
from ulysses_train.model.rmsnorm import liger_offset_forward, replace_rmsnorms
from ulysses_train.model.indexer_loss import IndexerLoss
from ulysses_train.model.router_balance import attach_router_balance, router_loss_note
from ulysses_train.model.swiglu import replace_swiglu_mlps
from ulysses_train.model.rope import recompute_rope_buffers_in_fp32, rotary_modules
from ulysses_train.model.tiling import apply_tiled_mlp
from ulysses_train.sequence_parallel import SequenceParallel


def build_long_context_model(hf_config, cfg: Config, attn_implementation: str, ds_config: Optional[dict],
                             sp: int, log: bool = True, mixer_kernels: Optional[dict] = None):
    """Steps 1-9 above. Returns (the module DeepSpeed trains, the HfDeepSpeedConfig to keep alive, the mpu or
    None); `log`: print the one-line summary (rank 0); `mixer_kernels`: the run's {mixer: kernel variant}
    (ResolvedRun.mixer_kernels; default: chosen for the model's device)."""
    mpu = register_ulysses_attention(hf_config, attn_implementation, sp)
    sequence_parallel = SequenceParallel.from_group(mpu.get_sequence_parallel_group() if mpu else None)
    changes = [attention_phrase(attn_implementation, sp)]
    causal_lm, hf_ds_config = build_causal_lm(hf_config, cfg.model, attn_implementation, ds_config)
    if getattr(causal_lm, "checkpoint_tensors_not_trained", None):  # weight_check.not_trained_note
        changes.append(causal_lm.checkpoint_tensors_not_trained)
    if cfg.model.lora:
        changes.append(apply_lora(causal_lm, cfg.model.lora, cfg.train.seed))
    causal_lm.indexer_loss = IndexerLoss(cfg.model.indexer_loss_coef) if cfg.model.indexer_loss_coef > 0 else None
    changes += install_mixers(causal_lm, sequence_parallel, mixer_kernels)  # indexed attention reads indexer_loss
    chunks = fixed_levers(cfg.model).attention_head_chunks
    if chunks > 1:
        route_own_exchange(causal_lm, sequence_parallel, chunks)
        changes.append(f"attention's all-to-all and kernel in {chunks} head chunks, one at a time")
    changes += apply_memory_levers(causal_lm, cfg.model, ds_config)
    module = LongContextCausalLM(causal_lm, cfg.loss.type, cfg.loss.chunk_rows)
    module.sequence_parallel = sequence_parallel
    changes.append("lm_head -> ChunkedLossHead" + (" (full logits: loss.type nll)" if cfg.loss.type == "nll" else ""))
    module.indexer_loss = causal_lm.indexer_loss
    module.router_balance = attach_router_balance(causal_lm, sequence_parallel)
    if module.router_balance is not None:
        changes.append(f"router load-balancing loss (x {module.router_balance.coefficient}) over the whole sequence")
    changes += [note for note in [router_loss_note(causal_lm.config)] if note]
    if log:
        print(f"model changes: {'; '.join(changes)}.", flush=True)
    return module, hf_ds_config, mpu


def apply_memory_levers(model, model_cfg: ModelConfig, ds_config: Optional[dict]) -> list[str]:
    """Steps 3-7 on a built model; returns one phrase per step that changed something. Levers still `auto`
    here (a caller other than build_engine, which chooses them on GPUs) take their no-GPU meaning."""
    model_cfg = fixed_levers(model_cfg)
    changes = []
    if rotary_modules(model):
        recompute_rope_buffers_in_fp32(model)
        changes.append("RoPE frequencies in fp32")
    model.train()  # from_pretrained returns eval mode, where transformers silently skips checkpointing
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
        changes.append(f"gradient checkpointing of {len(decoder_layers(model))} layers")
    offload = cpu_checkpointing_requested(ds_config)
    if apply_checkpoint_levers(model, model_cfg.keep_attention_fraction, offload,
                               model_cfg.activation_offload_fraction) is not None or model_cfg.keep_attention_fraction:
        changes.append(model.checkpoint_levers_summary)
    swiglu = replace_swiglu_mlps(model)  # before TiledMLP, whose tiles call the MLP's forward as it is then
    if swiglu:
        changes.append(f"{swiglu} SwiGLU MLPs -> Liger's SiLU-and-multiply kernel")
    if apply_tiled_mlp(model, model_cfg.tiled_mlp) is not None:
        changes.append(f"TiledMLP ({model_cfg.tiled_mlp})")
    if model_cfg.rmsnorm != "hf":
        count = replace_rmsnorms(model, model_cfg.rmsnorm)
        liger = sum(type(m).forward is liger_offset_forward for m in model.modules())
        liger = f" ({liger} of them 1 + w norms as Liger's)" if liger else ""
        changes.append(f"{count} RMSNorms -> {model_cfg.rmsnorm} kernel{liger}")
    return changes
