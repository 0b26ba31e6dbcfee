"""A small stdio MCP server built on the SDK's low-level server API that misbehaves on demand.

Tools: ``echo`` (answers ``{"echo": arguments}``), ``crash`` (the process exits mid-call),
``hang`` (never answers in time), ``garble`` (its reply line on the wire is replaced by text that
is not JSON-RPC) and ``forget`` (a JSON-RPC error, as for a tool the server does not know).
``python fake_mcp_server.py bad_schema`` also lists a tool whose inputSchema is not JSON Schema.
"""

from __future__ import annotations

import io
import json
import os
import sys

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

GARBLE = "GARBLE-THIS-REPLY"
OBJECT = {"type": "object", "properties": {"text": {"type": "string"}}, "additionalProperties": True}


class _GarblingStdout(io.TextIOBase):
    """stdout that replaces any line carrying GARBLE by a line that is not JSON-RPC."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write("this line is not JSON-RPC\n" if GARBLE in text else text)
        return len(text)

    def flush(self) -> None:
        self.raw.flush()


async def list_tools(ctx, params) -> types.ListToolsResult:
    tools = [types.Tool(name=name, description=f"{name} tool", input_schema=OBJECT)
             for name in ("echo", "crash", "hang", "garble", "forget")]
    if "bad_schema" in sys.argv[1:]:
        tools.append(types.Tool(name="broken", description="bad schema", input_schema={"type": "object", "properties": {"x": {"type": 12}}}))
    return types.ListToolsResult(tools=tools)


async def call_tool(ctx, params) -> types.CallToolResult:
    name, args = params.name, params.arguments or {}
    if name == "crash":
        os._exit(3)
    if name == "hang":
        await anyio.sleep(60)
    if name == "forget":
        raise MCPError(code=-32602, message=f"Unknown tool: {name}")
    text = GARBLE if name == "garble" else json.dumps({"echo": args}, sort_keys=True)
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=False)


async def main() -> None:
    server = Server("fake", on_list_tools=list_tools, on_call_tool=call_tool)
    stdin = anyio.wrap_file(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8"))
    stdout = anyio.wrap_file(_GarblingStdout(io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8", line_buffering=True)))
    async with stdio_server(stdin=stdin, stdout=stdout) as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
