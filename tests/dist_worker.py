"""One rank of a distributed correctness test: one training step through ulysses_train, then rank 0
writes the loss, every parameter's full gradient and the parameters after the SGD step.

Launched by tests/helpers.run_workers (torchrun, gloo, CPU).
"""
import argparse

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

from ulysses_train.config import load_config
from ulysses_train.model import transform
from ulysses_train.parallel.layout import exit_process
from ulysses_train.training import step as engine_module


def linear_attention_controls(args):
    """The negative controls of the recurrent mixers' checks (Gated DeltaNet, Kimi Delta Attention, Mamba2: all three
    exchange, convolve and split documents through mixers/recurrent.py, so one patch there reaches all; each has its
    own rule)."""
    from ulysses_train.model.mixers import gated_deltanet as la
    from ulysses_train.model.mixers import kimi_delta, mamba2, recurrent
    from ulysses_train.sequence_parallel import SequenceParallel

    if args.linear_on_local_slice:
        recurrent.sequence_parallel_of = lambda module: SequenceParallel()
    conv = recurrent.causal_conv
    if args.conv_within_slices:
        def conv_within_slices(module, x, weight, cu_seq_lens, bias=None):
            sp = module.sequence_parallel.size
            return conv(module, x, weight, torch.arange(0, x.shape[1] + 1, x.shape[1] // sp), bias=bias)
        recurrent.causal_conv = conv_within_slices
    if args.recurrence_across_documents or args.conv_across_documents:
        recurrent.causal_conv = lambda module, x, weight, cu_seq_lens, bias=None: conv(module, x, weight, None, bias)
    if args.recurrence_across_documents or args.mamba_state_across_documents:
        rule, kda, scan = la.gated_delta_rule, kimi_delta.kimi_delta_rule, mamba2.ssd_scan
        la.gated_delta_rule = lambda module, q, k, v, g, beta, cu_seq_lens: rule(module, q, k, v, g, beta, None)
        kimi_delta.kimi_delta_rule = lambda module, q, k, v, gate, beta, heads, cu: kda(module, q, k, v, gate, beta,
                                                                                      heads, None)
        mamba2.ssd_scan = lambda *args_: scan(*args_[:-1], None)
    if args.mamba_groups_tiled:  # each group's B and C tiled, not repeated in place: ranks read other heads' groups
        mamba2.groups_per_rank_unit = lambda bc, sp: bc if bc.shape[2] % sp == 0 else bc.repeat(
            1, 1, sp // bc.shape[2], 1)


def own_exchange_controls(args):
    """The negative controls of the own exchange (mixers/attention_exchange.py: MLA, Gemma 4) and of the positions
    the rope part of MLA's q and k is rotated by."""
    from ulysses_train.model.mixers import attention_exchange

    if args.kv_heads_tiled:
        attention_exchange.kv_for_ranks = lambda x, sp: x if x.shape[2] % sp == 0 else x.repeat(
            1, 1, sp // x.shape[2], 1)
    if args.own_exchange_on_local_slice:
        def local(module, query, key, value, attention_mask, **kwargs):
            kwargs.pop("position_ids", None)
            return module.core_attention(module, query, key, value, None, **kwargs)[0], None
        attention_exchange.own_exchange_attention = local
    if args.head_chunks_contiguous:  # chunk c takes a contiguous run of the slice's heads, not its share of each
        from ulysses_train.model.mixers import head_chunks  # rank's: the exchange sends heads to the wrong ranks
        head_chunks.select_chunk = lambda x, sp, width, first: x[:, :, first * sp:(first + width) * sp]
    if args.positions_of_the_slice:
        sliced = engine_module.slice_sequence

        def from_zero(*a, **kw):
            piece = sliced(*a, **kw)
            return {**piece, "position_ids": piece["position_ids"] - piece["position_ids"][:, :1]}
        engine_module.slice_sequence = from_zero


def indexed_attention_controls(args):
    """The negative controls of indexed attention (model/mixers/indexed_attention.py): each breaks one thing the
    sp forward must get right."""
    from ulysses_train.model.mixers import indexed_attention, indexed_kernels
    from ulysses_train.sequence_parallel import SequenceParallel

    if args.indexer_on_local_slice:  # the indexer sees only keys from the first query's slice on
        visible = indexed_kernels.visible_keys
        indexed_kernels.visible_keys = lambda query_index, keys, documents: visible(query_index, keys, documents) & (
            torch.arange(keys)[None, :] >= query_index[0] // query_index.numel() * query_index.numel())
    if args.latent_not_gathered:  # other ranks' latent rows are zeros
        gather = indexed_attention.gather_key_side

        def own_rows_only(sequence_parallel, parts):
            whole = gather(sequence_parallel, parts)
            length = parts[0].shape[1]
            start = sequence_parallel.slice_start(length)
            keep = torch.zeros(whole[0].shape[1], 1)
            keep[start:start + length] = 1.0
            return [x * keep for x in whole]
        indexed_attention.gather_key_side = own_rows_only
    if args.shared_layer_dense:  # a layer without an indexer attends to every earlier key, not the reused choice
        chosen = indexed_attention.chosen_keys

        def dense_when_shared(self, hidden, q_resid, keys, cos, sin, query_index, documents, prev):
            if self.indexer is not None:
                return chosen(self, hidden, q_resid, keys, cos, sin, query_index, documents, prev)
            total = self.sequence_parallel.size * hidden.shape[1]
            return torch.arange(total).expand(hidden.shape[0], hidden.shape[1], total)
        indexed_attention.chosen_keys = dense_when_shared
    if args.indexed_across_documents:  # queries see keys of earlier documents
        indexed_attention.document_of_each_token = lambda cu_seq_lens, total, device: None
    if args.queries_at_slice_zero:  # each rank's queries taken as the first slice's (another rank's choice)
        SequenceParallel.slice_start = lambda self, length: 0
    if args.indexed_without_sinks:  # HY-V4's sink logits left out of the sparse attention's softmax
        sparse = indexed_attention.sparse_latent_attention
        indexed_attention.sparse_latent_attention = lambda *given: sparse(*given[:7])
    if args.indexer_keys_without_gradient:  # other ranks' index keys reach the indexer loss without their gradient
        gathered = indexed_attention.gathered_index_keys

        def own_gradient_only(self, hidden, cos, sin):
            keys = gathered(self, hidden, cos, sin)
            if keys is None or not keys.requires_grad:
                return keys
            start, length = self.sequence_parallel.slice_start(hidden.shape[1]), hidden.shape[1]
            own = torch.zeros(keys.shape[1], 1)
            own[start:start + length] = 1.0
            return keys * own + keys.detach() * (1.0 - own)
        indexed_attention.gathered_index_keys = own_gradient_only


def stream_and_pool_controls(args):
    """The negative controls of what HY-V4 and GLM-5.3-Flash add to indexed attention: hyper-connected streams and
    pooled keys."""
    if args.hc_streams_reversed:  # the residual streams reach every layer after the first in reverse order
        from transformers.models.glm5_next import modeling_glm5_next
        from transformers.models.hy_v4 import modeling_hy_v4

        for layer_class in (modeling_hy_v4.HYV4DecoderLayer, modeling_glm5_next.Glm5NextTextDecoderLayer):
            layer_class.forward = lambda self, hidden, *a, forward=layer_class.forward, **kw: forward(
                self, hidden.flip(2) if self.self_attn.layer_idx else hidden, *a, **kw)
    if args.kpool_at_slice_start:  # GLM-5.3-Flash's key pools counted from each rank's slice start, not the sequence's
        from ulysses_train.model.mixers import pooled_index

        sp = int(next(s.split("=")[1] for s in args.set if s.startswith("parallel.sequence_parallel_size=")))
        pooled_index.document_starts = lambda total, documents, device: torch.arange(total) // (total // sp) * (
            total // sp)


def chunked_attention_controls(args):
    """The negative controls of Llama 4's chunked layers and query temperature (mixers/attention.py, fa4.py)."""
    if args.no_chunks:  # chunked layers attend to the whole past (each document's)
        from ulysses_train.model import fa4

        fa4.chunk_bounds = lambda cu_seqlens, tokens, chunk, device: fa4._documents(
            {"cu_seq_lens_q": cu_seqlens}, torch.empty(1, 1, tokens)) if cu_seqlens is not None else (None, 0)
    if args.positions_of_the_slice_for_tuning:  # the query temperature read off the slice's own indices
        from ulysses_train.model.mixers import attention

        attention.hand_positions = lambda module, args, kwargs: (args, kwargs)


def adapters_planned_beside_the_engine(run, cfg) -> dict:
    """The planner's adapter count (what bench and `auto` plan with) taken while this engine's ZeRO-3 config is
    alive, where transformers' `from_config` enters DeepSpeed's zero.Init (tests/meta_build_worker.py shows
    that build failing on the meta device)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from ulysses_train.model.lora import lora_parameter_count

    return {"planned_adapters": lora_parameter_count(run.module.causal_lm.config, cfg.model.lora),
            "zero3_alive": is_deepspeed_zero3_enabled()}


def add_indexed_attention_controls(ap) -> None:
    """The flags of indexed_attention_controls."""
    ap.add_argument("--indexer-on-local-slice", action="store_true",
                    help="negative control: the indexer scores only the keys of each rank's own slice (and after)")
    ap.add_argument("--latent-not-gathered", action="store_true",
                    help="negative control: indexed attention sees other ranks' latent rows as zeros")
    ap.add_argument("--shared-layer-dense", action="store_true",
                    help="negative control: a shared indexed layer attends to every earlier key instead of reusing "
                         "the previous indexer's choice")
    ap.add_argument("--indexed-across-documents", action="store_true",
                    help="negative control: indexed attention's queries choose and attend to keys of other documents")
    ap.add_argument("--queries-at-slice-zero", action="store_true",
                    help="negative control: every rank's indexed-attention queries are taken as the first slice's")
    ap.add_argument("--indexed-without-sinks", action="store_true",
                    help="negative control: HY-V4's attention sinks left out of the sparse attention's softmax")
    ap.add_argument("--indexer-keys-without-gradient", action="store_true",
                    help="negative control: the indexer loss gets other ranks' index keys without their gradient")
    ap.add_argument("--hc-streams-reversed", action="store_true",
                    help="negative control: HY-V4's and GLM-5.3-Flash's hyper-connection streams reach each layer "
                         "after the first in reverse order")
    ap.add_argument("--kpool-at-slice-start", action="store_true",
                    help="negative control: GLM-5.3-Flash's indexer pools keys from each rank's slice start (a pool "
                         "cut at the slice edge)")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="a run-config override, as for scripts/train.py")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--no-ulysses", action="store_true", help="negative control: keep groups, skip the all-to-all")
    ap.add_argument("--no-logit-transform", action="store_true",
                    help="negative control: the loss ignores the model head's logit scale and soft-cap")
    ap.add_argument("--no-window", action="store_true",
                    help="negative control: attention ignores the layers' sliding windows")
    ap.add_argument("--sinks-of-rank-0", action="store_true",
                    help="negative control: every sp rank takes the first heads' attention sinks, not its own")
    ap.add_argument("--own-exchange-on-local-slice", action="store_true",
                    help="negative control: MLA and Gemma 4 attention layers attend within each rank's slice (no "
                         "exchange of q, k and v)")
    ap.add_argument("--kv-heads-tiled", action="store_true",
                    help="negative control: KV heads fewer than sp are tiled over the ranks, not repeated in place (a "
                         "rank's query heads read another group's KV head)")
    ap.add_argument("--positions-of-the-slice", action="store_true",
                    help="negative control: each rank's position ids start at 0 (RoPE, the rope part of MLA's q and "
                         "k included, rotates by the slice's own positions, not the sequence's)")
    ap.add_argument("--head-chunks-contiguous", action="store_true",
                    help="negative control: a head chunk (model.attention_head_chunks) is a contiguous run of the "
                         "slice's heads instead of the same share of every rank's heads")
    ap.add_argument("--router-stats-of-this-rank", action="store_true",
                    help="negative control: the router loss uses each rank's own counts, not the sequence's")
    ap.add_argument("--linear-on-local-slice", action="store_true",
                    help="negative control: Gated DeltaNet / Kimi Delta Attention layers run on each rank's slice "
                         "only (no all-to-all)")
    ap.add_argument("--conv-within-slices", action="store_true",
                    help="negative control: the Gated DeltaNet conv restarts at every sp slice (no history from the "
                         "previous rank's tokens)")
    ap.add_argument("--recurrence-across-documents", action="store_true",
                    help="negative control: the Gated DeltaNet / Kimi Delta Attention conv and recurrence do not "
                         "restart at documents")
    ap.add_argument("--conv-across-documents", action="store_true",
                    help="negative control: the recurrent mixers' conv does not restart at documents (the state does)")
    ap.add_argument("--mamba-state-across-documents", action="store_true",
                    help="negative control: the Mamba2 SSD state does not restart at documents (the conv does)")
    ap.add_argument("--mamba-groups-tiled", action="store_true",
                    help="negative control: Mamba2's B and C groups tiled over the ranks instead of repeated in "
                         "place, so a rank reads another group's B and C")
    add_indexed_attention_controls(ap)
    ap.add_argument("--no-chunks", action="store_true",
                    help="negative control: Llama 4's chunked layers attend to the whole past")
    ap.add_argument("--positions-of-the-slice-for-tuning", action="store_true",
                    help="negative control: Llama 4's query temperature reads the slice's own token indices")
    ap.add_argument("--router-counts-packing-padding", action="store_true",
                    help="negative control: the router loss counts document packing's padding segment")
    return ap.parse_args()


def install_negative_controls(args) -> None:
    """Each flag breaks one rule the exactness tests check, so their negative controls show the check catches it."""
    linear_attention_controls(args)
    if args.router_counts_packing_padding:
        engine_module.routed_tokens = lambda sample: sample["input_ids"].shape[-1]

    if args.sinks_of_rank_0:
        from ulysses_train.model import fa4

        fa4.local_sinks = lambda sinks, heads: None if sinks is None else sinks[:heads]
    if args.no_window:
        from ulysses_train.model import fa4

        windowed = fa4.fa4_attention
        fa4.fa4_attention = lambda *a, **kw: windowed(*a, **{**kw, "sliding_window": None})

    if args.no_logit_transform:
        from ulysses_train.model import loading
        from ulysses_train.model.architecture import LogitTransform

        loading.logit_transform = lambda hf_config: LogitTransform()

    own_exchange_controls(args)
    indexed_attention_controls(args)
    stream_and_pool_controls(args)
    chunked_attention_controls(args)
    if args.no_ulysses:
        def groups_without_attention(hf_config, attn, sp):
            import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
            mpu.initialize_sequence_parallel(sp)
            return mpu
        transform.register_ulysses_attention = groups_without_attention


def main():
    args = parse_args()
    install_negative_controls(args)
    cfg = load_config(None, [f"model.name_or_path={args.model_dir}", "model.dtype=float32",
                             "model.attn_implementation=sdpa", "loss.chunk_rows=8",
                             f"train.deepspeed_config={args.ds_config}", *args.set])
    gas = cfg.train.gradient_accumulation_steps
    run = engine_module.build_engine(engine_module.resolve_run(cfg), optimizer_factory=lambda p: torch.optim.SGD(p, lr=args.lr))
    dims = run.dims
    if args.router_stats_of_this_rank:
        from ulysses_train.sequence_parallel import SequenceParallel

        run.module.router_balance.sequence_parallel = SequenceParallel()
    samples = torch.load(args.data)
    mine = [samples[micro * dims.dp + dims.dp_rank] for micro in range(gas)]

    trained = [(n.removeprefix("causal_lm."), p) for n, p in run.module.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in trained], [p for _, p in trained]
    # LoRA: the reference needs the adapters' initial weights (drawn here from train.seed)
    initial = ({name: safe_get_full_fp32_param(p).detach().clone() for name, p in trained}
               if cfg.model.lora else {})
    grads = {}

    def read_gradients():
        for name, p in zip(names, params):
            grads[name] = safe_get_full_grad(p).detach().clone()

    result = engine_module.train_step(run, mine, before_optimizer_step=read_gradients)
    after = {name: safe_get_full_fp32_param(p).detach().clone() for name, p in zip(names, params)}
    if dims.rank == 0:
        torch.save({"loss": result.loss, "num_tokens": result.num_tokens, "grads": grads, "params": after,
                    "initial": initial, **(adapters_planned_beside_the_engine(run, cfg) if cfg.model.lora else {})},
                   args.out)
    exit_process(0)


if __name__ == "__main__":
    main()
