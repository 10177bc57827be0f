"""Retrieval probes (diagnostics/probe_tasks.py, probe_scoring.py, scripts/eval_context.py) on CPU.

Generators are checked by hand against the token ids they produce; scores against a plain single-process Hugging
Face forward of the same model on the same tokens, at sp=4 (chat-rendered probes) and sp=2 x dp=2 (an odd number
of sequences: uneven probe counts across dp ranks), each launch also scoring once without the all-to-all.
"""
import json
import os
import random

import pytest
import torch
from helpers import REPO, run_workers, save_tiny_model, write_ds_config

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
WORKER = os.path.join(REPO, "tests", "probe_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, bpe_tokenizer):
    """A tiny random Qwen3 over the test BPE vocabulary, saved with that tokenizer (and a chat template)."""
    path = save_tiny_model(str(tmp_path_factory.mktemp("probe_models") / "tiny"), vocab_size=1000)
    bpe_tokenizer.chat_template = CHAT_TEMPLATE
    bpe_tokenizer.save_pretrained(path)
    return path


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def reference_records(model_dir, sequences):
    """Per probe (log-prob sum, argmax hits) from a plain HF forward: token p is predicted at row p - 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
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

    bpe_tokenizer.chat_template = CHAT_TEMPLATE
    s = build_sequence(bpe_tokenizer, Haystack(bpe_tokenizer), "multivalue", 2500, [0, 40, 70, 100, 20],
                       random.Random(2), chat=True)
    ids, labels = s.input_ids[0].tolist(), s.labels[0]
    text = bpe_tokenizer.decode(ids)
    answers = [part.split("<eos>")[0] for part in text.split("<|assistant|>")[1:]]
    assert len(answers) == 2 and [len(a.split(", ")) for a in answers] == [4, 1]
    scored = [bpe_tokenizer.decode(list(p.answer_ids)) for p in s.probes]
    assert scored == [v for a in answers for v in a.split(", ")]
    # every labelled token is an answer value: not the template, not the separators, not the <eos> after it
    labelled = bpe_tokenizer.decode(labels[labels != -100].tolist())
    assert labelled == "".join(scored)
    assert text.startswith("<|user|>" + "Below is") and text.count("<|user|>") == 2
    bpe_tokenizer.chat_template = None
    with pytest.raises(ProbeError, match="has no chat template"):
        build_sequence(bpe_tokenizer, Haystack(bpe_tokenizer), "passkey", 400, [50], random.Random(1), chat=True)


# ---------------------------------------------------------------- scoring


def test_answer_scores_and_argmax_hits_match_a_plain_forward(model_dir):
    """One process, no ZeRO: log-probs and hits of chosen rows, where half the labels are made the argmax."""
    from transformers import AutoModelForCausalLM

    from ulysses_train.diagnostics.probe_scoring import answer_token_scores
    from ulysses_train.model.loading import LongContextCausalLM
    from ulysses_train.parallel.layout import slice_sequence

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 64))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    logits = reference(input_ids=ids).logits[0].double()
    labels = torch.full_like(ids, -100)
    rows = torch.tensor([3, 10, 11, 40, 62])
    labels[0, rows + 1] = ids[0, rows + 1]
    labels[0, rows[:3] + 1] = logits[rows[:3]].argmax(-1)  # three labels the model predicts
    module = LongContextCausalLM(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                      attn_implementation="sdpa"))
    module.eval()
    piece = slice_sequence(ids, labels, 1, 0)
    logprob, hit, positions = answer_token_scores(module, piece, chunk_rows=2)
    assert positions.tolist() == (rows + 1).tolist()
    want = torch.log_softmax(logits, -1)[rows, labels[0, rows + 1]]
    assert torch.allclose(logprob, want, rtol=1e-5, atol=0)
    assert hit.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def check_against_reference(result, sequences, model_dir):
    want = reference_records(model_dir, sequences)
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
def test_probe_scores_under_sp_match_a_plain_forward(model_dir, tmp_path, layout):
    """sp=4 with chat-rendered probes; sp=2 x dp=2 over 5 sequences (3 on one dp group, 2 on the other)."""
    from probe_worker import grid

    from ulysses_train.diagnostics.probe_scoring import ProbeResult, cells

    if layout == "sp4_chat":
        spec, sp = {"tasks": ["multikey", "vartrack"], "lengths": [1203], "depths": [0, 50, 100], "chat": True}, 4
    else:
        spec, sp = {"tasks": ["passkey", "multivalue", "vartrack"], "lengths": [1001], "depths": [0, 60, 100]}, 2
    out = str(tmp_path / "result.pt")
    run_workers(4, ["--model-dir", model_dir, "--ds-config", write_ds_config(str(tmp_path / "ds.json")),
                    "--spec", json.dumps(spec), "--out", out, "--set", f"parallel.sequence_parallel_size={sp}"],
                script=WORKER)
    result = torch.load(out, weights_only=False)
    assert (result["sp"], result["dp"]) == (sp, 4 // sp)
    sequences = grid(model_dir, spec)
    check_against_reference(result, sequences, model_dir)
    table = cells([ProbeResult(**r) for r in result["records"]])
    assert sum(c["count"] for c in table) == sum(len(s.probes) for s in sequences)
    if layout == "sp2xdp2_uneven":
        assert len(sequences) == 5 and result["mine"] == 3
        assert {(c["task"], c["depth"]): c["count"] for c in table} == {
            (t, d): 1 for t in spec["tasks"] for d in spec["depths"]}


# ---------------------------------------------------------------- the script


def test_eval_context_script_sp2_writes_exact_heatmaps(model_dir, tmp_path):
    """Two processes (sp=2), two lengths, a short corpus as the haystack (repeated, and said so): the JSON's
    probes equal a plain forward; the CSV holds the cells; one PNG per task; one summary line."""
    import csv

    from helpers import run_workers

    from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A short story about a river and a mill, told twice over. " * 20)
    out = str(tmp_path / "out")
    proc = run_workers(2, ["--model", model_dir, "--set", "model.dtype=float32", "--set",
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
    tokenizer = tokenizer_of(model_dir)
    sequences = probe_sequences(tokenizer, Haystack(tokenizer, corpus.read_text()), ["passkey", "multikey"],
                                [1001, 1500], [0, 50, 100], 1, 7)
    check_against_reference({"records": record["probes"]}, sequences, model_dir)
    with open(os.path.join(out, "retrieval.csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["task"], int(r["length"]), int(r["depth"]), int(r["count"])) for r in rows] == [
        (t, n, d, 1) for t in ("multikey", "passkey") for n in (1001, 1500) for d in (0, 50, 100)]
    for task in ("passkey", "multikey"):
        with open(os.path.join(out, f"retrieval_{task}.png"), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def fill_pipe(fd: int) -> None:
    """Write NUL bytes into a pipe until it is full: the process writing into it then blocks on its next line. `fd`
    must be a description of its own (stdout_pipe's filler): O_NONBLOCK on the child's would make its print fail
    with BlockingIOError instead of waiting."""
    for chunk in (4096, 1):
        try:
            while True:
                os.write(fd, b"\0" * chunk)
        except BlockingIOError:
            pass


def stdout_pipe():
    """(read end, the child's write end, a filler: the same pipe opened again, non-blocking, as a description of its
    own). The pipe holds 4,096 bytes: fewer than a long grid's progress lines, so the child blocks once it is full
    whatever the machine's speed."""
    import fcntl

    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 4096)
    filler = os.open(f"/proc/self/fd/{write_fd}", os.O_WRONLY | os.O_NONBLOCK)
    return read_fd, write_fd, filler


def read_until(fd: int, proc, marker: bytes, seen: bytearray) -> None:
    import select

    while marker not in seen:
        assert proc.poll() is None, f"the script ended (rc={proc.returncode}) before printing {marker!r}"
        if select.select([fd], [], [], 1.0)[0]:
            seen += os.read(fd, 65536)


def wait_for_text(path, text: str, proc) -> None:
    """Until the child has written `text` into `path` (its stderr): a wait on the child's own marker."""
    import time

    while text not in path.read_text():
        assert proc.poll() is None, path.read_text()
        time.sleep(0.05)


def wait_until_blocked_in_a_write(proc) -> None:
    """Until the child's main thread sleeps in a pipe write (the kernel's wait channel, /proc/PID/wchan: pipe_write
    or anon_pipe_write): the state the child itself enters once the pipe is full, not a guess of how long it takes."""
    import time

    while "pipe_write" not in open(f"/proc/{proc.pid}/wchan").read():
        assert proc.poll() is None, f"the script ended (rc={proc.returncode})"
        time.sleep(0.05)


WRITE_SYSCALL = {"x86_64": "1", "aarch64": "64"}
"""write(2)'s number, as /proc/PID/syscall names the call a thread sleeps in."""
PROGRESS_LINE = b"per dp group done"


def blocked_write(pid: int):
    """The bytes the process's main thread sleeps writing into a full pipe (its wait channel, then its syscall's
    buffer and count from /proc/PID/syscall, read from /proc/PID/mem); None while it is not in such a write."""
    import platform

    if "pipe_write" not in open(f"/proc/{pid}/wchan").read():
        return None
    fields = open(f"/proc/{pid}/syscall").read().split()
    if fields[0] != WRITE_SYSCALL.get(platform.machine(), "1"):
        return None  # it moved on between the two reads
    buffer, count = int(fields[2], 16), int(fields[3], 16)
    with open(f"/proc/{pid}/mem", "rb") as memory:
        memory.seek(buffer)
        return memory.read(count)


def wait_until_blocked_on_a_progress_line(proc, read_fd: int, filler: int, seen: bytearray) -> None:
    """Until the child's main thread sleeps writing a probe sequence's progress line into the full pipe: that
    sequence's scores are done, the next not begun. When it sleeps on anything else (a library's log line on
    stdout), one pipe's worth is read into `seen` and the pipe filled again (`filler`), and its writes go on until
    one sleeps again. Lines it completes meanwhile may land after the last NUL byte: count every progress line read
    (drained's count and its text after the last NUL)."""
    import select
    import time

    while True:
        assert proc.poll() is None, f"the script ended (rc={proc.returncode})"
        pending = blocked_write(proc.pid)
        if pending is not None and PROGRESS_LINE in pending:
            return
        if pending:  # one read: the child can then write one pipe's worth at most before sleeping again
            if select.select([read_fd], [], [], 0)[0]:
                seen += os.read(read_fd, 65536)
            fill_pipe(filler)
        time.sleep(0.05)


def test_the_wait_lets_a_stray_line_through_and_stops_on_a_progress_line():
    """A child that writes a log line into its full stdout pipe, then progress lines: the wait drains and refills
    the pipe and returns while the child sleeps on a progress line. Control: first the child slept on the log line,
    which the bare wait (the wait channel alone) took for a progress line."""
    import subprocess
    import sys

    read_fd, write_fd, filler = stdout_pipe()
    child = ("import sys; sys.stdout.write('[deepspeed] a log line\\n'); sys.stdout.flush(); "
             "[print(f'  probes: sequence {i}/999 per dp group done', flush=True) for i in range(1, 1000)]")
    fill_pipe(filler)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=write_fd)
    os.close(write_fd)
    seen = bytearray()
    try:
        wait_until_blocked_in_a_write(proc)
        assert blocked_write(proc.pid) == b"[deepspeed] a log line\n"  # the control
        wait_until_blocked_on_a_progress_line(proc, read_fd, filler, seen)
        assert PROGRESS_LINE in blocked_write(proc.pid)
    finally:
        os.close(filler)
        proc.kill()
        proc.wait()
        os.close(read_fd)


GRID = ["--lengths", "1001,1500", "--depths", "0,1,...,100", "--tasks", "passkey"]
GRID_SEQUENCES = 202
"""202 probe sequences: their progress lines (~45 bytes each) are over twice the pipe, so the grid cannot end before
the test has filled it, however slow the test process is."""


def blocked_probe_run(model_dir, out, errors):
    """eval_context.py over GRID with its stdout a 4,096-byte pipe that is full (stdout_pipe, fill_pipe) once it has
    said how many sequences it probes: rank 0 then waits inside a write, on the line of the next sequence it
    finishes. (process, read end, filler, bytes read so far); every progress line before the last NUL byte was
    printed before the pipe was full. The caller closes the filler (until then the read end never sees its end)."""
    import subprocess
    import sys

    read_fd, write_fd, filler = stdout_pipe()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    with open(errors, "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "eval_context.py"), "--model", model_dir,
                                 "--set", "model.dtype=float32", "--set", "model.attn_implementation=sdpa", *GRID,
                                 "--out", str(out)], stdout=write_fd, stderr=err, env=env)
    os.close(write_fd)
    seen = bytearray()
    read_until(read_fd, proc, f"{GRID_SEQUENCES} sequences on 1 process(es)".encode(), seen)
    fill_pipe(filler)
    return proc, read_fd, filler, seen


def drained(read_fd, proc, seen: bytearray) -> tuple[int, str]:
    """(progress lines printed before the pipe was full, the text after its last NUL byte) once the child ended."""
    try:
        seen += b"".join(iter(lambda: os.read(read_fd, 65536), b""))
    finally:
        proc.kill() if proc.poll() is None else None
        os.close(read_fd)
    before, _, after = bytes(seen).rpartition(b"\0")
    return before.decode(errors="replace").count("per dp group done"), after.decode()


def test_sigterm_ends_the_grid_after_the_sequence_being_scored_and_writes_what_is_done(model_dir, tmp_path):
    """Issue 41: SIGTERM during eval_context.py used to leave the ranks scoring the whole grid. Now every rank agrees
    after each probe sequence whether one was asked to stop, and the scores done so far are written (exit 75). No
    timing (issue 51: an earlier form counted the lines it had read before filling the pipe, and raced with lines
    the child wrote meanwhile): rank 0 blocks in the write of the line of the next sequence it finishes; SIGTERM is
    sent and its request acknowledged while it waits there, then the pipe is drained: the grid ends right after that
    sequence, and retrieval.json holds exactly the probes scored."""
    import signal

    out, errors = tmp_path / "out", tmp_path / "stderr.txt"
    proc, read_fd, filler, seen = blocked_probe_run(model_dir, out, errors)
    os.close(filler)
    proc.send_signal(signal.SIGTERM)
    wait_for_text(errors, "finishing this probe sequence", proc)
    printed, after = drained(read_fd, proc, seen)
    assert proc.wait(timeout=120) == 75, errors.read_text()
    assert printed + 1 < GRID_SEQUENCES, "nothing was left to stop"
    record = json.loads((out / "retrieval.json").read_text())
    assert record["complete"] is False and record["scored_sequences"] == printed + 1
    assert sorted({p["sequence"] for p in record["probes"]}) == list(range(printed + 1))
    assert after.count("per dp group done") == 1 and "retrieval accuracy: " in after
    assert f"stopped after {printed + 1} of {GRID_SEQUENCES} probe sequences (received SIGTERM)" in errors.read_text()


def test_a_second_signal_stops_at_once_writing_the_scores_done(model_dir, tmp_path):
    """Issue 51: a second SIGTERM and a Ctrl-C were held back while a sequence was scored (12 minutes at 1M tokens).
    Here rank 0's main thread is stuck inside a write (the full pipe) after a first SIGTERM, as it would be inside a
    long forward; a Ctrl-C then ends the process at once (exit 130) with the sequences scored so far written. The
    negative control is the first test: there the process waits for the drained pipe and ends with 75."""
    import signal

    out, errors = tmp_path / "out", tmp_path / "stderr.txt"
    proc, read_fd, filler, seen = blocked_probe_run(model_dir, out, errors)
    try:
        wait_until_blocked_on_a_progress_line(proc, read_fd, filler, seen)
    finally:
        os.close(filler)  # the read end sees its end once the child has ended
    proc.send_signal(signal.SIGTERM)
    wait_for_text(errors, "finishing this probe sequence", proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, errors.read_text()  # the pipe is still full: the main thread never left
    printed, after = drained(read_fd, proc, seen)
    completed = printed + after.count(PROGRESS_LINE.decode())  # the blocked line's write never completed
    record = json.loads((out / "retrieval.json").read_text())
    assert record["complete"] is False and record["interrupted"] is True
    assert record["scored_sequences"] == completed + 1
    line = (f"received SIGINT again: stopped at once; the {completed + 1} probe sequence(s) scored on rank 0 are "
            f"written to {out / 'retrieval.json'}; exiting with code 130.")
    assert line in errors.read_text().splitlines()


def test_eval_context_bad_input_exits_2_before_any_model(model_dir, tmp_path, capsys, bpe_tokenizer):
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_context", os.path.join(REPO, "scripts", "eval_context.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
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
        argv = ["--model", model_dir, "--lengths", "1K", "--tasks", "passkey", "--out", str(tmp_path / "o")]
        assert script.main([*argv, *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, (args, err)
    shape_only = tmp_path / "shape_only"  # --random-init: a folder with config.json and a tokenizer, no weights
    tokenizer_of(model_dir).save_pretrained(shape_only)
    (shape_only / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    args = script.parse_args(["--model", str(shape_only), "--lengths", "1K", "--tasks", "passkey", "--random-init",
                              "--out", str(tmp_path / "o")])
    assert len(script.prepare(args)[5]) == 11  # the probes are made; without --random-init the weights are missing
    args.random_init = False
    with pytest.raises(Exception, match="weights"):
        script.prepare(args)
    args = script.parse_args(["--model", model_dir, "--lengths", "128", "--depths", "0,100", "--tasks", "demo",
                              "--out", str(tmp_path / "o")])
    demo = script.prepare(args)[5]  # the embedded demo's tokens: no tokenizer read
    assert [s.probes[0].task for s in demo] == ["demo", "demo"] and demo[0].input_ids.shape == (1, 128)
    assert script.parse_depths("0,10,...,100") == list(range(0, 101, 10))
    assert script.parse_depths("100,0,50,50") == [0, 50, 100]


def test_eval_context_lengths_yarn_cannot_reach_are_refused_in_its_own_flags(model_dir, tmp_path, capsys):
    """Issue 51: --lengths 1000000 on a short model started hours of work at YaRN factor 3906; OLMo-hybrid (NoPE) and
    Kimi Linear (no RoPE) past their positions were refused naming the trainer's data.seq_length. Each is one line
    in eval_context's flags, before any model; the negative controls (a factor within the limit; --beyond-trained)
    pass the check."""
    import importlib.util

    from helpers import KIMI_LINEAR, tiny_family_config

    spec = importlib.util.spec_from_file_location("eval_context", os.path.join(REPO, "scripts", "eval_context.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folders = {}
    for name, config in (("nope", tiny_family_config("olmo_hybrid", rope_theta=None, pad_token_id=0,
                                                    eos_token_id=1, layer_types=["linear_attention", "full_attention"])),
                         ("kimi", tiny_family_config("kimi_linear", **KIMI_LINEAR))):
        config.save_pretrained(tmp_path / name)
        tokenizer_of(model_dir).save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
    cases = [([model_dir, "--lengths", "1000000"],
              "error: --lengths up to 1,000,000 need YaRN factor 244 on a model trained to 4,096 positions, past the "
              "factor 32 this package trains and evaluates with; each probe sequence would take about "),
             ([folders["nope"], "--lengths", "16K", "--random-init"],
              "error: --lengths up to 16,384 are past the 4,096 positions the model addresses, and YaRN cannot reach "
              "them: it has no positions (NoPE) to scale. Fix: --lengths up to 4,096 (--set model.rope_scaling=none "
              "--beyond-trained measures it there as it is)."),
             ([folders["kimi"], "--lengths", "16K", "--random-init", "--set", "model.rope_scaling=none"],
              "error: --lengths up to 16,384 are past the 4,096 positions the model addresses, and YaRN cannot reach "
              "them: it has no rotary position embeddings to scale. Fix: --lengths up to 4,096.")]
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
    script.check_length_reach(model_dir, cfg, 131_072, beyond=False)  # factor 32: the limit itself passes
    script.check_length_reach(model_dir, cfg, 1_000_000, beyond=True)  # asked for explicitly
    cfg = script.load_config(None, ["model.rope_scaling=none"], defaults=script.EVAL_DEFAULTS)
    script.check_length_reach(folders["nope"], cfg, 16_384, beyond=True, random_init=True)


# ---------------------------------------------------------------- during training


def check_first_step_line(stdout, cache, model_dir):
    """The first-step check's two numbers against a plain forward of the starting model on the first packed row:
    its last 256 tokens alone, and the same tokens at the end of the 512-token row."""
    import re

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    found = re.search(r"first-step check: the last 256 tokens of the first sample score mean NLL ([0-9.]+) inside "
                      r"the 512-token sequence, ([0-9.]+) on their own: consistent\.", stdout)
    assert found, stdout[-2000:]
    row = next(iter(Dataset.from_file(str(sorted(cache.glob("packed-*/*.arrow"))[0]))))
    ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")

    def mean_nll(i, lab):
        with torch.no_grad():
            logits = model(input_ids=i).logits[0, :-1]
        target = lab[0, 1:]
        return torch.nn.functional.cross_entropy(logits[target != -100], target[target != -100]).item()

    tail_labels = labels.clone()
    tail_labels[:, :257] = -100
    assert abs(float(found.group(1)) - mean_nll(ids, tail_labels)) < 1.5e-3
    assert abs(float(found.group(2)) - mean_nll(ids[:, 256:], labels[:, 256:])) < 1.5e-3


def test_first_step_verdict_names_the_causes_only_when_context_hurts():
    from ulysses_train.diagnostics.first_step import verdict

    assert verdict(2.0, 1.8, 4096, 65536).endswith(": consistent.")
    assert verdict(2.0, 2.4, 4096, 65536).endswith(": consistent.")  # within the margin
    worse = verdict(2.0, 9.5, 4096, 65536)
    assert "7.50 nats WORSE with more context" in worse and "RoPE" in worse and "\n" not in worse
    assert "skipped" in verdict(None, None, 4096, 65536)


def test_eval_section_probes_before_and_during_training(model_dir, tmp_path):
    """eval.every=2 over 2 steps of a corpus run (sp=2): the step-0 grid equals a plain forward of the starting
    model, the step-2 grid one of the exported model (and the two differ: the weights moved); the CSV monitor
    gets one accuracy row per evaluation; the first-step check's two losses equal a plain forward."""
    from conftest import generated_words

    from ulysses_train.diagnostics.probe_tasks import Haystack, probe_sequences

    words = generated_words(seed=2)
    rng = random.Random(0)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n"
                              for _ in range(40)))
    with open(os.path.join(REPO, "ds_configs", "zero3.json")) as fh:
        ds = json.load(fh)
    ds["optimizer"]["params"]["lr"] = 1e-3
    ds["csv_monitor"] = {"enabled": True}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    settings = [f"model.name_or_path={model_dir}", "model.dtype=float32", "model.attn_implementation=sdpa",
                "parallel.sequence_parallel_size=2", f"data.source={corpus}", f"data.tokenizer={model_dir}",
                "data.seq_length=512", f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={out}",
                "train.steps=2", f"train.deepspeed_config={tmp_path / 'ds.json'}", "eval.every=2",
                "eval.tasks=[passkey]", "eval.depths=[0, 100]", "eval.lengths=[700]"]
    proc = run_workers(2, [arg for s in settings for arg in ("--set", s)],
                       script=os.path.join(REPO, "scripts", "train.py"))
    assert "eval step 0: retrieval accuracy: " in proc.stdout and "eval step 2: retrieval accuracy: " in proc.stdout
    check_first_step_line(proc.stdout, tmp_path / "cache", model_dir)
    tokenizer = tokenizer_of(model_dir)
    sequences = probe_sequences(tokenizer, Haystack(tokenizer), ["passkey"], [700], [0, 100], 1, 0)
    results = {}
    for step, reference in ((0, model_dir), (2, str(out / "hf_model"))):
        with open(out / "eval" / f"retrieval_step_{step}" / "retrieval.json") as fh:
            results[step] = json.load(fh)["probes"]
        check_against_reference({"records": results[step]}, sequences, reference)
    assert max(abs(a["logprob"] - b["logprob"]) / abs(b["logprob"]) for a, b in zip(results[0], results[2])) > 1e-4
    rows = (out / "monitor" / "run" / "Eval_retrieval_accuracy_passkey.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2


def test_eval_section_is_validated_and_the_demo_is_refused(tmp_path):
    from ulysses_train.config import ConfigError, load_config
    from ulysses_train.diagnostics.probe_training import ProbeEvaluator, monitor_events

    cfg = load_config(None, ["eval.every=5", "eval.tasks=[vartrack]", "eval.lengths=[4096]"])
    assert (cfg.eval.every, cfg.eval.tasks, cfg.eval.lengths, cfg.eval.depths) == (5, ["vartrack"], [4096],
                                                                                  [0, 25, 50, 75, 100])
    for bad, message in (("eval.every=-1", "eval.every=-1 must be an integer >= 0"),
                         ("eval.depths=[0, 101]", "must be a list of percentages, 0 to 100"),
                         ("eval.tasks=[needle]", "must be a list of tasks from passkey"),
                         ("eval.haystack=/no/such/file", "is not a file")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            load_config(None, [bad])
    demo = load_config(None, ["eval.every=1"], defaults={"data": {"source": "demo"}})
    with pytest.raises(ConfigError, match=r"eval.tasks=\[demo\] goes with data.source=demo and only with it"):
        ProbeEvaluator(demo, str(tmp_path))
    demo = load_config(None, ["eval.every=1", "eval.tasks=[demo]", "eval.depths=[0, 50, 100]"],
                       defaults={"data": {"source": "demo", "seq_length": 128}})
    sequences = ProbeEvaluator(demo, str(tmp_path)).sequences
    assert [(s.probes[0].depth, s.probes[0].needle_start) for s in sequences] == [(0, 1), (50, 51), (100, 101)]
    for s in sequences:  # the needle's key and value; the key asked in a block at the end; the value answered last
        ids, p = s.input_ids[0], s.probes[0]
        assert ids[p.needle_start + 1] == ids[-1] == p.answer_ids[0] and (ids[-25:-1] == ids[p.needle_start]).all()
        assert (s.labels[0] != -100).nonzero().reshape(-1).tolist() == [127] and p.answer_start == 127
    with pytest.raises(ConfigError, match="or \\[demo\\] alone"):
        load_config(None, ["eval.tasks=[demo, passkey]"])
    table = [{"task": "passkey", "count": 3, "accuracy": 1 / 3, "mean_logprob": -3.0},
             {"task": "passkey", "count": 1, "accuracy": 1.0, "mean_logprob": -1.0}]
    assert monitor_events(table, 7) == [("Eval/retrieval_accuracy/passkey", 0.5, 7),
                                        ("Eval/retrieval_logprob/passkey", -2.5, 7)]


def test_yarn_probe_task_prepares_a_tokenizer_and_trains_on_labelled_answers(tmp_path):
    """benchmarks/yarn_probe_task.py (the GPU YaRN story): its tokenizer splits digits one per token; its training
    samples label exactly the answer tokens, differ by index and repeat for the same one."""
    import importlib.util

    path = os.path.join(REPO, "benchmarks", "yarn_probe_task.py")
    spec = importlib.util.spec_from_file_location("yarn_probe_task", path)
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    folder = task.prepare(str(tmp_path / "model"))
    tokenizer = tokenizer_of(folder)
    assert tokenizer.tokenize(" 4821937")[-7:] == list("4821937")
    data = task.ProbeTrainingSet(tokenizer, 900, 4, tasks=("passkey", "multikey"))
    first, again, second = data[0], data[0], data[1]
    assert torch.equal(first["input_ids"], again["input_ids"]) and first["input_ids"].shape == (1, 900)
    answer = tokenizer.decode(first["labels"][first["labels"] != -100].tolist())  # " 4821937": a space, 7 digits
    assert answer[0] == " " and len(answer) == 8 and answer[1:].isdigit()
    assert answer in tokenizer.decode(first["input_ids"][0, :-8].tolist())  # at the needle
    assert (second["labels"] != -100).sum() == 4 * 8  # multikey: four asked keys
