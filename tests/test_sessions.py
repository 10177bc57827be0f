"""Chat sessions as tokens and labels (ulysses_train.data.sessions).

The reference for every label check is computed here, independently of the module: the assistant turns
are found in the rendered text with a regular expression (``<|im_start|>assistant\\n`` ... ``<|im_end|>``),
and token positions come from decoding the token prefixes, not from the module's offsets or renderings.
"""
import copy
import json
import re

import pytest
from chat_sessions import (CHATML, CHATML_MARKED, QWEN3, QWEN3_5, SESSIONS, call, chat_tokenizer, expected_labels,
                           token_char_ends)

from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.data import sessions
from ulysses_train.data.sessions import render_session
from ulysses_train.data.sources import DataError
from ulysses_train.errors import UserError

@pytest.fixture(scope="module")
def chatml(bpe_tokenizer):
    return chat_tokenizer(bpe_tokenizer, CHATML)


@pytest.fixture(scope="module")
def qwen3(bpe_tokenizer):
    return chat_tokenizer(bpe_tokenizer, QWEN3)


@pytest.fixture(scope="module")
def qwen3_5(bpe_tokenizer):
    return chat_tokenizer(bpe_tokenizer, QWEN3_5)


def assert_exact(tokenizer, messages, result):
    ids = result["input_ids"]
    assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    assert len(result["labels"]) == len(ids)
    assert result["labels"] == expected_labels(tokenizer, messages, ids)


@pytest.mark.parametrize("template", ["chatml", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_labels_are_exactly_the_assistant_turns(request, template, name):
    tokenizer = request.getfixturevalue(template)
    messages = SESSIONS[name]
    result = render_session(tokenizer, messages)
    assert_exact(tokenizer, messages, result)
    assert all(isinstance(x, int) for x in result["input_ids"] + result["labels"])
    # Every assistant turn carries labels, every other turn none: the labelled text decodes to the turns.
    labelled = tokenizer.decode([t for t in result["labels"] if t != IGNORE_INDEX])
    assert labelled.count("<|im_end|>") == sum(m["role"] == "assistant" for m in messages)
    assert "<|im_start|>" not in labelled and "question" not in labelled and "you are" not in labelled


def test_qwen3_labels_earlier_turns_as_the_full_rendering_shows_them(qwen3):
    """The decision: tokens are the full rendering, in which Qwen3 drops the <think> blocks of assistant
    turns before the last user query; those turns are labelled without reasoning, the later ones with it."""
    messages = SESSIONS["agent"]
    result = render_session(qwen3, messages)
    labelled = qwen3.decode([t for t in result["labels"] if t != IGNORE_INDEX])
    assert "need ls" not in labelled and "both read" not in labelled  # dropped by the template, before turn 8
    assert "listing" in labelled and "a says hello" in labelled
    assert "count words" in labelled and "confirmed" in labelled  # after the last user query: kept
    # The prefix renderings disagree with the full one here, so the anchored search is the one used.
    text = qwen3.apply_chat_template(messages, tokenize=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prefixes = sessions._prefix_renderings(qwen3, messages, "session")
    assert sessions._spans_by_prefix(qwen3, messages, text, turns, "session", prefixes) is None


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_prefix_and_anchored_spans_agree_on_chatml(chatml, name):
    messages = SESSIONS[name]
    text = chatml.apply_chat_template(messages, tokenize=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prefixes = sessions._prefix_renderings(chatml, messages, "session")
    by_prefix = sessions._spans_by_prefix(chatml, messages, text, turns, "session", prefixes)
    if messages[0]["role"] == "assistant":  # no prefix before turn 0 (transformers renders no empty chat)
        assert by_prefix is None
        anchored = sessions._spans_by_anchor(chatml, messages, text, turns, "session", prefixes)
        later = [(len(chatml.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)),
                  len(prefixes[i + 1].rstrip())) for i in turns[1:]]
        assert anchored[1:] == later and anchored[0] == (len("<|im_start|>assistant\n"), text.index("<|im_end|>") + 10)
        return
    assert by_prefix is not None
    assert by_prefix == sessions._spans_by_anchor(chatml, messages, text, turns, "session", prefixes)


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_generation_marker_cross_check(bpe_tokenizer, name):
    """With {% generation %} markers, transformers' assistant mask equals the labelled positions
    (the module does not use the markers)."""
    tokenizer = chat_tokenizer(bpe_tokenizer, CHATML_MARKED)
    messages = SESSIONS[name]
    result = render_session(tokenizer, messages)
    assert_exact(tokenizer, messages, result)
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == result["input_ids"]
    assert list(out["assistant_masks"]) == [int(label != IGNORE_INDEX) for label in result["labels"]]


def wrong_labels(tokenizer, messages, mistake):
    """Deliberately wrong implementations, token prefixes of the prefix renderings: "header" labels
    the assistant header too, "no_eot" stops before <|im_end|>, "newline" also labels the newline after it."""
    def count(k, **kwargs):
        return len(tokenizer.apply_chat_template(messages[:k], tokenize=True, return_dict=False, **kwargs))
    ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    labels = [IGNORE_INDEX] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = count(i) if mistake == "header" else count(i, add_generation_prompt=True)
        end = count(i + 1) - (2 if mistake == "no_eot" else 0 if mistake == "newline" else 1)
        labels[start:end] = ids[start:end]
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("mistake", ["header", "no_eot", "newline"])
def test_negative_controls_fail_the_check(chatml, mistake):
    messages = SESSIONS["system_multi"]
    with pytest.raises(AssertionError):
        assert_exact(chatml, messages, wrong_labels(chatml, messages, mistake))
    # ...while the same construction with no mistake passes it (ChatML: "\n" after <|im_end|> is one token)
    assert_exact(chatml, messages, wrong_labels(chatml, messages, "none"))


@pytest.mark.parametrize("template", ["chatml", "qwen3", "qwen3_5"])
def test_loss_on_all_labels_everything(request, template):
    tokenizer = request.getfixturevalue(template)
    result = render_session(tokenizer, SESSIONS["agent"], loss_on="all")
    assert result["labels"] == result["input_ids"]
    assert result["input_ids"] == list(tokenizer.apply_chat_template(SESSIONS["agent"], return_dict=False))


def test_no_assistant_turn_is_none(chatml):
    assert render_session(chatml, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) is None


def message_of(tokenizer, messages, **kwargs):
    with pytest.raises(DataError) as caught:
        render_session(tokenizer, messages, **kwargs)
    assert isinstance(caught.value, UserError)
    text = str(caught.value)
    assert "\n" not in text
    return text


def test_bad_sessions_name_the_row_turn_and_fix(chatml, qwen3, bpe_tokenizer):
    text = message_of(chatml, "hello", row=7)
    assert "session 7" in text and "list of messages" in text
    assert "empty" in message_of(chatml, [], row=7)
    text = message_of(chatml, [{"role": "user", "content": "x"}, "assistant: y"], row=3)
    assert "session 3, turn 1" in text and "dict" in text
    text = message_of(chatml, [{"role": "user", "content": "x"}, {"role": "assistant", "text": "y"}], row=3)
    assert "turn 1" in text and "'content'" in text
    text = message_of(chatml, [{"content": "x"}], row=3)
    assert "turn 0" in text and "'role'" in text
    text = message_of(chatml, [{"role": 1, "content": "x"}], row=3)
    assert "turn 0" in text and "role must be a string" in text
    # a role the template rejects (raise_exception), and one it silently drops (Qwen3 ignores unknown roles)
    bad_role = [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"},
                {"role": "assistant", "content": "z"}]
    text = message_of(chatml, bad_role, row=5)
    assert "session 5" in text and "refused" in text and "Unknown role: robot" in text and "roles" in text
    text = message_of(qwen3, bad_role, row=5)
    assert "session 5, turn 1" in text and "'robot'" in text and "renders to nothing" in text
    # no chat template
    plain = copy.deepcopy(bpe_tokenizer)
    plain.chat_template = None
    text = message_of(plain, SESSIONS["one_turn"], row=2)
    assert "no chat template" in text and "raw text" in text and "chat_template" in text
    assert "loss_on" in message_of(chatml, SESSIONS["one_turn"], loss_on="assistants")


@pytest.mark.parametrize("opening", ["\n\n", "    "])
def test_a_token_straddling_the_turn_edge_is_learned_with_the_assistant_turn(bpe_tokenizer, opening):
    """A reply that opens with "\\n\\n" (or indentation) merges with the header's newline into one token (here an
    added token makes this tokenizer merge them, as real ones do). Rule: a token is learned when it holds a
    character of an assistant turn. Reference: the turn's characters by regular expression, each token's characters
    from decoding prefixes; negative control: the rule "only tokens wholly inside a turn" labels otherwise."""
    from tokenizers import AddedToken

    tokenizer = chat_tokenizer(bpe_tokenizer, CHATML)
    tokenizer.add_tokens([AddedToken("\n" + opening, normalized=False)])
    messages = [{"role": "user", "content": "abc def"}, {"role": "assistant", "content": opening + "jkl mno"},
                {"role": "user", "content": "ghi"}, {"role": "assistant", "content": opening + "pqr"}]
    result = render_session(tokenizer, messages)
    ids = result["input_ids"]
    text = tokenizer.decode(ids)
    spans = [(m.start(1), m.end(1)) for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, re.S)]
    ends = token_char_ends(tokenizer, ids)
    starts = [0] + ends[:-1]
    straddling = [n for n in range(len(ids)) if any(starts[n] < a < ends[n] for a, _ in spans)]
    assert len(straddling) == 2  # the case really arises, once per turn
    holds = [token if any(a < end and start < b for a, b in spans) else IGNORE_INDEX
             for token, start, end in zip(ids, starts, ends)]
    inside = [token if any(a <= start and end <= b for a, b in spans) else IGNORE_INDEX
              for token, start, end in zip(ids, starts, ends)]
    assert result["labels"] == holds and holds != inside
    assert all(result["labels"][n] == ids[n] for n in straddling)


def test_a_session_that_cannot_be_labelled_is_skipped_and_counted(qwen3, tmp_path):
    """Qwen3's template needs the anchored search (it re-renders earlier turns); a user quoting the assistant
    header makes the header count differ from the assistant turns, so that session cannot be labelled. The corpus
    is still prepared: that session skipped and counted, the others exactly labelled (render_session alone still
    raises, naming the session)."""
    import json as _json

    from ulysses_train.data.corpus import build_packed_dataset
    from ulysses_train.data.form import DataForm

    quoting = [{"role": "user", "content": "say <|im_start|>assistant\nplease"}, {"role": "assistant", "content": "no"},
               {"role": "user", "content": "why"}, {"role": "assistant", "content": "because"}]
    rows = [SESSIONS["system_multi"], quoting, SESSIONS["one_turn"], SESSIONS["assistant_then_user_last"][:2]]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(_json.dumps({"messages": m}) + "\n" for m in rows))
    _, summary = build_packed_dataset(source, qwen3, 512, form=DataForm(format="chat", packing="glue"),
                                      cache_dir=tmp_path / "cache")
    assert (summary.documents, summary.empty_documents, summary.unlabelled_sessions) == (3, 1, 1)
    assert "1 whose turns could not be located, skipped" in str(summary)
    expected = sum(len(render_session(qwen3, m)["input_ids"]) for i, m in enumerate(rows) if i != 1)
    assert summary.document_tokens == expected
    with pytest.raises(DataError, match="assistant header"):
        render_session(qwen3, quoting)


def test_qwen3_5_session_with_reasoning_and_a_tool_call_through_data_format_chat(qwen3_5, tmp_path):
    """A Qwen3.5 agent session (system prompt, a <think> block inside the content, a tool call with two arguments,
    a tool result, reasoning given as `reasoning_content`) prepared as `data.format: chat` with document packing:
    the tokens are the rendering written out here by hand from the template, and the learned tokens are exactly
    the two spans marked by hand (after `<think>\\n`, which the generation prompt writes, through <|im_end|>).
    Before anything else this checks the template's refusal that the data path must live with: the system prompt
    alone (a prefix of the session) cannot be rendered."""
    import json as _json

    import numpy as np

    from ulysses_train.data.corpus import build_packed_dataset
    from ulysses_train.data.form import DataForm

    messages = [{"role": "system", "content": "you are a coding agent"},
                {"role": "user", "content": "which files are here"},
                {"role": "assistant", "content": "<think>\nlist them first\n</think>\n\nlooking",
                 "tool_calls": [call("ls", path=".", depth=1)]},
                {"role": "tool", "content": "main.py README.md"},
                {"role": "assistant", "content": "two: main.py and README.md", "reasoning_content": "two files"}]
    with pytest.raises(Exception, match="No user query found"):
        qwen3_5.apply_chat_template(messages[:1], tokenize=False)
    first = ("list them first\n</think>\n\nlooking\n\n<tool_call>\n<function=ls>\n<parameter=path>\n.\n"
             "</parameter>\n<parameter=depth>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>")
    second = "two files\n</think>\n\ntwo: main.py and README.md<|im_end|>"
    text = ("<|im_start|>system\nyou are a coding agent<|im_end|>\n<|im_start|>user\nwhich files are here<|im_end|>\n"
            f"<|im_start|>assistant\n<think>\n{first}\n<|im_start|>user\n<tool_response>\nmain.py README.md\n"
            f"</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n{second}\n")
    spans = [(text.index(piece), text.index(piece) + len(piece)) for piece in (first, second)]
    source = tmp_path / "sessions.jsonl"
    source.write_text(_json.dumps({"messages": messages}) + "\n")
    dataset, summary = build_packed_dataset(source, qwen3_5, 1024, form=DataForm(format="chat", packing="documents"),
                                            cache_dir=tmp_path / "cache")
    (row,) = list(dataset)
    length = int(row["document_lengths"][0])
    ids, labels = [int(t) for t in row["input_ids"][:length]], [int(t) for t in row["labels"][:length]]
    assert qwen3_5.decode(ids) == text and summary.documents == 1
    ends = token_char_ends(qwen3_5, ids)
    starts = [0] + ends[:-1]
    learned = [any(a <= start and end <= b for a, b in spans) for start, end in zip(starts, ends)]
    assert labels == [token if keep else IGNORE_INDEX for token, keep in zip(ids, learned)]
    runs = np.split(np.array(labels), np.flatnonzero(np.diff(np.array(labels) == IGNORE_INDEX)) + 1)
    assert [qwen3_5.decode(run) for run in runs if run[0] != IGNORE_INDEX] == [first, second]


def test_tool_call_arguments_that_are_not_a_json_object_are_named(chatml, qwen3, qwen3_5, tmp_path):
    """Issue 41: arguments that are not a JSON object (a string that is not JSON, a list, a number) failed deep in
    Qwen3.5's template ("Can only get item pairs from a mapping", with a hint about roles) and rendered as garbage
    under others (Qwen3 prints a string as it is). Now one line naming the session, turn and tool call, the arguments,
    and the fix, whatever the template; through the early checks with the file and line. A JSON string of an object
    (OpenAI's form) still renders where the template prints strings (Qwen3, unchanged), and where the template needs
    an object (Qwen3.5) the message says so instead of Jinja's."""
    from ulysses_train.config import DataConfig
    from ulysses_train.data.corpus import check_data_inputs

    def session(arguments):
        return [{"role": "user", "content": "list"},
                {"role": "assistant", "content": "", "tool_calls": [call("ls"), call("ls")]},
                {"role": "tool", "content": "a"}, {"role": "assistant", "content": "done"}]

    for arguments in ("ls -la", ["a", "b"], 3, "[1, 2]"):
        messages = session(arguments)
        messages[1]["tool_calls"][1]["function"]["arguments"] = arguments
        for tokenizer in (chatml, qwen3, qwen3_5):
            text = message_of(tokenizer, messages, row=4)
            assert text.startswith("session 4, turn 1, tool call 1: arguments ") and repr(arguments) in text
            assert "must be an object" in text and "Can only get item pairs" not in text
    as_string = session(None)
    as_string[1]["tool_calls"][0]["function"]["arguments"] = '{"path": "."}'
    rendered = qwen3.decode(render_session(qwen3, as_string)["input_ids"])
    assert '"arguments": {"path": "."}}' in rendered  # printed as written
    text = message_of(qwen3_5, as_string, row=4)
    assert text.startswith("session 4, turn 1: this chat template needs tool-call arguments as a JSON object")
    as_string[1]["tool_calls"][0]["function"]["arguments"] = {"path": "."}
    assert render_session(qwen3_5, as_string) is not None  # negative control: the same call as an object renders
    tokenizer_dir = tmp_path / "tokenizer"
    chatml.save_pretrained(tokenizer_dir)
    source = tmp_path / "s.jsonl"
    bad = session(None)
    bad[1]["tool_calls"][1]["function"]["arguments"] = "ls -la"
    source.write_text(json.dumps({"messages": session(None)}) + "\n" + json.dumps({"messages": bad}) + "\n")
    with pytest.raises(DataError, match=r"s\.jsonl, line 2, turn 1, tool call 1: arguments 'ls -la' are not a JSON"):
        check_data_inputs(DataConfig(source=str(source), tokenizer=str(tokenizer_dir), format="chat"), "unused",
                          pad_multiple=2)


def test_a_long_message_is_tokenized_once(qwen3, monkeypatch):
    """A 50 MB chat message took over twice a plain row's time (and growing memory): its rendering was tokenized
    twice (apply_chat_template's tokens, then offsets for the labels) and labelled in a Python loop. Now one
    tokenization with offsets gives both (apply_chat_template's tokens are that tokenization: checked by
    assert_exact), counted here in characters tokenized; control: loss_on all, which needs no offsets, tokenizes once
    too, and calling the tokenizer twice counts twice."""
    words = " ".join(f"w{n % 97}" for n in range(1500))
    messages = [{"role": "user", "content": words}, {"role": "assistant", "content": "done " + words[:99]}]
    tokenized = []
    real = type(qwen3)._encode_plus

    def counting(self, text, *args, **kwargs):
        tokenized.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(qwen3), "_encode_plus", counting)
    result = render_session(qwen3, messages)
    rendering = len(qwen3.apply_chat_template(messages, tokenize=False))
    assert tokenized == [rendering]  # one pass over the rendering
    tokenized.clear()
    monkeypatch.setattr(type(qwen3), "_encode_plus", real)
    assert_exact(qwen3, messages, result)
    monkeypatch.setattr(type(qwen3), "_encode_plus", counting)
    render_session(qwen3, messages, loss_on="all")
    qwen3(words)
    assert len(tokenized) == 2
