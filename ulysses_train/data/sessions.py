"""A chat session (a `messages` list of {role, content} turns, the usual form of chat datasets) as tokens and
labels.

``render_session(tokenizer, messages, loss_on="assistant")`` returns ``{"input_ids": [...], "labels": [...]}``,
two 1-D lists of Python ints of equal length (what ``datasets.map`` stores; packing turns them into
tensors later), or ``None`` for a session with no assistant turn under ``loss_on="assistant"`` (nothing of it
would be learned; the caller skips and counts it).

Tokens are exactly ``tokenizer.apply_chat_template(messages, tokenize=True)``: the whole conversation as
the model sees it at inference. Labels are not shifted (the trainer shifts: the label at position p is
token p, predicted from p-1). ``loss_on="all"``: labels = input_ids. ``loss_on="assistant"``: labels on
the tokens of each assistant turn, from the end of its header (``<|im_start|>assistant\\n``) through the
end-of-turn token that closes it (``<|im_end|>``, not the newline the template writes after it, which the
model never generates); IGNORE_INDEX everywhere else (system, user, tool results, headers).

How the assistant spans are found, without ``{% generation %}`` markers (Qwen3's template has none):
the full conversation is rendered as text, and each assistant turn i is located by two prefix
renderings: ``messages[:i]`` with ``add_generation_prompt=True`` (its header ends there) and
``messages[:i+1]`` (its turn ends there, trailing whitespace excluded). Both must be text prefixes of the
full rendering; the character spans are then mapped to tokens through the fast tokenizer's offsets.

A token that straddles a span edge (a reply that opens with "\\n\\n" merges with the newline that ends the
template's header into one token) is labelled: a token is learned when it holds at least one character of an
assistant turn. The model predicts it where the assistant's reply begins (or ends), so predicting it is producing
the assistant's text; leaving it out would never teach the reply's first characters, and no token holds characters
of two turns' content (the header between them is never empty).

Templates that re-render earlier turns (Qwen3: an assistant turn before the last user query loses its
``<think>`` block, and the final assistant turn gets an empty ``<think>\\n\\n</think>\\n\\n`` that a
non-final one does not) fail the prefix check. Then the spans are anchored on the full rendering itself:
the generation header (the text ``add_generation_prompt`` appends) must occur exactly once per assistant
turn, and each span runs from the end of a header to the first end-of-turn token after it (the special
token the turn's own rendering ends with). So for Qwen3 the labels are the assistant turns *as the full
rendering shows them*: earlier turns without their reasoning, exactly as the tokens are. A generation header
of several lines whose later lines only some turns show (Qwen3.5's ``<|im_start|>assistant\\n<think>\\n``:
turns after the last user query open with ``<think>\\n``, earlier ones do not) is anchored on its first
line(s) when the whole header does not occur once per turn; where a turn does show the rest, that rest is the
prompt's, not learned (the model writes what follows the generation prompt, nothing before). A prefix the
template refuses although it renders the whole session (Qwen3.5 raises on a conversation without a user query:
the system prompt alone, or an opening assistant turn) is simply not used; the anchored search needs no such
prefix. Training on every turn's reasoning would need one sample per assistant turn; that is not done here.
Where neither way works (header count differs, no end-of-turn token) the session cannot be labelled:
UnlabelledSession, which the preparation of a corpus counts and skips (one odd session must not stop a corpus)
and `render_session`'s callers otherwise see as a DataError.

Also checked when locating turns (loss_on="assistant"): a message that renders to nothing (Qwen3's template
silently drops a role it does not know) is refused. Message text that itself contains the template's
header or end-of-turn strings is not supported (the anchored search cannot label it when the header count is off:
UnlabelledSession).

Cost: one rendering per message plus the full one, so O(turns x length) characters of templating.
"""
from __future__ import annotations

import json

from ulysses_train.constants import IGNORE_INDEX
from ulysses_train.data.sources import DataError

LOSS_ON = ("assistant", "all")


class UnlabelledSession(DataError):
    """A well-formed session whose assistant turns this template's rendering does not let us locate; a corpus
    skips and counts it (render_sessions), a single session raises it."""


def render_session(tokenizer, messages, loss_on: str = "assistant", *, row=None) -> dict | None:
    """``{"input_ids": list[int], "labels": list[int]}`` for one session, or None if it has no assistant
    turn and only assistant turns are learned. ``row`` (an index or name) only goes into error messages. Raises DataError for bad input."""
    where = "session" if row is None else f"session {row}"
    if loss_on not in LOSS_ON:
        raise DataError(f"loss_on must be one of {', '.join(LOSS_ON)}, not {loss_on!r}.")
    check_messages(messages, where)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template, so a chat session cannot be rendered; "
                        "use raw text documents instead, or set tokenizer.chat_template (a Jinja string) "
                        "or pick a tokenizer that has one.")
    if loss_on == "assistant" and not any(message["role"] == "assistant" for message in messages):
        return None
    if loss_on == "all":
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        return {"input_ids": ids, "labels": list(ids)}
    text = _render(tokenizer, messages, where)
    spans = assistant_spans(tokenizer, messages, text, where)
    return _ids_and_labels(tokenizer, text, spans, where)


def check_messages(messages, where: str = "session") -> None:
    """A session is a non-empty list of dicts, each with a string ``role`` and a ``content`` (a string, a
    list of parts, or None for an assistant turn that only calls tools). The rule for an assistant turn with null
    content and no tool calls is to refuse it (session, turn): rendered, it is an empty reply the loss would teach,
    and whether the data meant "say nothing" or lost the reply is the user's to say (content "" trains an empty
    reply on purpose)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: a session must be a non-empty list of messages "
                        f"[{{\"role\": ..., \"content\": ...}}, ...], not {type(messages).__name__}"
                        f"{' (empty)' if isinstance(messages, list) else ''}.")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}, turn {turn}: a message must be a dict with \"role\" and \"content\", "
                            f"not {type(message).__name__}.")
        missing = [key for key in ("role", "content") if key not in message]
        if missing:
            raise DataError(f"{where}, turn {turn}: the message has no {' or '.join(map(repr, missing))} key; "
                            "every message needs \"role\" and \"content\" (content may be \"\" or null "
                            "for an assistant turn with tool_calls).")
        if not isinstance(message["role"], str):
            raise DataError(f"{where}, turn {turn}: role must be a string such as \"user\" or \"assistant\", "
                            f"not {type(message['role']).__name__}.")
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and message["content"] is None and not calls:
            raise DataError(f"{where}, turn {turn}: an assistant turn with null content and no tool_calls would "
                            f"train as an empty reply; give the reply as its content, add the tool_calls it made, "
                            f"or drop the turn.")
        for n, call in enumerate(calls if isinstance(calls, list) else []):
            _check_arguments(call, f"{where}, turn {turn}, tool call {n}")


def _arguments(call):
    """A tool call's arguments (OpenAI's form nests them under "function"), or None where it has none."""
    holder = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
    return holder.get("arguments") if isinstance(holder, dict) else None


def _check_arguments(call, where: str) -> None:
    """Tool-call arguments are a JSON object (the form transformers' chat templates take) or a string holding one
    (OpenAI's form, which some templates print as it is): anything else renders as garbage or fails deep in the
    template (Jinja's "Can only get item pairs from a mapping")."""
    arguments = _arguments(call)
    if arguments is None or isinstance(arguments, dict):
        return
    if isinstance(arguments, str):
        try:
            if isinstance(json.loads(arguments), dict):
                return
        except ValueError:
            pass
    shown = arguments if len(repr(arguments)) <= 60 else f"{repr(arguments)[:57]}..."
    raise DataError(f"{where}: arguments {shown!r} are not a JSON object; tool-call arguments must be an object "
                    f"such as {{\"path\": \".\"}} (or a JSON string of one). Fix the session's tool_calls.")


def assistant_spans(tokenizer, messages, text: str, where: str = "session") -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant turns in ``text`` (the full rendering)."""
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    prefixes = _prefix_renderings(tokenizer, messages, where)
    spans = _spans_by_prefix(tokenizer, messages, text, turns, where, prefixes)
    if spans is not None:
        return spans
    return _spans_by_anchor(tokenizer, messages, text, turns, where, prefixes)


def _render(tokenizer, messages, where, **kwargs) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # jinja2 TemplateError from raise_exception, or a template bug
        _raise_if_arguments_must_be_objects(tokenizer, messages, where, kwargs)
        roles = sorted({message["role"] for message in messages})
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise DataError(f"{where}: the chat template refused the messages (roles {', '.join(roles)}): "
                        f"{detail}. Use the roles and fields this model's template expects "
                        "(system, user, assistant, tool) or fix the session.") from None


def _raise_if_arguments_must_be_objects(tokenizer, messages, where, kwargs) -> None:
    """A template that refuses tool-call arguments given as JSON strings but renders them as objects (Qwen3.5's
    iterates their items) is named as such, with the turn, rather than by Jinja's message."""
    turns = [turn for turn, message in enumerate(messages)
             if any(isinstance(_arguments(call), str) for call in message.get("tool_calls") or [])]
    if not turns:
        return
    parsed = [{**message, "tool_calls": [_with_parsed_arguments(call) for call in message["tool_calls"]]}
              if turn in turns else message for turn, message in enumerate(messages)]
    if _prefix_render(tokenizer, parsed, **kwargs) is not None:
        raise DataError(f"{where}, turn {turns[0]}: this chat template needs tool-call arguments as a JSON object, "
                        "and they are a JSON string; write them as an object ({\"path\": \".\"}, not "
                        "\"{\\\"path\\\": ...}\") in the session's tool_calls.")


def _with_parsed_arguments(call):
    if not isinstance(_arguments(call), str):
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
    return {**call, "arguments": json.loads(call["arguments"])}


def _prefix_render(tokenizer, messages, **kwargs) -> str | None:
    """The rendering of a prefix of a session whose whole rendering succeeded, or None where the template
    refuses that prefix (Qwen3.5 raises on a conversation without a user query)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # jinja2 TemplateError from raise_exception: a rule the whole session keeps
        return None


def _prefix_renderings(tokenizer, messages, where) -> list[str | None]:
    """``out[k]`` is the rendering of ``messages[:k]`` (k >= 1; None where the template refuses that prefix);
    checks that no message renders to nothing (a template that silently drops a role it does not know)."""
    out = [""]
    for k in range(1, len(messages) + 1):
        out.append(_prefix_render(tokenizer, messages[:k]))
        if out[k] is not None and out[k] == out[k - 1]:
            raise DataError(f"{where}, turn {k - 1}: role {messages[k - 1]['role']!r} renders to nothing under "
                            "this chat template (the template ignores it); use a role it knows "
                            "(system, user, assistant, tool).")
    return out


def _header_end(tokenizer, messages, i, where) -> str | None:
    """The rendering of ``messages[:i]`` plus the generation prompt; None for i = 0 (transformers refuses
    to render an empty conversation) or where the template refuses that prefix, so such a turn is anchored."""
    if i == 0:
        return None
    return _prefix_render(tokenizer, messages[:i], add_generation_prompt=True)


def _spans_by_prefix(tokenizer, messages, text, turns, where, prefixes):
    spans = []
    for i in turns:
        head = _header_end(tokenizer, messages, i, where)
        whole = prefixes[i + 1]
        if head is None or whole is None or not text.startswith(head) or not text.startswith(whole) \
                or len(head) > len(whole):
            return None
        end = len(whole.rstrip())
        if end <= len(head):
            return None
        spans.append((len(head), end))
    return spans


def _spans_by_anchor(tokenizer, messages, text, turns, where, prefixes):
    header = eot = None
    for i in turns:  # the generation header and end-of-turn token, from the first turn that shows them
        if header is None:
            head = _header_end(tokenizer, messages, i, where)
            if head is not None and prefixes[i] is not None and head.startswith(prefixes[i]) \
                    and len(head) > len(prefixes[i]):
                header = head[len(prefixes[i]):]
        if eot is None and prefixes[i + 1] is not None:
            eot = _trailing_special_token(tokenizer, prefixes[i + 1].rstrip())
        if header and eot:
            break
    fix = ("; this chat template renders the conversation in a way the assistant turns cannot be located "
           "in (render it as raw text with loss on all tokens, or use a template with {% generation %} "
           "markers).")
    if not header or not eot:
        raise UnlabelledSession(f"{where}: cannot find this chat template's assistant header or end-of-turn token{fix}")
    starts = _anchor_starts(text, header, len(turns))
    if starts is None:
        raise UnlabelledSession(f"{where}: the assistant header {header!r} occurs {len(_occurrences(text, header))} "
                                f"times in the rendering but the session has {len(turns)} assistant turns{fix}")
    spans = []
    for n, start in enumerate(starts):
        close = text.find(eot, start)
        limit = starts[n + 1] if n + 1 < len(starts) else len(text)
        if close < 0 or close + len(eot) > limit:
            raise UnlabelledSession(f"{where}, turn {turns[n]}: no end-of-turn token {eot!r} closes this assistant "
                            f"turn in the rendering{fix}")
        spans.append((start, close + len(eot)))
    return spans


def _occurrences(text: str, anchor: str) -> list[int]:
    found, at = [], text.find(anchor)
    while at >= 0:
        found.append(at)
        at = text.find(anchor, at + len(anchor))
    return found


def _anchor_starts(text: str, header: str, turns: int) -> list[int] | None:
    """Where each assistant turn's learned text begins: after the generation header, which must occur once per
    turn; else after its first line(s), if those do (the longest such), skipping the header's remaining lines
    where a turn shows them (Qwen3.5's ``<think>\\n``, written only after the last user query). None: no anchor
    occurs once per turn."""
    cuts = [n + 1 for n, char in enumerate(header[:-1]) if char == "\n"]
    for anchor in [header, *(header[:n] for n in reversed(cuts))]:
        found = _occurrences(text, anchor)
        if len(found) == turns:
            rest = header[len(anchor):]
            return [at + len(anchor) + (len(rest) if rest and text.startswith(rest, at + len(anchor)) else 0)
                    for at in found]
    return None


def _trailing_special_token(tokenizer, text: str) -> str | None:
    """The longest added (special) token ``text`` ends with, e.g. ``<|im_end|>``."""
    tokens = [token.content if hasattr(token, "content") else str(token)
              for token in tokenizer.get_added_vocab()]
    ends = [token for token in tokens if token and text.endswith(token)]
    return max(ends, key=len) if ends else None


def _ids_and_labels(tokenizer, text, spans, where) -> dict:
    """The session's tokens and labels from one tokenization of its rendering, with offsets: what
    `apply_chat_template(tokenize=True)` computes is exactly this tokenization (the rendering, tokenized without
    special tokens added), so tokenizing once serves both. The labels are found with arrays, not a Python loop:
    a 50 MB message is some ten million tokens."""
    import numpy as np

    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}: assistant-only labels need a fast tokenizer (token offsets); load it with "
                        "use_fast=True or train on all tokens.")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, return_tensors="np")
    ids = encoded["input_ids"][0].astype(np.int64)
    offsets = encoded["offset_mapping"][0].reshape(-1, 2)
    starts, ends = (np.array([span[i] for span in spans] + [len(text) + 1], dtype=np.int64) for i in (0, 1))
    a, b = offsets[:, 0], offsets[:, 1]
    k = np.searchsorted(ends[:-1], a, side="right")  # the first span that ends after the token starts
    inside = (k < len(spans)) & (starts[k] < b) & (a < b)  # holds a character of it (see the module docstring)
    return {"input_ids": ids.tolist(), "labels": np.where(inside, ids, IGNORE_INDEX).tolist()}


# ------------------------------------------------------------------ a corpus of sessions


RENDER_BATCH_SESSIONS = 16


def check_chat_template(tokenizer, format_option: str = "data.format") -> None:
    """A tokenizer that can render sessions; else a DataError pointing to raw text or a template."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"tokenizer {name!r} has no chat template, so chat sessions ({format_option} chat) cannot be "
                        f"rendered. Fix: a tokenizer with one (an instruct model's, or add \"chat_template\" to its "
                        f"tokenizer_config.json), or train on raw text ({format_option} text).")


def render_sessions(corpus, tokenizer, messages_field: str, loss_on: str, path, num_proc=None, fingerprint=None,
                    source="corpus"):
    """One row of int32 ``input_ids`` and ``labels`` per session (render_session); a session skipped for
    having no assistant turn, or whose turns cannot be labelled (UnlabelledSession; ``unlabelled`` true), becomes
    an empty row (packing counts both). ``source`` names the corpus in errors."""
    from functools import partial

    from datasets import Features, List, Value

    from ulysses_train.data.sources import useful_procs

    return corpus.map(
        partial(_render_batch, tokenizer=tokenizer, field=messages_field, loss_on=loss_on, source=source),
        batched=True,
        with_indices=True,
        batch_size=RENDER_BATCH_SESSIONS,
        writer_batch_size=RENDER_BATCH_SESSIONS,
        new_fingerprint=fingerprint,
        num_proc=useful_procs(num_proc, len(corpus)),
        remove_columns=corpus.column_names,
        features=Features({"input_ids": List(Value("int32")), "labels": List(Value("int32")),
                           "unlabelled": Value("bool")}),
        cache_file_name=str(path),
        desc="Rendering sessions",
    )


def _render_batch(batch: dict, indices: list[int], tokenizer, field: str, loss_on: str, source) -> dict:
    out = {"input_ids": [], "labels": [], "unlabelled": []}
    for messages, index in zip(batch[field], indices):
        try:
            rendered = render_session(tokenizer, plain_messages(messages), loss_on, row=f"{index + 1} of {source}")
        except UnlabelledSession:
            rendered = {"input_ids": [], "labels": [], "unlabelled": True}
        out["input_ids"].append(rendered["input_ids"] if rendered else [])
        out["labels"].append(rendered["labels"] if rendered else [])
        out["unlabelled"].append(bool(rendered and rendered.get("unlabelled")))
    return out


def plain_messages(messages):
    """Messages as the session's JSON had them. Arrow stores a column of dicts as one struct type, so every
    message (and every tool call's arguments) gets every key any row has, set to None where the row had none
    (``tool_calls: None`` on a user turn, ``{"n": 3, "path": None}`` as arguments), and templates test keys
    with ``is defined`` and print arguments with ``tojson``. So None values are dropped at every depth,
    except a message's ``content`` (null content is how an assistant turn that only calls tools is written).
    A null the session's JSON really held inside tool arguments is dropped too; that is the price."""
    if not isinstance(messages, list):
        return messages
    return [_without_none(message, keep=("content",)) if isinstance(message, dict) else message
            for message in messages]


def _without_none(value, keep=()):
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None or key in keep}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value
