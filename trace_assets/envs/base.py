"""The Environment protocol: what the rollout runner, trainer and evaluator need from a domain.

A domain (the built-in ``retail``, a synthetic capability environment, or your own) provides:

* an :class:`Environment`: tool schemas in OpenAI format, a system prompt that carries the policy,
  a deterministic task generator, and ``start(task)`` which returns a fresh :class:`Episode`;
* an :class:`Episode`: one conversation's mutable state. The runner feeds it tool calls and plain
  assistant replies; it answers with observations and simulated-user turns, and finally scores the
  conversation.

Contracts every implementation must keep:

* ``Environment.make_task(family, seed)`` is a pure function of its arguments: the same family and
  seed always give the same task (same database, same gold actions, same expected state).
* ``Episode.call_tool`` and ``Episode.malformed_call`` never raise on agent mistakes: unknown tools,
  bad arguments and policy refusals come back as an observation string starting with ``"Error:"``.
  They raise only on bugs in the environment itself.
* ``Episode.result()`` may be called at any time and does not change the episode.
* All values in ``Task`` and ``EpisodeResult.info`` are JSON-serialisable.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
"""One OpenAI-format chat message: ``{"role": ..., "content": ..., "tool_calls": [...]}``."""


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (a deep copy), or its ``repr`` when it is not serialisable:
    what agents pass as tool arguments is recorded, never trusted."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: a tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Task:
    """One task of an environment. Re-created exactly by ``env.make_task(family, seed)``.

    ``scenario`` is what the simulated user knows (identity, order ids, intents, whether they
    confirm). ``gold_actions`` is the reference solution: the ordered tool calls an expert makes.
    ``required_info`` are strings the agent must say to the user (e.g. a refund amount).
    ``expected_state_hash`` is the hash of the database after replaying ``gold_actions`` on a
    fresh database built from the task's seed.
    """

    task_id: str
    env: str
    family: str
    seed: int
    instruction: str
    scenario: dict[str, Any]
    gold_actions: list[dict[str, Any]]
    required_info: list[str]
    expected_state_hash: str
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Task":
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class EpisodeResult:
    """The score of one conversation.

    ``reward`` = state match x info communicated, in [0, 1] (tau2-bench style). ``success`` is
    ``reward == 1``. ``info`` records what happened so analysts can label capabilities without an
    LLM: at least ``state_match`` (bool), ``info_score`` (float), ``missing_info`` (list),
    ``actions`` (list of ``{"name", "arguments", "ok"}``), ``tool_errors`` (list of str),
    ``policy_violations`` (list of ``{"rule", "detail"}``), ``confirmations`` and
    ``authenticated`` (bool).
    """

    reward: float
    success: bool
    info: dict[str, Any]


@runtime_checkable
class Episode(Protocol):
    """One conversation's state. Created by ``Environment.start``; never shared between rollouts."""

    task: Task

    def initial_messages(self) -> list[Message]:
        """The system message (policy + instructions) followed by the user's first message."""

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool call against this episode's database; return the observation text."""

    def malformed_call(self, raw: str, error: str) -> str:
        """Record an unparseable tool call and return the error observation shown to the agent."""

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        """The simulated user's answer to a plain assistant message, and whether the user is done."""

    def result(self) -> EpisodeResult:
        """Score the conversation so far."""


@runtime_checkable
class Environment(Protocol):
    """A target (or synthetic) domain. See the module docstring for the contracts."""

    name: str

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI-format tool schemas: ``[{"type": "function", "function": {...}}]``."""

    def system_prompt(self) -> str:
        """The agent's system prompt, including the written policy."""

    def families(self) -> list[str]:
        """Task family names, in a stable order."""

    def make_task(self, family: str, seed: int) -> Task:
        """The task of ``family`` generated from ``seed``. Deterministic."""

    def start(self, task: Task) -> Episode:
        """A fresh episode for ``task``, with its own copy of the database."""
