"""Chat formatting and tool-call parsing in the Qwen2.5 (hermes) tool-calling format.

Contracts:

* :data:`QWEN25_TOOL_TEMPLATE` renders exactly what Qwen2.5-Instruct's own chat template renders for
  system/user/assistant/tool messages and OpenAI-format ``tools``. So a real Qwen model drops in, and
  vLLM's ``hermes`` tool parser and TRL understand the outputs. ChatML turns are
  ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``; consecutive ``tool`` messages share ONE user turn of
  ``<tool_response>`` blocks. Tool-call ``arguments`` may be dicts (HF convention) or JSON strings.
  Rendering is prefix-stable at turn boundaries: rendering ``messages[:k]`` is a prefix of
  rendering ``messages`` unless the cut falls inside a run of ``tool`` messages (one turn). That is
  what lets the rollout runner tokenize each new segment alone.
* :func:`parse_assistant` never raises. Every ``<tool_call>...</tool_call>`` block (the closing tag
  may be missing at the end of the text) becomes either a :class:`ToolCall` or an ``(raw, reason)``
  error. ``content`` is the text outside all blocks, stripped.
* :func:`assistant_message` builds the OpenAI-format assistant message from a parsed turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from trace_assets.envs.base import Message, ToolCall

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# Qwen2.5-Instruct's template (tool part verbatim). One addition, as in Qwen3: string arguments are
# emitted as-is, so OpenAI-style JSON-string arguments render the same as dict arguments.
QWEN25_TOOL_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {%- if tool_call.arguments is string %}\n"
    "                {{- tool_call.arguments }}\n"
    "            {%- else %}\n"
    "                {{- tool_call.arguments | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass
class ParsedTurn:
    """One assistant turn split into prose, valid tool calls and malformed blocks."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    """``(raw block text, reason)`` for every block that is not a valid tool call."""


def _parse_block(body: str) -> ToolCall | str:
    """A ToolCall, or the reason the block is not one."""
    text = body.strip()
    if not text:
        return "empty tool call"
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return f"invalid JSON: {exc.msg if hasattr(exc, 'msg') else exc}"
    if not isinstance(obj, dict):
        return "tool call is not a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'missing "name"'
    args: Any = obj.get("arguments", {})
    if args is None:
        args = {}
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return '"arguments" is a string that is not JSON'
    if not isinstance(args, dict):
        return '"arguments" is not a JSON object'
    return ToolCall(name=name.strip(), arguments=args)


def parse_assistant(text: str) -> ParsedTurn:
    """Split raw model output into content, tool calls and errors. Never raises."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    text = text.rstrip()
    if text.endswith(IM_END):
        text = text[: -len(IM_END)]
    calls: list[ToolCall] = []
    errors: list[tuple[str, str]] = []
    pieces: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        pieces.append(text[pos : match.start()])
        pos = match.end()
        parsed = _parse_block(match.group(1))
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            unclosed = not match.group(0).endswith("</tool_call>")
            errors.append((match.group(0), parsed + (" (unclosed <tool_call>)" if unclosed else "")))
    pieces.append(text[pos:])
    return ParsedTurn(content="".join(pieces).strip(), tool_calls=calls, errors=errors)


def assistant_message(parsed: ParsedTurn) -> Message:
    """The OpenAI-format assistant message; ``tool_calls`` only when there are some."""
    message: Message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return message


def render(tokenizer: Any, messages: list[Message], tools: list[dict] | None = None, *,
           add_generation_prompt: bool = False) -> str:
    """The conversation as text through ``tokenizer``'s chat template (no tokenization)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
    )
