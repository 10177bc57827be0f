"""Retrieval probes generated locally from any tokenizer: facts hidden at chosen depths of a haystack, asked after it.

Why generated here: the question after a long fine-tune is whether the model finds a fact anywhere in its context,
at lengths that only a sharded forward reaches; the probes need no download, only the model's own tokenizer, and
are deterministic in (seed, task, length, sample). Tasks, in the style of RULER:

- `passkey`: one needle ("The pass key is 4821937.") per sequence; one sequence per depth;
- `multikey`: one needle per depth, each under its own key, plus distractor needles under keys never asked;
  one question per asked key after the haystack (several probes per forward);
- `multivalue`: one key holds up to four values at four depths; the answer lists them in order and each value is
  its own probe at its own depth;
- `vartrack`: chains of assignments (VAR A = 12345, later VAR B = VAR A, ...), the chain's root at the depth; the
  answer names every variable of the chain.

Layout of a sequence (token ids, every piece tokenized on its own so positions are exact):
    [special prefix] instruction | haystack with needles inserted | questions and answers [| padding]
Depth d puts a needle's first token at haystack offset round(d / 100 * haystack tokens), after the needles
inserted before it. Raw text ends each question with "Answer:" and the answer follows; `chat=True` renders the
same content with the tokenizer's chat template (the first user turn holds the context and the first question,
each answer is an assistant turn, later questions are further user turns). Only answer tokens are scored.
The haystack is the built-in filler or a corpus (repeated when shorter than needed: `Haystack.repeated` says so);
a value or name that occurs in the haystack is drawn again, and `check_unique` asserts the result.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import torch

from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.probe_config import TASKS  # noqa: F401 (the task names live with the config)
from ulysses_train.errors import UserError

BUILTIN_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INSTRUCTION = "Below is a long text with a few facts hidden in it. Remember them; questions follow the text.\n"
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly", "keen",
              "lucky", "mellow", "noble", "odd", "proud", "quiet", "rusty", "silent", "tidy")
NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel")
VALUES_PER_KEY, DISTRACTORS, HOPS = 4, 3, 3
_SENTINEL = re.compile(r"@@(\d+)@@")


class ProbeError(UserError, ValueError):
    """A probe that cannot be built as asked (length too short, no chat template); the message says the fix."""


@dataclass(frozen=True)
class Probe:
    """One scored answer: its task, length and depth, where its needle and its answer tokens sit."""

    task: str
    length: int
    depth: int
    needle_start: int  # token index of the needle's first token (vartrack: the chain's root)
    answer_start: int  # token index of the first answer token
    answer_ids: tuple


@dataclass
class ProbeSequence:
    input_ids: torch.Tensor  # [1, length]
    probes: list
    secrets: list = field(default_factory=list)  # values and names that may occur only inside needles
    needle_spans: list = field(default_factory=list)  # (first token, token count) of every needle
    context_span: tuple = (0, 0)  # [start, end) of the haystack with its needles

    @property
    def labels(self) -> torch.Tensor:
        """The answer tokens labelled (Hugging Face convention: label p is predicted at p - 1), the rest -100."""
        labels = torch.full_like(self.input_ids, IGNORE_INDEX)
        for p in self.probes:
            labels[0, p.answer_start:p.answer_start + len(p.answer_ids)] = torch.tensor(p.answer_ids)
        return labels


def read_haystack(path: str, option: str) -> str:
    """The text of a haystack file, strictly: an empty file would silently give the built-in filler while the report
    names the file, and bytes read with errors="replace" would hide facts in noise. ``option`` names the setting."""
    fix = "give a UTF-8 text file (prose, code, a corpus document) or drop it to use the built-in filler"
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise ProbeError(f"{option} {path!r} cannot be read ({exc.strerror}); {fix}.") from None
    if b"\0" in data:
        raise ProbeError(f"{option} {path!r} is a binary file (it holds NUL bytes), not text; {fix}.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProbeError(f"{option} {path!r} is not UTF-8 text (byte {exc.start:,}: {data[exc.start:exc.start + 1]!r})"
                         f"; re-encode it as UTF-8, or {fix}.") from None
    if not text.strip():
        raise ProbeError(f"{option} {path!r} is empty ({len(data):,} bytes, no text); {fix}.")
    return text


class Haystack:
    """Token ids of the filler (built-in, or a corpus text), cut into windows that start at a seeded offset."""

    def __init__(self, tokenizer, text: str = ""):
        self.text = text or BUILTIN_FILLER
        self.ids = tokenizer(self.text, add_special_tokens=False)["input_ids"]
        if not self.ids:
            raise ProbeError("the haystack text has no tokens; give --haystack a file with text in it.")
        self.repeated = False

    def window(self, count: int, rng: random.Random) -> list:
        """`count` ids from a random start, wrapping round the corpus (and noting it) when it is shorter."""
        if count > len(self.ids):
            self.repeated = self.repeated or self.text != BUILTIN_FILLER
        start = rng.randrange(len(self.ids))
        reps = -(-(start + count) // len(self.ids))
        return (self.ids * reps)[start:start + count]


@dataclass
class _Layout:
    """What a task asks, before tokens: needles as (depth in percent, text, probe depth or None) and questions as
    (text, answer pieces); a piece is (text, depth of its probe, or None for an unscored separator)."""

    needles: list = field(default_factory=list)
    questions: list = field(default_factory=list)
    secrets: list = field(default_factory=list)  # strings that must occur in the haystack only in needles


def _value(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _distinct(make, count: int, rng: random.Random) -> list:
    out = []
    while len(out) < count:
        item = make(rng)
        if item not in out:
            out.append(item)
    return out


def _keys(count: int, rng: random.Random) -> list:
    return _distinct(lambda r: f"{r.choice(ADJECTIVES)}-{r.choice(NOUNS)}", count, rng)


def _layout(task: str, depths: list, rng: random.Random) -> _Layout:
    """The needles and questions of one sequence of `task` (passkey: `depths` holds one depth)."""
    out = _Layout()
    if task == "passkey":
        value = _value(rng)
        out.needles.append((depths[0], f" The pass key is {value}. Remember it.", depths[0]))
        out.questions.append(("What is the pass key?", [(value, depths[0])]))
        out.secrets.append(value)
    elif task == "multikey":
        keys, values = _keys(len(depths) + DISTRACTORS, rng), _distinct(_value, len(depths) + DISTRACTORS, rng)
        for i, (key, value) in enumerate(zip(keys, values)):
            depth = depths[i] if i < len(depths) else rng.uniform(0, 100)
            out.needles.append((depth, f" One of the special magic numbers for {key} is: {value}.",
                                depths[i] if i < len(depths) else None))
        for key, value, depth in zip(keys, values, depths):
            out.questions.append((f"What is the special magic number for {key} mentioned in the text?",
                                  [(value, depth)]))
        out.secrets += values
    elif task == "multivalue":
        groups = [depths[i:i + VALUES_PER_KEY] for i in range(0, len(depths), VALUES_PER_KEY)]
        keys, values = _keys(len(groups), rng), iter(_distinct(_value, len(depths), rng))
        for key, group in zip(keys, groups):
            pieces = []
            for depth in group:
                value = next(values)
                out.needles.append((depth, f" One of the special magic numbers for {key} is: {value}.", depth))
                pieces += [(", ", None)] * bool(pieces) + [(value, depth)]
                out.secrets.append(value)
            out.questions.append((f"What are all the special magic numbers for {key} mentioned in the text, in "
                                  f"order?", pieces))
    elif task == "vartrack":
        values, names = _distinct(_value, len(depths), rng), _distinct(_name, HOPS * len(depths), rng)
        for i, (value, depth) in enumerate(zip(values, depths)):
            chain = names[i * HOPS:(i + 1) * HOPS]
            out.needles.append((depth, f" VAR {chain[0]} = {value}.", depth))
            for hop in range(1, HOPS):
                out.needles.append((depth + (100 - depth) * hop / HOPS, f" VAR {chain[hop]} = VAR {chain[hop - 1]}.",
                                    None))
            out.questions.append((f"Find all variables that are assigned the value {value}, directly or through "
                                  f"other variables.", [(" ".join(chain), depth)]))
            out.secrets += [value, *chain]
    else:
        raise ProbeError(f"unknown task {task!r}; choose from {', '.join(TASKS)}.")
    return out


# ---------------------------------------------------------------- tokens


def _special_prefix(tokenizer) -> list:
    """The special tokens the tokenizer puts before a text of its own accord (e.g. BOS), for raw probes."""
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start]
    return []


def _parts(tokenizer, layout: _Layout, chat: bool) -> list:
    """The sequence as parts: a list of ids, the string "context", or an answer [(ids, probe depth or None)]."""
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def answer(pieces, lead):
        return [(ids((lead if i == 0 else "") + text), depth) for i, (text, depth) in enumerate(pieces)]

    if not chat:
        parts = [_special_prefix(tokenizer) + ids(INSTRUCTION), "context"]
        for question, pieces in layout.questions:
            parts += [ids(f"\n{question} Answer:"), answer(pieces, " ")]
        return parts
    if not getattr(tokenizer, "chat_template", None):
        raise ProbeError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; drop "
                         f"--chat to probe with raw text, or give a tokenizer that has one.")
    messages = []
    for i, _ in enumerate(layout.questions):
        messages += [{"role": "user", "content": f"@@{2 * i}@@"}, {"role": "assistant", "content": f"@@{2 * i + 1}@@"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    pieces = _SENTINEL.split(rendered)
    if len(pieces) != 2 * len(messages) + 1:
        raise ProbeError("the chat template does not keep message contents verbatim; drop --chat.")
    parts = [ids(pieces[0])]
    for k in range(len(messages)):
        which, (question, answer_pieces) = int(pieces[2 * k + 1]), layout.questions[int(pieces[2 * k + 1]) // 2]
        if which % 2:
            parts.append(answer(answer_pieces, ""))
        elif which == 0:
            parts += [ids(INSTRUCTION), "context", ids(f"\n\n{question}")]
        else:
            parts.append(ids(question))
        parts.append(ids(pieces[2 * k + 2]))
    return parts


def _fixed_tokens(parts: list, needle_ids: list) -> int:
    fixed = sum(len(p) if isinstance(p, list) and (not p or isinstance(p[0], int)) else
                sum(len(i) for i, _ in p) for p in parts if p != "context")
    return fixed + sum(len(n) for n in needle_ids)


def _context(haystack: list, needles: list) -> tuple:
    """Haystack ids with needles [(depth, ids, probe depth)] inserted; (ids, [(start in context, needle, len)])."""
    order = sorted(range(len(needles)), key=lambda i: (round(needles[i][0] / 100 * len(haystack)), i))
    out, spans, taken = [], {}, 0
    for i in order:
        offset = round(needles[i][0] / 100 * len(haystack))
        out += haystack[taken:offset]
        taken = offset
        spans[i] = (len(out), len(needles[i][1]))
        out += needles[i][1]
    return out + haystack[taken:], [spans[i] for i in range(len(needles))]


def build_sequence(tokenizer, haystack: Haystack, task: str, length: int, depths: list, rng: random.Random,
                   chat: bool = False) -> ProbeSequence:
    """One probe sequence of exactly `length` tokens; values that occur in the haystack are drawn again."""
    for _ in range(20):
        layout = _layout(task, depths, rng)
        parts = _parts(tokenizer, layout, chat)
        needle_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for _, text, _ in layout.needles]
        room = length - _fixed_tokens(parts, needle_ids)
        if room < 16:
            raise ProbeError(f"length {length:,} is too short for {task} with {len(depths)} depth(s): the needles "
                             f"and questions alone take {length - room:,} tokens. Fix: a longer length or fewer "
                             f"depths.")
        window = haystack.window(room, rng)
        text = tokenizer.decode(window)
        if not any(secret in text for secret in layout.secrets):
            break
    else:
        raise ProbeError(f"the haystack contains the drawn {task} values 20 times over; give a different --haystack.")
    context, spans = _context(window, [(d, ids, p) for (d, _, p), ids in zip(layout.needles, needle_ids)])
    ids, probes = [], []
    for part in parts:
        if part == "context":
            starts = [len(ids) + s for s, _ in spans]
            context_span = (len(ids), len(ids) + len(context))
            ids += context
        elif part and not isinstance(part[0], int):
            for piece, depth in part:
                if depth is not None:
                    which = next(i for i, (_, _, p) in enumerate(layout.needles) if p == depth)
                    probes.append(Probe(task, length, int(round(depth)), starts[which], len(ids), tuple(piece)))
                ids += piece
        else:
            ids += part
    assert len(ids) == length, (len(ids), length)
    sequence = ProbeSequence(torch.tensor([ids]), probes, layout.secrets,
                             [(starts[i], n) for i, (_, n) in enumerate(spans)], context_span)
    check_unique(sequence, tokenizer)
    return sequence


def check_unique(sequence: ProbeSequence, tokenizer) -> None:
    """Assert that no secret (value, variable name) occurs in the sequence before the questions other than in its
    needles: an answer found elsewhere in the haystack would score retrieval of the wrong fact."""
    ids = sequence.input_ids[0].tolist()
    kept, last = [], sequence.context_span[0]
    for start, count in sorted(sequence.needle_spans):
        kept.append(ids[last:start])
        last = start + count
    kept.append(ids[last:sequence.context_span[1]])
    outside = "\n".join(tokenizer.decode(k) for k in kept)
    inside = " ".join(tokenizer.decode(ids[s:s + n]) for s, n in sequence.needle_spans)
    for secret in sequence.secrets:
        assert secret not in outside, f"{secret!r} occurs in the haystack outside its needle"
        assert secret in inside, f"{secret!r} is in no needle"


def depth_groups(task: str, depths: list) -> list:
    """The depths each sequence of `task` holds: one per sequence for passkey, all of them otherwise."""
    return [[d] for d in depths] if task == "passkey" else [list(depths)]


def probe_sequences(tokenizer, haystack: Haystack, tasks: list, lengths: list, depths: list, samples: int = 1,
                    seed: int = 0, chat: bool = False) -> list:
    """Every sequence of the grid, in a fixed order; each deterministic in (seed, task, length, sample, group)."""
    out = []
    for task in tasks:
        for length in lengths:
            for sample in range(samples):
                for group in depth_groups(task, depths):
                    rng = random.Random(f"{seed}/{task}/{length}/{sample}/{group[0]}")
                    out.append(build_sequence(tokenizer, haystack, task, length, group, rng, chat))
    return out


def demo_sequences(lengths: list, depths: list, samples: int = 1, seed: int = 0) -> list:
    """Probes in the embedded demo's tokens (data/demo.py: no tokenizer), one per sequence: filler, the needle (a key
    token and its value) at the depth of the part before the questions, then the key asked as in training (a block
    of `queries` key tokens); the last token is the value, the one answer scored."""
    from ulysses_train.data.demo import BOS, RetrievalTask

    task, out = RetrievalTask(), []
    for length in lengths:
        room = length - task.queries - 3  # positions 1..room can hold the needle's key
        if room < 2:
            raise ProbeError(f"length {length:,} is too short for the demo's probes (more than {task.queries + 4}).")
        for sample in range(samples):
            for depth in depths:
                rng = random.Random(f"{seed}/demo/{length}/{sample}/{depth}")
                ids = [task.filler_base + rng.randrange(task.num_filler) for _ in range(length)]
                key = task.key_base + rng.randrange(task.num_keys)
                value = task.value_base + rng.randrange(task.num_values)
                place = 1 + round(depth / 100 * (room - 1))
                ids[0], ids[place], ids[place + 1] = BOS, key, value
                ids[length - task.queries - 1:] = [key] * (task.queries + 1)
                ids[-1] = value
                probe = Probe("demo", length, depth, place, length - 1, (value,))
                out.append(ProbeSequence(torch.tensor([ids]), [probe],
                                         needle_spans=[(place, 2)], context_span=(1, length - task.queries - 1)))
    return out

