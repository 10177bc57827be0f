"""Shared test helpers: a tiny Qwen3, a launcher for gloo workers, and the plain reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from ulysses_train.model.text_head import register_text_heads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
register_text_heads()  # the plain references build GLM-5.3-Flash's text model with the head the trainer registers


def write_jsonl(path, rows, tail: bytes = b""):
    """A JSONL file at `path` (a pathlib.Path): one line per row (a row already bytes is written as it is, for
    broken lines), then `tail`; returns the path."""
    path.write_bytes(b"".join(row if isinstance(row, bytes) else json.dumps(row).encode() + b"\n" for row in rows)
                     + tail)
    return path


def load_script(path: str, name: str | None = None, modules: dict | None = None):
    """A script of the repository (`path` under it, e.g. "scripts/plan.py") loaded as a module, so a test calls its
    main() in this process. `modules`: sys.modules or a monkeypatched stand-in, for a script whose dataclasses look
    their module up by name while it loads."""
    import importlib.util

    name = name or os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    if modules is not None:
        modules[name] = module
    spec.loader.exec_module(module)
    return module
WORKER = os.path.join(REPO, "tests", "dist_worker.py")


def tiny_qwen3_config(tie_word_embeddings: bool = True, vocab_size: int = 256, **overrides):
    """Qwen3 architecture at test size: hidden 64, 2 layers, 4 query heads, 2 KV heads."""
    from transformers import Qwen3Config

    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, max_position_embeddings=4096,
                  tie_word_embeddings=tie_word_embeddings, rope_theta=1_000_000.0)
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096)
"""The test size every tiny model family shares (tiny_qwen3_config adds Qwen3's own keys)."""


NEMOTRON_H = dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=8,
                  mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16, use_conv_bias=True,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=32, routed_scaling_factor=2.5, norm_topk_prob=True,
                  head_dim=16, time_step_limit=(0.0, float("inf")))
"""A tiny Nemotron-H: one layer of each kind it has (Mamba2 with 8 heads in 2 groups, experts, attention without
positions, a relu² MLP), chunk 16 so a sequence spans many chunks of the SSD scan."""
KIMI_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_heads=4, linear_head_dim=8,
                   num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)
"""A tiny Kimi Linear (tiny_family_config("kimi_linear", **KIMI_LINEAR)): a Kimi Delta Attention layer (4 heads of 8,
conv kernel 4) with a dense MLP, then an MLA layer (q and k heads of 8 + 4, v heads of 6, a 16-wide latent) with a
mixture of 4 experts (top-2) and a shared one. MLA expands its latent to every query head, so transformers' own
model needs as many KV heads as query heads; the token ids must fit the vocabulary."""
GATED_DELTANET = dict(head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                      linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
"""A tiny Qwen3.5: a Gated DeltaNet layer (4 key heads, each serving 2 value heads; conv kernel 4) and a gated
full-attention layer (partial RoPE); sp=2 and sp=4 split both."""
OLMO_HYBRID = dict(linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                   layer_types=["linear_attention", "full_attention"], rope_theta=None, pad_token_id=0, eos_token_id=1)
"""A tiny OLMo-hybrid as released: a Gated DeltaNet layer (separate q/k/v/gate projections, value heads twice the
key width, beta doubled) and a full-attention layer (q/k RMSNorms over all heads, no RoPE: rope_theta null)."""
LINEAR_HYBRIDS = {"qwen3_5_text": GATED_DELTANET, "olmo_hybrid": OLMO_HYBRID}
HYBRID_MOE = dict(GATED_DELTANET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, output_router_logits=True, router_aux_loss_coef=0.5)
"""Tiny Qwen3.5-MoE and Qwen3-Next: the hybrid layers above, every MLP a mixture of 4 experts (top-2) plus a gated
shared expert, the router's load-balancing loss on. Qwen3-Next's Gated DeltaNet fuses its projections per key
head (`in_proj_qkvz`, `in_proj_ba`)."""


def tiny_family_config(model_type: str, **overrides):
    """A transformers config of `model_type` at TINY_SHAPE (e.g. cohere, granite)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY_SHAPE, **overrides})


def save_tiny_model(path: str, seed: int = 0, config=None, model_class=None, **config_kwargs) -> str:
    """A random-init tiny model (Qwen3 unless `config` is given; `model_class`: another class than the causal
    LM, e.g. an image-text release) saved as a Hugging Face folder (fp32), so workers load real weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config or tiny_qwen3_config(**config_kwargs)
    model = (model_class(config).float() if model_class
             else AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    # random init puts tiny values in norms; perturb them so every parameter has a non-trivial gradient
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("_hc.scale", "_hc.base", "hc_head.hc_scale", "hc_head.hc_base")):
                p.add_(0.5 * torch.randn_like(p))  # hyper-connections start with near-equal streams (scale 0.01)
            if name.endswith("sinks") and p.unique().numel() == 1:  # HY-V4 starts every head's sink at one value
                p.add_(0.5 * torch.randn_like(p))
            if name.endswith(("index_kpool_compress_ape", "index_kpool_compress_gate")):  # 0 and 1 at init: the
                p.add_(0.5 * torch.randn_like(p))  # pool's weights would depend on the token alone, not its channel
            if name.endswith("A_log"):  # Gated DeltaNet decay rates: slow enough that the state carries far
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
    model.save_pretrained(path)
    return path


def make_samples(count: int, length: int, vocab: int, seed: int = 1, masked_prefix: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        ids = torch.randint(0, vocab, (1, length), generator=gen)
        labels = ids.clone()
        if i == 0 and masked_prefix:
            labels[:, :masked_prefix] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def reference_step(model_dir: str, samples: list[dict], lr: float, attn: str = "sdpa", router_loss: bool = False):
    """Plain single-process model: token-weighted mean cross-entropy over all samples, its gradients,
    and the parameters after one SGD step. Independent of ulysses_train's code. `attn`: transformers' own
    attention (eager for models without SDPA, e.g. GPT-OSS's sinks). `router_loss`: add the model's own
    load-balancing loss (see sgd_reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    declared = AutoModelForCausalLM.from_config(model.config)  # from_pretrained unfreezes what the class freezes
    for (name, p), (_, q) in zip(model.named_parameters(), declared.named_parameters()):
        p.requires_grad_(q.requires_grad)  # (ERNIE-4.5-MoE's router correction bias, frozen as ZeRO-3 loads it)
    return sgd_reference(model, [(s["input_ids"], s["labels"]) for s in samples], lr, router_loss=router_loss)


def sgd_reference(model, sequences, lr: float, named: dict | None = None, router_loss: bool = False):
    """(loss, gradients, parameters after one SGD step, label count) of a plain model over `sequences` of
    (input_ids, labels): the token-weighted mean cross-entropy over all of them. `named`: the parameters to
    report, by name (default: all of the model's). `router_loss`: plus `router_aux_loss_coef` x the model's own
    `aux_loss` (transformers' load_balancing_loss_func) of each sequence, weighted by its share of the tokens.
    Parameters the model itself freezes (ERNIE-4.5-MoE's router correction bias) have no gradient and are left out,
    as the trainer leaves them out of what it trains."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad} if named is None else named
    total, count, aux = 0.0, 0, 0.0
    tokens = sum(ids.numel() for ids, _ in sequences)
    for ids, labels in sequences:
        out = model(input_ids=ids, output_router_logits=True) if router_loss else model(input_ids=ids)
        nll, labelled = summed_nll(out.logits, labels)
        total, count = total + nll, count + labelled
        if router_loss:
            aux = aux + ids.numel() / tokens * out.aux_loss
    loss = total / count + (model.config.router_aux_loss_coef * aux if router_loss else 0.0)
    loss.backward()
    zero = {n: torch.zeros_like(p) for n, p in named.items() if p.grad is None}  # e.g. an expert no token chose
    grads = {n: zero[n] if n in zero else p.grad.detach().clone() for n, p in named.items()}
    params = {n: (p.detach() - lr * grads[n]).clone() for n, p in named.items()}
    return loss.item(), grads, params, count


def assert_same_logits_and_gradients(model, reference, ids):
    """`model` (levers applied) and `reference` (the plain copy) give the same logits on `ids` and the same gradient
    of every parameter; returns the logits."""
    logits, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    (logits.double() ** 2).mean().backward()
    (expected.double() ** 2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    return logits


def summed_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Plain next-token cross-entropy of one sequence, summed (logits [1, T, V], labels [1, T] unshifted, -100
    ignored), and its label count: the reference's loss, without ulysses_train's code."""
    logits, target = logits[:, :-1].float(), labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                            ignore_index=-100, reduction="sum")
    return nll, int((target != -100).sum())


def assert_step_matches(result: dict, loss: float, grads: dict, params: dict, count: int) -> tuple[float, float]:
    """A distributed step's result against a reference: label count, loss (< 1e-5), every gradient (< 1e-4) and
    every parameter after SGD (< 1e-5), over the same parameter names; returns (loss error, worst gradient error)."""
    assert result["num_tokens"] == count
    loss_error = abs(result["loss"] - loss) / abs(loss)
    assert loss_error < 1e-5, (result["loss"], loss)
    grad_error, name = worst_relative_error(result["grads"], grads)
    assert grad_error < 1e-4, f"gradient of {name} off by {grad_error:.2e}"
    param_error, name = worst_relative_error(result["params"], params)
    assert param_error < 1e-5, f"{name} after SGD off by {param_error:.2e}"
    return loss_error, grad_error


def worst_relative_error(got: dict, want: dict) -> tuple[float, str]:
    assert sorted(got) == sorted(want), f"parameter sets differ: {sorted(set(got) ^ set(want))}"
    return max((relative_error(got[name], want[name]), name) for name in want)


def run_workers(nproc: int, args: list[str], timeout: int = 300, script: str = WORKER) -> subprocess.CompletedProcess:
    """Start `nproc` real processes on gloo, each with the environment torchrun gives a rank (launch_ranks)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO,
               TOKENIZERS_PARALLELISM="false")
    proc = launch_ranks(nproc, [script, *args], env, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"workers failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


RANK_PORT_TRIES = 3
"""A port picked free can be taken before rank 0 binds it (another group starting at that moment): then the group is
launched again on another port, this many times in all."""
_RANK_SERVER: list = []


def launch_ranks(nproc: int, command: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python COMMAND` (a script and its arguments) as `nproc` ranks of one node with the environment torchrun
    --standalone gives each, forked by tests/rank_server.py (which imported torch, transformers, DeepSpeed and the
    package once). Returns every rank's output, stdout and stderr apart, rank by rank; the return code is the first
    failing rank's, else 0."""
    import tempfile

    from ulysses_train.parallel.ports import free_port

    with tempfile.TemporaryDirectory() as folder:
        for attempt in range(RANK_PORT_TRIES):
            path = os.path.join(folder, f"group{attempt}.json")
            with open(path, "w") as fh:
                json.dump({"nproc": nproc, "script": os.path.abspath(command[0]), "argv": [str(a) for a in command[1:]],
                           "cwd": os.getcwd(), "env": env, "timeout": timeout, "port": free_port()}, fh)
            result = _ask_rank_server(path, env)
            if result["returncode"] == 0 or "address already in use" not in result["stderr"].lower():
                break
    return subprocess.CompletedProcess(command, result["returncode"], result["stdout"], result["stderr"])


def _ask_rank_server(path: str, env: dict) -> dict:
    """Hand one request to the rank server (started on first use, again if it died) and wait for its answer (the
    server enforces the group's deadline itself, so an answer always comes unless the server dies)."""
    if not _RANK_SERVER or _RANK_SERVER[0].poll() is not None:
        _RANK_SERVER[:] = [subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "rank_server.py")],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                            text=True, env=env, cwd=REPO)]
    server = _RANK_SERVER[0]
    server.stdin.write(path + "\n")
    server.stdin.flush()
    for line in server.stdout:
        if line.strip() == f"done {path}":
            with open(path + ".result") as fh:
                return json.load(fh)
    raise AssertionError(f"the rank server ended without answering {path} (rc={server.wait()})")


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (workers may sit in their own process groups), children first.
    A process that ends between the listing and its kill (a launcher's or DeepSpeed's short-lived helpers, a
    worker that just finished) is passed over: it is gone either way."""
    import psutil

    try:
        parent = psutil.Process(pid)
        processes = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    wait_until_dead(processes)


def wait_until_dead(processes: list, timeout: float = 60.0) -> None:
    """Return once every process has ended (see has_ended). SIGKILL is delivered asynchronously: a rank still
    exiting holds its run lock, and a resume started at once was refused as "in use by another run" (seen twice in
    clean-clone CI runs, the second time after the process already read as a zombie)."""
    deadline = time.monotonic() + timeout
    for process in processes:
        while not has_ended(process):
            if time.monotonic() > deadline:
                raise AssertionError(f"pid {process.pid} still alive {timeout:.0f} s after SIGKILL")
            time.sleep(0.02)


def has_ended(process) -> bool:
    """Gone, or a zombie whose every thread has exited. A killed process's main thread can turn zombie while
    another thread still exits (it tears the memory down before it closes the process's files, such as a run's
    output_dir lock): /proc then reads `Z (zombie)` with `Threads: 2` (seen on this machine with a 3 GiB,
    4-thread process). Only the last thread's exit closes the files, and a zombie with one thread has done so."""
    import psutil

    try:
        return process.status() == psutil.STATUS_ZOMBIE and process.num_threads() <= 1
    except psutil.NoSuchProcess:
        return True


def live_commands(pid: int) -> list:
    """(process, command line) of every process under `pid` still alive when read (one that ends while the list is
    read is left out, as kill_tree passes it over)."""
    import psutil

    commands = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            commands.append((process, " ".join(process.cmdline())))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return commands


def write_ds_config(path: str, offload_activations: bool = False, **zero_overrides) -> str:
    """ds_configs/zero3.json with test settings: no optimizer section (tests pass SGD), no clipping,
    and stage3_param_persistence_threshold 0 so even tiny parameters take the partitioned path;
    `offload_activations` switches activation offload on (activation_checkpointing.cpu_checkpointing)."""
    with open(os.path.join(REPO, "ds_configs", "zero3.json")) as fh:
        ds = json.load(fh)
    ds.pop("optimizer", None)
    ds["gradient_clipping"] = 0.0
    if offload_activations:
        ds["activation_checkpointing"] = {"cpu_checkpointing": True}
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds["zero_optimization"].update(zero_overrides)
    with open(path, "w") as fh:
        json.dump(ds, fh)
    return path


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def read_metrics(output_dir: str) -> list[dict]:
    """The records of `<output_dir>/metrics.jsonl`."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def wait_for_steps(output_dir: str, count: int, proc, timeout: float = 300) -> None:
    """Wait until a started run has logged `count` steps (fails at once if the run ends first)."""
    import time

    path = os.path.join(output_dir, "metrics.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(read_metrics(output_dir)) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {count} (rc={proc.poll()})")


def one_error_line(argv, capsys) -> str:
    """cli.main(argv) returns 2 and prints exactly one line, `error: ...`, and no traceback."""
    from ulysses_train import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]
