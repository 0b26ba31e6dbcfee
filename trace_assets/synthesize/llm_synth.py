"""The LLM synthesizer: an OpenAI-compatible endpoint writes the EnvSpec; we validate and repair.

``llm_spec(capability, target_env, client, failed_trajectories=(), max_retries=2)`` renders the
versioned prompt ``prompts/synthesize_v2.md`` (``string.Template``: the schema, the tool names and
descriptions, the families with their complexity, the expert's move kinds and ablations, the
capability and its failures, an example decision-point spec for another capability), then runs
:func:`trace_assets.llm.complete_json`: each answer must parse as JSON and pass the schema,
fidelity, gold-solvability and, for a capability with an ablated expert, isolation
(:func:`~trace_assets.synthesize.validate.isolation_matrix`); otherwise the model is shown the reasons and asked again, at most
``max_retries`` more times. The capability block is always the requested capability (the model may
not rename what it is asked to target).

Returns ``(spec, reasons)`` where ``reasons`` lists why each earlier attempt was rejected. When every
attempt fails it raises :class:`SynthesisError` (an ``LLMError``) whose ``reasons`` list them all.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from string import Template
from typing import Any

from trace_assets.envs.base import Environment, target_hook
from trace_assets.envs.expert import MOVE_KINDS
from trace_assets.envs.splits import SYNTHETIC_SEED_BASE
from trace_assets.llm_client import ChatClient, LLMError, complete_json, extract_json
from trace_assets.synthesize.env import family_complexity
from trace_assets.synthesize.spec import GROUPS, envspec_schema
from trace_assets.synthesize.template import template_spec
from trace_assets.synthesize.validate import check_spec, isolation_matrix

PROMPT_VERSION = "v2"
MAX_FAILURES_IN_PROMPT = 8


class SynthesisError(LLMError):
    """No valid spec after every attempt; ``reasons`` has one entry per rejected attempt."""

    def __init__(self, message: str, reasons: list[str]) -> None:
        super().__init__(message)
        self.reasons = list(reasons)


def prompt_template() -> Template:
    path = resources.files("trace_assets.synthesize.prompts").joinpath(f"synthesize_{PROMPT_VERSION}.md")
    return Template(path.read_text(encoding="utf-8"))


def prompt_hash() -> str:
    """Changes whenever the prompt file changes: part of the synthesizer's code version."""
    from trace_assets.hashing import stable_hash

    return stable_hash(prompt_template().template)


def _failure_lines(failed: Iterable[dict[str, Any]]) -> str:
    lines = []
    for trajectory in list(failed)[:MAX_FAILURES_IN_PROMPT]:
        info = trajectory.get("info") or {}
        facts = {k: info[k] for k in ("family", "tool_errors", "policy_violations", "missing_info", "gold_writes", "n_writes")
                 if k in info}
        lines.append(f"- {trajectory.get('trajectory_id', '?')}: {json.dumps(facts, sort_keys=True)[:600]}")
    return "\n".join(lines) or "(none given)"


def render_prompt(capability: dict[str, Any], target_env: Environment, failed_trajectories: Iterable[dict[str, Any]] = ()) -> str:
    other = "confirm_before_writing" if capability["name"] != "confirm_before_writing" else "communicate_results"
    example = template_spec({"name": other, "description": f"An example: {other}."}, target_env)
    tools = "\n".join(f"- {s['function']['name']}: {s['function'].get('description', '')}" for s in target_env.tool_schemas())
    families = "\n".join(f"- {f}: {family_complexity(target_env, f):.1f}" for f in target_env.families())
    cap = {"name": capability["name"], "description": capability.get("description", ""),
           "failure_modes": list(capability.get("failure_modes", []))}
    return prompt_template().substitute(
        target_env=target_env.name,
        capability=json.dumps(cap, indent=1),
        failures=_failure_lines(failed_trajectories),
        tools=tools,
        groups=", ".join(GROUPS),
        move_kinds=", ".join(MOVE_KINDS),
        ablations="; ".join(f"lacking {k}: {v}" for k, v in target_hook(target_env, "ablations")().items()) or "(none)",
        families=families,
        seed_base=SYNTHETIC_SEED_BASE,
        schema=json.dumps(envspec_schema(), separators=(",", ":")),
        example=json.dumps(example, separators=(",", ":")),
    )


@dataclass
class _Recorder:
    """A ChatClient stand-in that keeps every answer, so we can name each rejected attempt."""

    client: ChatClient
    texts: list[str] = field(default_factory=list)

    def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        text = self.client.chat(messages, **kwargs)
        self.texts.append(text)
        return text


def _reasons(texts: list[str], semantic: dict[int, str]) -> list[str]:
    out = []
    for i, text in enumerate(texts):
        if i in semantic:
            out.append(f"attempt {i + 1}: {semantic[i]}")
            continue
        try:
            extract_json(text)
        except RecursionError:
            out.append(f"attempt {i + 1}: the JSON is nested too deeply")
        except ValueError as exc:
            out.append(f"attempt {i + 1}: not a JSON object: {str(exc)[:200]}")
    return out


def llm_spec(capability: dict[str, Any], target_env: Environment, client: ChatClient, *,
             failed_trajectories: Iterable[dict[str, Any]] = (), max_retries: int = 2,
             solvable_seeds: int = 2, isolation_seeds: int = 2, max_tokens: int = 3000) -> tuple[dict[str, Any], list[str]]:
    """A validated spec written by the endpoint, and the rejection reasons of earlier attempts."""
    has_ablation = capability["name"] in target_hook(target_env, "ablations")()
    failed = list(failed_trajectories)
    prompt = render_prompt(capability, target_env, failed)
    recorder = _Recorder(client)
    semantic: dict[int, str] = {}
    cap = {"name": capability["name"], "description": capability.get("description", capability["name"]),
           "failure_modes": sorted(capability.get("failure_modes", []))}

    def check(answer: Any) -> dict[str, Any]:
        attempt = len(recorder.texts) - 1
        if not isinstance(answer, dict):
            semantic[attempt] = "the answer is not a JSON object"
            raise ValueError(semantic[attempt])
        spec = {**answer, "capability": cap}
        problems = check_spec(spec, target_env, solvable_seeds)
        if not problems and has_ablation:
            report = isolation_matrix(spec, target_env, seeds=isolation_seeds)
            problems = [] if report["passed"] else [f"isolation: {report['reason']}"]
        if problems:
            semantic[attempt] = "; ".join(problems[:6])[:600]
            raise ValueError(semantic[attempt])
        return spec

    try:
        spec = complete_json(recorder, [{"role": "user", "content": prompt}], check,  # type: ignore[arg-type]
                             max_retries=max_retries, max_tokens=max_tokens)
    except LLMError as exc:
        reasons = _reasons(recorder.texts, semantic)
        message = (f"no valid EnvSpec for {capability['name']!r} after {len(recorder.texts)} attempt(s): "
                   + (" | ".join(reasons) if reasons else str(exc)))
        raise SynthesisError(message, reasons) from exc
    return spec, _reasons(recorder.texts[:-1], semantic)
