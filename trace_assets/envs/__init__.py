"""Environments: the protocol (``base``), the built-in ``retail`` domain, and a name registry."""

from __future__ import annotations

from .base import Environment


def get_environment(name: str) -> Environment:
    """The environment registered under ``name`` (currently only ``"retail"``)."""
    if name == "retail":
        from .retail import RetailEnv  # imported lazily: keeps ``import trace_assets.envs`` light

        return RetailEnv()
    raise KeyError(f"unknown environment {name!r}; known: ['retail']")
