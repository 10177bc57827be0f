"""Chat templates, sessions and the independent label reference the session tests share (test_sessions.py,
test_document_packing.py, test_data_checks.py, test_train_data.py): ChatML, Qwen3's and Qwen3.5's templates
written out, a tokenizer carrying one, sessions with reasoning and tool calls, and the labels computed from the
rendered text with a regular expression, not from the module's offsets or renderings."""
import copy
import re

from ulysses_train.constants import IGNORE_INDEX

SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHATML = (
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unknown role: ' + message.role) }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The same template with {% generation %} markers around each assistant turn's content and <|im_end|>,
# for the cross-check against transformers' return_assistant_tokens_mask.
CHATML_MARKED = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{%- if message.content %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's chat template structure (tools block, last-query index, <think> stripping of assistant turns
# before the last user query, tool calls inside the assistant turn, consecutive tool results merged
# into one user turn of <tool_response>s, an empty think block on the final assistant turn).
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


# Qwen3.5's chat template (as Qwen/Qwen3.5-27B and Qwen3.5-35B-A3B ship it; the same text in both) without
# its image and video parts and with the tools preamble shortened, its rendering of text sessions unchanged: the
# system message first only, a session must hold a user query (a conversation without one is refused, so the
# system prompt alone cannot be rendered), every message's content trimmed, an assistant turn after the last user
# query always opened with a <think> block (empty if it has no reasoning), earlier ones without it, tool calls as
# <function=...> blocks of <parameter=...> values, consecutive tool results in one user turn, and the generation
# prompt `<|im_start|>assistant\n<think>\n` (the model writes what follows it).
QWEN3_5 = """{%- macro render_content(content) %}
    {%- if content is string %}{{- content }}
    {%- elif content is none or content is undefined %}{{- '' }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'text' in item %}{{- item.text }}{%- else %}{{- raise_exception('Unexpected item type in content.') }}{%- endif %}
        {%- endfor %}
    {%- else %}{{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content)|trim %}
        {%- if content %}{{- '\\n\\n' + content }}{%- endif %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {%- set content = render_content(messages[0].content)|trim %}
    {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}{{- '\\n\\n' }}{%- endif %}
                {%- else %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\\n</parameter>\\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""


def chat_tokenizer(base, template):
    tokenizer = copy.deepcopy(base)  # the conftest tokenizer is shared by the whole session: leave it as it is
    tokenizer.add_tokens(SPECIAL, special_tokens=True)
    tokenizer.add_tokens(ADDED)
    tokenizer.chat_template = template
    return tokenizer


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SESSIONS = {
    "one_turn": [
        {"role": "user", "content": "abc def ghi"},
        {"role": "assistant", "content": "jkl mno"},
    ],
    "system_multi": [
        {"role": "system", "content": "you are kab"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "second answer\nwith two lines"},
    ],
    "agent": [
        {"role": "system", "content": "you are an agent"},
        {"role": "user", "content": "list the files then read one"},
        {"role": "assistant", "content": "<think>\nneed ls\n</think>\n\nlisting", "tool_calls": [call("ls", path=".")]},
        {"role": "tool", "content": "a.txt b.txt"},
        {"role": "assistant", "content": "", "tool_calls": [call("cat", path="a.txt"), call("cat", path="b.txt")]},
        {"role": "tool", "content": "hello"},
        {"role": "tool", "content": "world"},
        {"role": "assistant", "content": "<think>both read</think>a says hello, b says world"},
        {"role": "user", "content": "thanks, now count"},
        {"role": "assistant", "content": "<think>\ncount words\n</think>\n\ntwo words", "tool_calls": [call("wc")]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "<think>\nconfirmed\n</think>\n\nthere are 2"},
    ],
    "assistant_then_user_last": [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "no reply to this one"},
    ],
    "assistant_first_and_null_content": [
        {"role": "assistant", "content": "hello, what can i do"},
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None, "tool_calls": [call("run", n=3)]},
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "it ran"},
    ],
    "back_to_back_assistant": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "part one"},
        {"role": "assistant", "content": "part two"},
    ],
}


def token_char_ends(tokenizer, ids):
    """End character of each token in the decoded text, from decoding ever longer prefixes."""
    return [len(tokenizer.decode(ids[: n + 1])) for n in range(len(ids))]


def expected_labels(tokenizer, messages, ids):
    """Labels on exactly the text between each ``<|im_start|>assistant\\n`` and its ``<|im_end|>`` (included);
    under Qwen3.5's template after the ``<think>\\n`` that follows the header where a turn has it (its generation
    prompt writes it, so the model never does)."""
    text = tokenizer.decode(ids)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False)
    opened = "(?:<think>\n)?" if tokenizer.chat_template == QWEN3_5 else ""
    spans = [(m.start(1), m.end(1))
             for m in re.finditer(rf"<\|im_start\|>assistant\n{opened}(.*?<\|im_end\|>)", text, re.S)]
    assert len(spans) == sum(message["role"] == "assistant" for message in messages)
    ends = token_char_ends(tokenizer, ids)
    labels = []
    for n, token in enumerate(ids):
        start, end = (ends[n - 1] if n else 0), ends[n]
        inside = any(a <= start and end <= b for a, b in spans)
        assert inside or not any(a < end and start < b for a, b in spans), "a token straddles a span edge"
        labels.append(token if inside else IGNORE_INDEX)
    return labels
