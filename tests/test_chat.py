"""The Qwen2.5 tool-calling template and the tool-call parser."""

from __future__ import annotations

import json

import pytest

from trace_assets.agent.chat import QWEN25_TOOL_TEMPLATE, assistant_message, parse_assistant
from trace_assets.envs.base import ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up x.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]

TOOLS_HEADER = (
    "<|im_start|>system\nYou are a bot.\n\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0], ensure_ascii=False)
    + "\n"
    + json.dumps(TOOLS[1], ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


def _render(tokenizer, messages, tools=None, gen=False):
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)


def test_tokenizer_uses_the_template(tokenizer):
    assert tokenizer.chat_template == QWEN25_TOOL_TEMPLATE


def test_system_tools_and_generation_prompt(tokenizer):
    msgs = [{"role": "system", "content": "You are a bot."}, {"role": "user", "content": "Hi"}]
    assert _render(tokenizer, msgs, TOOLS, gen=True) == TOOLS_HEADER + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _render(tokenizer, msgs) == "<|im_start|>system\nYou are a bot.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_default_system_prompt_without_system_message(tokenizer):
    assert _render(tokenizer, [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_assistant_tool_calls_and_grouped_tool_responses(tokenizer):
    msgs = [
        {"role": "system", "content": "You are a bot."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"x": 1}}},
                {"type": "function", "function": {"name": "ping", "arguments": "{\"a\": \"é\"}"}},
            ],
        },
        {"role": "tool", "name": "lookup", "content": "x=2"},
        {"role": "tool", "name": "ping", "content": "pong"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"name": "ping", "arguments": {}}]},
        {"role": "tool", "content": "pong"},
        {"role": "assistant", "content": "All done."},
    ]
    expected = (
        TOOLS_HEADER
        + "<|im_start|>user\nHi<|im_end|>\n"
        + "<|im_start|>assistant\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"x\": 1}}\n</tool_call>"
        + "\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"a\": \"é\"}}\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\nx=2\n</tool_response>\n<tool_response>\npong\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\npong\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\nAll done.<|im_end|>\n"
    )
    assert _render(tokenizer, msgs, TOOLS) == expected
    # Prefix stability at turn boundaries (a run of tool messages is one turn): the rollout runner
    # relies on it. Inside a run of tool messages it does not hold, and need not.
    for k in range(1, len(msgs)):
        inside_tool_run = msgs[k - 1]["role"] == "tool" and msgs[k]["role"] == "tool"
        assert expected.startswith(_render(tokenizer, msgs[:k], TOOLS)) != inside_tool_run


def test_parse_single_call_with_content_and_im_end():
    p = parse_assistant('Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"x": 1}}\n</tool_call><|im_end|>')
    assert p.content == "Let me check."
    assert p.tool_calls == [ToolCall("lookup", {"x": 1})]
    assert p.errors == []


def test_parse_multiple_calls_and_compact_form():
    text = '<tool_call>{"name":"a","arguments":{}}</tool_call> mid <tool_call>\n{"name": "b", "arguments": {"y": [1]}}\n</tool_call>'
    p = parse_assistant(text)
    assert [c.name for c in p.tool_calls] == ["a", "b"]
    assert p.tool_calls[1].arguments == {"y": [1]}
    assert p.content == "mid"


def test_parse_string_arguments_and_missing_arguments():
    p = parse_assistant('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert p.tool_calls == [ToolCall("a", {"x": 2}), ToolCall("b", {})]


@pytest.mark.parametrize(
    "body, reason",
    [
        ('{"name": "a", "arguments": {"x": 1}', "invalid JSON"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": "a", "arguments": [1, 2]}', "not a JSON object"),
        ('{"name": "a", "arguments": "not json"}', "not JSON"),
        ('["a"]', "not a JSON object"),
        ("", "empty"),
    ],
)
def test_parse_malformed_blocks_become_errors(body, reason):
    p = parse_assistant(f"before <tool_call>{body}</tool_call> after")
    assert p.tool_calls == []
    assert len(p.errors) == 1
    raw, why = p.errors[0]
    assert raw == f"<tool_call>{body}</tool_call>"
    assert reason in why
    assert p.content == "before  after"


def test_parse_unclosed_tag():
    ok = parse_assistant('<tool_call>\n{"name": "a", "arguments": {}}')
    assert ok.tool_calls == [ToolCall("a", {})] and ok.errors == []
    bad = parse_assistant('Sure <tool_call>\n{"name": "a", "argu')
    assert bad.tool_calls == [] and "unclosed" in bad.errors[0][1]
    assert bad.content == "Sure"


@pytest.mark.parametrize("text", ["", "<|im_end|>", "\x00\ufffd garbage }{", "</tool_call>", "<tool_call>" * 3, "{" * 5000])
def test_parse_garbage_never_raises(text):
    p = parse_assistant(text)
    assert isinstance(p.content, str)


def test_assistant_message():
    p = parse_assistant('Hi <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>')
    assert assistant_message(p) == {
        "role": "assistant",
        "content": "Hi",
        "tool_calls": [{"type": "function", "function": {"name": "a", "arguments": {"x": 1}}}],
    }
    assert assistant_message(parse_assistant("plain")) == {"role": "assistant", "content": "plain"}
