"""LLM-backed roles as Dagster resources: the Step-1 analyst and the Step-2 synthesizer.

Both talk to any OpenAI-compatible endpoint (a ``vllm serve``, a hosted provider); both have an
offline default that needs no LLM. API keys come from ``$TRACE_LLM_API_KEY`` unless set.
"""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field


class AnalystResource(ConfigurableResource):
    kind: str = Field(default="heuristic", description="'heuristic' (offline) or 'llm'.")
    base_url: str = Field(default="http://127.0.0.1:8000/v1", description="OpenAI-compatible endpoint.")
    model: str = Field(default="demo", description="Model name the endpoint serves.")
    api_key: str = Field(default="", description="Empty: read $TRACE_LLM_API_KEY at call time.")
    temperature: float = Field(default=0.7, description="Sampling temperature of the labelling runs.")
    max_retries: int = Field(default=2, description="Retries of invalid JSON answers.")

    def build(self):
        """A fresh analyst (its ``calls`` counter starts at 0)."""
        if self.kind == "heuristic":
            from trace_assets.identify.heuristic import HeuristicAnalyst

            return HeuristicAnalyst()
        if self.kind == "llm":
            from trace_assets.identify.llm_analyst import LLMAnalyst
            from trace_assets.llm_client import ChatClient

            client = ChatClient(base_url=self.base_url, model=self.model, api_key=self.api_key)
            return LLMAnalyst(client, temperature=self.temperature, max_retries=self.max_retries)
        raise ValueError(f"analyst kind {self.kind!r} must be 'heuristic' or 'llm'")


class SynthesizerResource(ConfigurableResource):
    kind: str = Field(default="template", description="'template' (offline) or 'llm'.")
    base_url: str = Field(default="http://127.0.0.1:8000/v1", description="OpenAI-compatible endpoint.")
    model: str = Field(default="demo", description="Model name the endpoint serves.")
    api_key: str = Field(default="", description="Empty: read $TRACE_LLM_API_KEY at call time.")
    max_retries: int = Field(default=2, description="Repairs of invalid specs.")

    def synthesize(self, capability: dict, target_env, failed_trajectories: list[dict]) -> tuple[dict, list[str]]:
        """``(spec, rejection reasons of earlier attempts)``; raises ``SynthesisError`` when the
        LLM's specs stay invalid after the retries."""
        if self.kind == "template":
            from trace_assets.synthesize.template import template_spec

            return template_spec(capability, target_env, failed_trajectories=failed_trajectories), []
        if self.kind == "llm":
            from trace_assets.llm_client import ChatClient
            from trace_assets.synthesize.llm_synth import llm_spec

            client = ChatClient(base_url=self.base_url, model=self.model, api_key=self.api_key)
            return llm_spec(capability, target_env, client, failed_trajectories=failed_trajectories, max_retries=self.max_retries)
        raise ValueError(f"synthesizer kind {self.kind!r} must be 'template' or 'llm'")
