"""The paper-faithful analyst: an LLM behind any OpenAI-compatible endpoint.

Phase 1 (``induce``) shows the LLM D+ and D- and asks for at most 10 general capabilities.
Phase 2 (``label``) asks, per trajectory and run, for NA / PRESENT / LACKING on every capability
with a one-line rationale; runs use temperature > 0 and a per-run seed. Prompts are versioned
template files in ``prompts/``; answers are JSON validated by a schema and by semantic checks
(known capability names, every pair present, safe names) and retried a bounded number of times
with the error shown to the model. Failures surface as ``LLMError`` for the asset to record.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from string import Template
from typing import Any

import jsonschema

from trace_assets.identify.capabilities import (
    LABELS, MAX_CAPABILITIES, MAX_DESCRIPTION_CHARS, MAX_FAILURE_MODE_CHARS, MAX_FAILURE_MODES, Capability,
    CapabilityNameError, Label, validate_dictionary,
)
from trace_assets.llm_client import ChatClient, complete_json
from trace_assets.settings import clip, schema_error_text

PROMPT_VERSION = "v1"
TRANSCRIPT_FORMAT = "indexed-v1"
"""How ``transcript`` renders a conversation (part of ``prompts_hash``: the prompts' input changes with it)."""

DICTIONARY_SCHEMA = {
    "type": "object",
    "required": ["capabilities"],
    "properties": {
        "capabilities": {
            "type": "array", "minItems": 1, "maxItems": MAX_CAPABILITIES,
            "items": {
                "type": "object",
                "required": ["name", "description"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string", "minLength": 10, "maxLength": MAX_DESCRIPTION_CHARS},
                    "failure_modes": {"type": "array", "maxItems": MAX_FAILURE_MODES,
                                      "items": {"type": "string", "maxLength": MAX_FAILURE_MODE_CHARS}},
                    "example_trajectory_ids": {"type": "array", "items": {"type": "string"}},
                },
            },
        }
    },
}
LABELS_SCHEMA = {
    "type": "object",
    "required": ["labels"],
    "properties": {
        "labels": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["capability", "label"],
                "properties": {
                    "capability": {"type": "string"},
                    "label": {"type": "string"},
                    "rationale": {"type": "string"},
                    "step": {"type": ["integer", "null"]},
                },
            },
        }
    },
}


def prompt_template(name: str) -> Template:
    return Template(resources.files("trace_assets.identify.prompts").joinpath(f"{name}_{PROMPT_VERSION}.md").read_text())


def prompts_hash() -> str:
    """Changes whenever a prompt file changes: part of the assets' code versions."""
    blob = "".join(prompt_template(n).template for n in ("induce", "label")) + TRANSCRIPT_FORMAT
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def transcript(trajectory: dict[str, Any], max_chars: int) -> str:
    """The conversation without its system message, one line per message, each prefixed with its index
    in ``messages`` (``[3] assistant: ...``): the number a LACKING label's ``step`` names."""
    lines = []
    for i, m in enumerate(trajectory["messages"]):
        if m["role"] == "system":
            continue
        text = (m.get("content") or "").strip()
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            text += f" CALL {fn['name']}({json.dumps(fn['arguments']) if not isinstance(fn['arguments'], str) else fn['arguments']})"
        lines.append(f"[{i}] {m['role']}: {text.strip()}")
    out = "\n".join(lines)
    return out if len(out) <= max_chars else out[: max_chars // 2] + "\n…\n" + out[-max_chars // 2 :]


def record_summary(info: dict[str, Any]) -> str:
    keep = {k: info.get(k) for k in ("tool_errors", "policy_violations", "missing_info") if info.get(k)}
    return json.dumps(keep)[:400] or "{}"


class LLMAnalyst:
    """Sampling analyst (paper default N = 10 runs, K = 8)."""

    name = "llm"
    deterministic = False

    def __init__(self, client: ChatClient, *, temperature: float = 0.7, max_retries: int = 2,
                 max_examples: int = 12, max_chars: int = 1500) -> None:
        self.client = client
        self.temperature = temperature
        self.max_retries = max_retries
        self.max_examples = max_examples
        self.max_chars = max_chars

    @property
    def calls(self) -> int:
        return self.client.calls

    def _block(self, trajectories: list[dict[str, Any]]) -> str:
        return "\n\n".join(
            f"### {t['trajectory_id']} (record: {record_summary(t['info'])})\n{transcript(t, self.max_chars)}"
            for t in trajectories[: self.max_examples]
        ) or "(none)"

    def induce(self, d_plus: list[dict[str, Any]], d_minus: list[dict[str, Any]]) -> list[Capability]:
        prompt = prompt_template("induce").substitute(
            max_capabilities=MAX_CAPABILITIES, successes=self._block(d_plus), failures=self._block(d_minus)
        )

        def check(obj: Any) -> list[Capability]:
            try:
                jsonschema.validate(obj, DICTIONARY_SCHEMA)
            except jsonschema.ValidationError as exc:
                raise ValueError(f"schema: {schema_error_text(exc)} at {list(exc.absolute_path)}") from None
            try:
                return validate_dictionary(obj["capabilities"])
            except CapabilityNameError as exc:
                raise ValueError(str(exc)) from None

        return complete_json(self.client, [{"role": "user", "content": prompt}], check,
                             max_retries=self.max_retries, temperature=self.temperature, max_tokens=1500)

    def label(self, trajectory: dict[str, Any], capabilities: list[Capability], run: int) -> list[Label]:
        names = [c.name for c in capabilities]
        prompt = prompt_template("label").substitute(
            capabilities="\n".join(f"- {c.name}: {c.description}" for c in capabilities),
            trajectory_id=trajectory["trajectory_id"], record=record_summary(trajectory["info"]),
            transcript=transcript(trajectory, self.max_chars),
        )

        assistant_turns = [i for i, m in enumerate(trajectory["messages"]) if m.get("role") == "assistant"]

        def check(obj: Any) -> list[Label]:
            try:
                jsonschema.validate(obj, LABELS_SCHEMA)
            except jsonschema.ValidationError as exc:
                raise ValueError(f"schema: {schema_error_text(exc)}") from None
            got: dict[str, Label] = {}
            for item in obj["labels"]:
                cap, label = item["capability"], str(item["label"]).upper()
                if cap not in names:
                    raise ValueError(f"unknown capability {clip(cap, 60)!r}; use only {names}")
                if label not in LABELS:
                    raise ValueError(f"unknown label {clip(item['label'], 50)!r} for {cap}; use one of {list(LABELS)}")
                if cap in got and got[cap].label != label:  # never resolve a contradiction silently
                    raise ValueError(f"contradictory labels for {cap}: {got[cap].label} and {label}; give exactly one")
                step = item.get("step") if label == "LACKING" else None
                if step is not None and step not in assistant_turns:
                    raise ValueError(f"step {step} of {cap} is not an assistant message; use one of {assistant_turns[:20]} "
                                     "or null")
                got[cap] = Label(trajectory["trajectory_id"], cap, run, label, str(item.get("rationale", ""))[:300], step)
            missing = [n for n in names if n not in got]
            if missing:
                raise ValueError(f"missing labels for {missing}")
            return [got[n] for n in names]

        return complete_json(self.client, [{"role": "user", "content": prompt}], check,
                             max_retries=self.max_retries, temperature=self.temperature, seed=run, max_tokens=800)
