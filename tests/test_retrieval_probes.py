"""Retrieval probes (diagnostics/probe_tasks.py, probe_scoring.py, scripts/eval_context.py) on CPU.

Generators are checked by hand against the token ids they produce; scores against a plain single-process Hugging
Face forward of the same model on the same tokens, at sp=4 (chat-rendered probes) and sp=2 x dp=2 (an odd number
of sequences: uneven probe counts across dp ranks), each launch also scoring once without the all-to-all.
"""
import copy
import json
import os
import random

import pytest
import torch
from conftest import PROBE_CHAT_TEMPLATE
from helpers import REPO, load_script, run_workers, save_tiny_model, write_ds_config

WORKER = os.path.join(REPO, "tests", "probe_worker.py")


def tokenizer_of(probe_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(probe_model_dir)


def reference_records(probe_model_dir, sequences):
    """Per probe (log-prob sum, argmax hits) from a plain HF forward: token p is predicted at row p - 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = model(input_ids=s.input_ids).logits[0].double()
            logprobs = torch.log_softmax(logits, dim=-1)
            for p in s.probes:
                rows = torch.arange(p.answer_start, p.answer_start + len(p.answer_ids)) - 1
                ids = torch.tensor(p.answer_ids)
                out.append((logprobs[rows, ids].sum().item(), int((logits[rows].argmax(-1) == ids).sum())))
    return out


# ---------------------------------------------------------------- generators


def haystack_offset(sequence, needle_start):
    """Tokens of haystack (needles removed) before the context token `needle_start`."""
    start = sequence.context_span[0]
    inside = sum(min(n, max(0, needle_start - s)) for s, n in sequence.needle_spans)
    return needle_start - start - inside


@pytest.mark.parametrize("task", ["passkey", "multikey", "multivalue", "vartrack"])
def test_needles_sit_at_their_depth_and_answers_occur_only_there(bpe_tokenizer, task):
    from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences

    depths = [0, 10, 50, 90, 100]
    haystack = Haystack(bpe_tokenizer)
    sequences = probe_sequences(bpe_tokenizer, haystack, [task], [1501], depths, samples=2, seed=3)
    assert len(sequences) == (2 * len(depths) if task == "passkey" else 2)
    for s in sequences:
        ids = s.input_ids[0].tolist()
        assert len(ids) == 1501
        room = s.context_span[1] - s.context_span[0] - sum(n for _, n in s.needle_spans)
        context_text = bpe_tokenizer.decode(ids[s.context_span[0]:s.context_span[1]])
        for p in s.probes:
            assert haystack_offset(s, p.needle_start) == round(p.depth / 100 * room)
            needle = next(n for start, n in s.needle_spans if start == p.needle_start)
            needle_text = bpe_tokenizer.decode(ids[p.needle_start:p.needle_start + needle])
            answer = bpe_tokenizer.decode(list(p.answer_ids)).strip()
            secret = answer if task != "vartrack" else needle_text.split("= ")[1].rstrip(".")
            assert secret in needle_text and context_text.count(secret) == 1, (task, needle_text, answer)
            if task == "vartrack":  # the chain's names, each assigned exactly once
                assert all(context_text.count(f"VAR {name} =") == 1 for name in answer.split())
            assert ids[p.answer_start:p.answer_start + len(p.answer_ids)] == list(p.answer_ids)
            assert p.answer_start > s.context_span[1]
        labelled = (s.labels[0] != -100).nonzero().reshape(-1).tolist()
        spans = (range(p.answer_start, p.answer_start + len(p.answer_ids)) for p in s.probes)
        assert labelled == sorted(i for span in spans for i in span)
    again = probe_sequences(bpe_tokenizer, haystack, [task], [1501], depths, samples=2, seed=3)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(sequences, again))
    other = probe_sequences(bpe_tokenizer, haystack, [task], [1501], depths, samples=2, seed=4)
    assert not torch.equal(sequences[0].input_ids, other[0].input_ids)


def test_values_in_a_corpus_are_drawn_again_and_the_check_catches_a_leak(bpe_tokenizer):
    """A corpus full of 7-digit numbers: every value still occurs once. Negative control: a value copied into
    the haystack is caught by check_unique. A short corpus is repeated and says so; the built-in filler is not."""
    from ulysses_train.diagnostics.probe_tasks import Haystack, build_sequence, check_unique

    rng = random.Random(0)
    corpus = " ".join(f"item {rng.randrange(1_000_000, 10_000_000)} is {w}." for w in ["red", "blue"] * 300)
    haystack = Haystack(bpe_tokenizer, corpus)
    s = build_sequence(bpe_tokenizer, haystack, "multikey", 3000, [0, 50, 100], random.Random(5))
    assert not haystack.repeated
    leaked = s.input_ids.clone()
    value_ids = list(s.probes[1].answer_ids)
    start = s.needle_spans[0][0] + s.needle_spans[0][1] + 3  # haystack right after the first needle
    leaked[0, start:start + len(value_ids)] = torch.tensor(value_ids)
    s.input_ids = leaked
    with pytest.raises(AssertionError, match="outside its needle"):
        check_unique(s, bpe_tokenizer)
    short = Haystack(bpe_tokenizer, "just a few words here.")
    build_sequence(bpe_tokenizer, short, "passkey", 400, [50], random.Random(1))
    assert short.repeated
    builtin = Haystack(bpe_tokenizer)
    build_sequence(bpe_tokenizer, builtin, "passkey", 400, [50], random.Random(1))
    assert not builtin.repeated


def test_chat_probes_label_only_the_assistant_answers(bpe_tokenizer):
    from ulysses_train.diagnostics.probe_tasks import Haystack, ProbeError, build_sequence

    tokenizer = copy.deepcopy(bpe_tokenizer)  # the session's tokenizer stays as it is
    tokenizer.chat_template = PROBE_CHAT_TEMPLATE
    s = build_sequence(tokenizer, Haystack(tokenizer), "multivalue", 2500, [0, 40, 70, 100, 20],
                       random.Random(2), chat=True)
    ids, labels = s.input_ids[0].tolist(), s.labels[0]
    text = tokenizer.decode(ids)
    answers = [part.split("<eos>")[0] for part in text.split("<|assistant|>")[1:]]
    assert len(answers) == 2 and [len(a.split(", ")) for a in answers] == [4, 1]
    scored = [tokenizer.decode(list(p.answer_ids)) for p in s.probes]
    assert scored == [v for a in answers for v in a.split(", ")]
    # every labelled token is an answer value: not the template, not the separators, not the <eos> after it
    labelled = tokenizer.decode(labels[labels != -100].tolist())
    assert labelled == "".join(scored)
    assert text.startswith("<|user|>" + "Below is") and text.count("<|user|>") == 2
    tokenizer.chat_template = None
    with pytest.raises(ProbeError, match="has no chat template"):
        build_sequence(tokenizer, Haystack(tokenizer), "passkey", 400, [50], random.Random(1), chat=True)


# ---------------------------------------------------------------- scoring


def test_answer_scores_and_argmax_hits_match_a_plain_forward(probe_model_dir):
    """One process, no ZeRO: log-probs and hits of chosen rows, where half the labels are made the argmax."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.diagnostics.probe_scoring import answer_token_scores
    from ulysses_train.model.loading import LongContextCausalLM
    from ulysses_train.parallel.layout import slice_sequence

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 64))
    reference = AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    logits = reference(input_ids=ids).logits[0].double()
    labels = torch.full_like(ids, -100)
    rows = torch.tensor([3, 10, 11, 40, 62])
    labels[0, rows + 1] = ids[0, rows + 1]
    labels[0, rows[:3] + 1] = logits[rows[:3]].argmax(-1)  # three labels the model predicts
    module = LongContextCausalLM(AutoModelForCausalLM.from_pretrained(probe_model_dir, dtype=torch.float32,
                                                                      attn_implementation="sdpa"))
    module.eval()
    piece = slice_sequence(ids, labels, 1, 0)
    logprob, hit, positions = answer_token_scores(module, piece, chunk_rows=2)
    assert positions.tolist() == (rows + 1).tolist()
    want = torch.log_softmax(logits, -1)[rows, labels[0, rows + 1]]
    assert torch.allclose(logprob, want, rtol=1e-5, atol=0)
    assert hit.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def check_against_reference(result, sequences, probe_model_dir):
    want = reference_records(probe_model_dir, sequences)
    got = result["records"]
    assert len(got) == len(want) == sum(len(s.probes) for s in sequences)  # each probe once: not scaled by sp/dp
    assert [(r["sequence"], r["probe"]) for r in got] == [(i, k) for i, s in enumerate(sequences)
                                                           for k in range(len(s.probes))]
    worst = max(abs(r["logprob"] - w) / abs(w) for r, (w, _) in zip(got, want))
    assert worst < 1e-5, worst
    assert [r["hits"] for r in got] == [h for _, h in want]
    if result.get("control") is not None:
        control = max(abs(r["logprob"] - w) / abs(w) for r, (w, _) in zip(result["control"], want))
        assert control > 1e-3, f"scores without the all-to-all should differ (off by {control:.1e})"
    return worst


@pytest.mark.parametrize("layout", ["sp4_chat", "sp2xdp2_uneven"])
def test_probe_scores_under_sp_match_a_plain_forward(probe_model_dir, tmp_path, layout):
    """sp=4 with chat-rendered probes; sp=2 x dp=2 over 5 sequences (3 on one dp group, 2 on the other)."""
    from probe_worker import grid

    from ulysses_train.diagnostics.probe_scoring import ProbeResult, cells

    if layout == "sp4_chat":
        spec, sp = {"tasks": ["multikey", "vartrack"], "lengths": [1203], "depths": [0, 50, 100], "chat": True}, 4
    else:
        spec, sp = {"tasks": ["passkey", "multivalue", "vartrack"], "lengths": [1001], "depths": [0, 60, 100]}, 2
    out = str(tmp_path / "result.pt")
    run_workers(4, ["--model-dir", probe_model_dir, "--ds-config", write_ds_config(str(tmp_path / "ds.json")),
                    "--spec", json.dumps(spec), "--out", out, "--set", f"parallel.sequence_parallel_size={sp}"],
                script=WORKER)
    result = torch.load(out, weights_only=False)
    assert (result["sp"], result["dp"]) == (sp, 4 // sp)
    sequences = grid(probe_model_dir, spec)
    check_against_reference(result, sequences, probe_model_dir)
    table = cells([ProbeResult(**r) for r in result["records"]])
    assert sum(c["count"] for c in table) == sum(len(s.probes) for s in sequences)
    if layout == "sp2xdp2_uneven":
        assert len(sequences) == 5 and result["mine"] == 3
        assert {(c["task"], c["depth"]): c["count"] for c in table} == {
            (t, d): 1 for t in spec["tasks"] for d in spec["depths"]}


# ---------------------------------------------------------------- the script


def test_eval_context_script_sp2_writes_exact_heatmaps(probe_model_dir, tmp_path):
    """Two processes (sp=2), two lengths, a short corpus as the haystack (repeated, and said so): the JSON's
    probes equal a plain forward; the CSV holds the cells; one PNG per task; one summary line."""
    import csv

    from helpers import run_workers

    from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A short story about a river and a mill, told twice over. " * 20)
    out = str(tmp_path / "out")
    proc = run_workers(2, ["--model", probe_model_dir, "--set", "model.dtype=float32", "--set",
                           "model.attn_implementation=sdpa", "--lengths", "1001,1500", "--depths", "0,50,...,100",
                           "--tasks", "passkey,multikey", "--haystack", str(corpus), "--seed", "7", "--out", out],
                       script=os.path.join(REPO, "scripts", "eval_context.py"))
    assert proc.stdout.count("retrieval accuracy: ") == 1 and "it is repeated to fill the context" in proc.stdout
    with open(os.path.join(out, "retrieval.json")) as fh:
        record = json.load(fh)
    assert record["sp"] == 2 and record["depths"] == [0, 50, 100] and record["trained_length"] == 4096
    assert record["seconds_per_sequence"] > 0 and record["peak_gpu_gib"] == 0.0  # CPU: no GPU memory to read
    assert record["planned_eval_gpu_gib"] > 0  # the planner's forward estimate is arithmetic: made on CPU too
    planned = f"(planned for the evaluation forward at 1,500 tokens: {record['planned_eval_gpu_gib']:.2f} GiB)"
    assert planned in proc.stdout
    tokenizer = tokenizer_of(probe_model_dir)
    sequences = probe_sequences(tokenizer, Haystack(tokenizer, corpus.read_text()), ["passkey", "multikey"],
                                [1001, 1500], [0, 50, 100], 1, 7)
    check_against_reference({"records": record["probes"]}, sequences, probe_model_dir)
    with open(os.path.join(out, "retrieval.csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["task"], int(r["length"]), int(r["depth"]), int(r["count"])) for r in rows] == [
        (t, n, d, 1) for t in ("multikey", "passkey") for n in (1001, 1500) for d in (0, 50, 100)]
    for task in ("passkey", "multikey"):
        with open(os.path.join(out, f"retrieval_{task}.png"), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_eval_context_bad_input_exits_2_before_any_model(probe_model_dir, tmp_path, capsys, bpe_tokenizer):
    script = load_script("scripts/eval_context.py")
    plain = save_tiny_model(str(tmp_path / "plain"), vocab_size=1000)
    bpe_tokenizer.chat_template = None
    bpe_tokenizer.save_pretrained(plain)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    capsys.readouterr()  # the model save's progress bar
    empty, binary, latin1 = tmp_path / "empty.txt", tmp_path / "image.png", tmp_path / "latin1.txt"
    empty.write_text("\n \n")
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    latin1.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    cases = [(["--depths", "0,50,150"], "depths are percentages of the context, 0 to 100"),
             (["--lengths", "16K", "--set", "model.rope_scaling=none"],
              "exceed the 4,096 positions the model addresses with model.rope_scaling=none; YaRN factor 4 would"),
             (["--model", plain, "--chat"], "has no chat template; drop --chat"),
             (["--haystack", str(tmp_path / "missing.txt")], "is not a file"),
             (["--model", str(tmp_path / "run")], "holds DeepSpeed checkpoints but no exported model"),
             (["--tasks", "passkey,needle"], "tasks are passkey, multikey, multivalue, vartrack"),
             (["--lengths", "64"], "length 64 is too short for passkey"),
             (["--haystack", str(empty)], "is empty (3 bytes, no text); give a UTF-8 text file"),
             (["--haystack", str(binary)], "is a binary file (it holds NUL bytes), not text"),
             (["--haystack", str(latin1)], "is not UTF-8 text (byte 3: b'\\xe9'); re-encode it as UTF-8"),
             (["--out", str(empty)], "--out=" + repr(str(empty)) + " is a file, not a folder"),
             (["--out", str(empty / "sub")], "cannot be written: a part of the path is a file, not a folder"),
             (["--out", "/sys/ulysses_probe"], "--out='/sys/ulysses_probe' cannot be written: permission denied")]
    for args, message in cases:
        argv = ["--model", probe_model_dir, "--lengths", "1K", "--tasks", "passkey", "--out", str(tmp_path / "o")]
        assert script.main([*argv, *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, (args, err)
    shape_only = tmp_path / "shape_only"  # --random-init: a folder with config.json and a tokenizer, no weights
    tokenizer_of(probe_model_dir).save_pretrained(shape_only)
    (shape_only / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    args = script.parse_args(["--model", str(shape_only), "--lengths", "1K", "--tasks", "passkey", "--random-init",
                              "--out", str(tmp_path / "o")])
    assert len(script.prepare(args)[5]) == 11  # the probes are made; without --random-init the weights are missing
    args.random_init = False
    with pytest.raises(Exception, match="weights"):
        script.prepare(args)
    args = script.parse_args(["--model", probe_model_dir, "--lengths", "128", "--depths", "0,100", "--tasks", "demo",
                              "--out", str(tmp_path / "o")])
    demo = script.prepare(args)[5]  # the embedded demo's tokens: no tokenizer read
    assert [s.probes[0].task for s in demo] == ["demo", "demo"] and demo[0].input_ids.shape == (1, 128)
    assert script.parse_depths("0,10,...,100") == list(range(0, 101, 10))
    assert script.parse_depths("100,0,50,50") == [0, 50, 100]


def test_eval_context_lengths_yarn_cannot_reach_are_refused_in_its_own_flags(probe_model_dir, tmp_path, capsys):
    """Issue 51: --lengths 1000000 on a short model started hours of work at YaRN factor 3906; OLMo-hybrid and Kimi
    Linear (both NoPE) past their positions were refused naming the trainer's data.seq_length; both have the
    --beyond-trained route with model.rope_scaling=none. Each is one line
    in eval_context's flags, before any model; the negative controls (a factor within the limit; --beyond-trained)
    pass the check."""
    from helpers import KIMI_LINEAR, tiny_family_config

    script = load_script("scripts/eval_context.py")
    folders = {}
    for name, config in (("nope", tiny_family_config("olmo_hybrid", rope_theta=None, pad_token_id=0,
                                                    eos_token_id=1, layer_types=["linear_attention", "full_attention"])),
                         ("kimi", tiny_family_config("kimi_linear", **KIMI_LINEAR))):
        config.save_pretrained(tmp_path / name)
        tokenizer_of(probe_model_dir).save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
    cases = [([probe_model_dir, "--lengths", "1000000"],
              "error: --lengths up to 1,000,000 need YaRN factor 244 on a model trained to 4,096 positions, past the "
              "factor 32 this package trains and evaluates with; each probe sequence would take about "),
             ([folders["nope"], "--lengths", "16K", "--random-init"],
              "error: --lengths up to 16,384 are past the 4,096 positions the model addresses, and YaRN cannot reach "
              "them: it has no positions (NoPE) to scale. Fix: --lengths up to 4,096 (--set model.rope_scaling=none "
              "--beyond-trained measures it there as it is)."),
             ([folders["kimi"], "--lengths", "16K", "--random-init"],
              "error: --lengths up to 16,384 are past the 4,096 positions the model addresses, and YaRN cannot reach "
              "them: it has no positions (NoPE) to scale. Fix: --lengths up to 4,096 (--set model.rope_scaling=none "
              "--beyond-trained measures it there as it is)."),
             ([folders["kimi"], "--lengths", "16K", "--random-init", "--set", "model.rope_scaling=none"],
              "error: --lengths up to 16,384 exceed the 4,096 positions the model was trained to, and it has no rotary "
              "position embeddings (NoPE) for YaRN to extend. Pass --beyond-trained to measure the model there as it "
              "is.")]
    capsys.readouterr()
    for (model, *args), message in cases:
        argv = ["--model", model, "--tasks", "passkey", "--out", str(tmp_path / "o"), *args]
        assert script.main(argv) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1 and "data.seq_length" not in err, (args, err)
        if args[1] == "1000000":  # the time at CPU's assumed rate, then the fix
            assert "42.7 minutes (at 0.1 TFLOP/s per CPU process). Fix: --lengths up to 131,072, or pass --beyond-trained " \
                   "to run it anyway.\n" in err, err
    cfg = script.load_config(None, [], defaults=script.EVAL_DEFAULTS)
    script.check_length_reach(probe_model_dir, cfg, 131_072, beyond=False)  # factor 32: the limit itself passes
    script.check_length_reach(probe_model_dir, cfg, 1_000_000, beyond=True)  # asked for explicitly
    cfg = script.load_config(None, ["model.rope_scaling=none"], defaults=script.EVAL_DEFAULTS)
    script.check_length_reach(folders["nope"], cfg, 16_384, beyond=True, random_init=True)
    script.check_length_reach(folders["kimi"], cfg, 16_384, beyond=True, random_init=True)  # Kimi Linear: NoPE too
