"""Environments: the protocol (``base``), the built-in ``retail`` domain, MCP servers (``mcp``, with
tau2-bench's format and grading in ``tau2``), and a name registry."""

from __future__ import annotations

from .base import Environment


KNOWN = ("retail", "tau2_airline")


def get_environment(name: str) -> Environment:
    """The environment registered under ``name``: ``"retail"`` (built in) or ``"tau2_airline"``
    (tau2-bench's airline domain over its MCP server; needs the ``tau2`` extra). Environments are
    cached per process: an MCP environment owns a server process that its episodes share."""
    if name not in KNOWN:
        raise KeyError(f"unknown environment {name!r}; known: {list(KNOWN)}")
    if name not in _CACHE:
        if name == "retail":
            from .retail import RetailEnv  # imported lazily: keeps ``import trace_assets.envs`` light

            return RetailEnv()
        from .mcp import McpEnv
        from .tau2 import airline_spec, judge_from_settings, user_factory

        _CACHE[name] = McpEnv(airline_spec(), user_factory=user_factory(), judge=judge_from_settings())
    return _CACHE[name]


_CACHE: dict[str, Environment] = {}
