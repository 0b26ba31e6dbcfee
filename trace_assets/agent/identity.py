"""Which agent played a trajectory: an identity stored with every rollout the pipeline makes.

An agent is the base model (its checksum), the adapter applied to it (or none), and how it was
decoded (backend and dtype): the same weights in bf16 and fp32 choose other tokens at near-ties, so
they are two agents. ``agent_id`` hashes the identity; readers that are about one agent (Step 1's
D+ / D-, the router's index, every evaluation) select its rows by that id and never mix agents.
"""

from __future__ import annotations

from typing import Any

from trace_assets.hashing import stable_hash


def generation_identity(backend: Any) -> dict[str, str]:
    """``{"backend", "dtype"}`` of a generation backend, as it decodes."""
    name = getattr(backend, "name", type(backend).__name__)
    if name == "vllm":
        return {"backend": "vllm", "dtype": str(backend.engine.options.dtype)}
    return {"backend": str(name), "dtype": "bfloat16" if getattr(backend, "bf16", False) else "float32"}


def agent_identity(base_agent: dict[str, Any], backend: Any, adapter: str | None = None) -> dict[str, Any]:
    """The identity of ``base_agent`` (the ``base_agent`` asset's value) decoded by ``backend``,
    with ``adapter`` (``"name@checksum"``) applied, or none."""
    return {"base": base_agent.get("checksum") or base_agent["path"], "adapter": adapter, **generation_identity(backend)}


def agent_id(identity: dict[str, Any]) -> str:
    return stable_hash(identity)


def planned_generation(generation: Any) -> dict[str, str]:
    """The ``generation_identity`` that ``[generation]`` settings will give on this machine, known
    when the code location loads: evaluation assets put it in their ``code_version``, so switching
    the backend or dtype (or moving to a machine where ``auto`` resolves otherwise) re-evaluates.
    An engine that fails to start at run time falls back to transformers; the rows it writes then
    carry that identity, and readers look rows up by the identity of the backend they really got."""
    from trace_assets.agent.lora import bf16_supported
    from trace_assets.agent.vllm_backend import choose_backend

    backend = choose_backend(generation.backend)
    if backend != "vllm":
        return {"backend": "transformers", "dtype": "float32"}
    dtype = generation.vllm_dtype
    if dtype == "auto":
        dtype = "bfloat16" if bf16_supported() else "float32"
    return {"backend": "vllm", "dtype": dtype}
