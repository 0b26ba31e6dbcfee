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

Optional hooks (:class:`TargetHooks`): what generic code that builds *on* a target needs beyond the
protocol. The warm-start asks for ``expert`` demonstrations. Step 2 (a synthetic environment over
the target) asks for the tool classes its rubric groups name (``tool_classes``), the task of a
synthetic seed (``synthetic_task``, ``synthesis_knobs``, ``family_complexity``), the expert that
plays decision-point prefixes (``next_move``) and its ablations and adversaries for the isolation
check (``ablations``, ``adversaries``, ``expert(..., lacking=, policy=)``). ``retail`` has every
hook (its procedural database also gives ``generate_db`` and ``replay_state``); ``tau2_airline``
(``envs.mcp.McpEnv``) derives its hooks from its tool list, its task file and the gold-replay expert,
and says which ablations cannot exist there. Generic code reaches them through :func:`target_hook`,
which names the missing hook when a target does not offer it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
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


MIN_ECHO_CHARS = 12
"""Tool observations at least this long are cut out of a message when they appear in it verbatim
(shorter ones, like a bare user id, are ordinary words of an answer)."""
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")


def spoken_text(text: str, observations: list[str]) -> str:
    """What ``text`` tells the user in its own words: ``text`` without any verbatim tool
    observation (of at least :data:`MIN_ECHO_CHARS` characters) and without JSON objects."""
    out = text
    for observation in sorted({o for o in observations if len(o) >= MIN_ECHO_CHARS}, key=len, reverse=True):
        out = out.replace(observation, " ")
    while True:  # innermost objects first, so nested JSON goes entirely
        cut = _JSON_OBJECT.sub(lambda m: " " if '"' in m.group(0) or ":" in m.group(0) else m.group(0), out)
        if cut == out:
            return out
        out = cut


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


def check_outcomes(info: dict[str, Any]) -> dict[str, bool]:
    """``{check id: passed}`` of the score an episode got: a synthetic environment's rubric
    (``info["rubric"]``, its applicable checks only) where the episode has one, else the target's
    per-check breakdown (``info["checks"]``, as the retail target writes it); empty for an
    environment that gives neither."""
    rubric = info.get("rubric")
    if isinstance(rubric, list):
        return {str(c["id"]): bool(c["passed"]) for c in rubric
                if isinstance(c, dict) and "id" in c and c.get("applicable", True)}
    return {str(c["id"]): bool(c["passed"]) for c in info.get("checks") or [] if isinstance(c, dict) and "id" in c}


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


class TargetHooks(Protocol):
    """Optional hooks of a target environment (see the module docstring for who needs which)."""

    def expert(self, task: Task, *, confirm: bool = True, via: Environment | None = None, lacking: str | None = None,
               policy: Any = None) -> tuple[list[Message], EpisodeResult]:
        """The scripted expert's conversation on ``task``, played through ``(via or self).start(task)``,
        and the episode's result. ``confirm=False``: it writes without asking for confirmation.
        ``lacking=c``: the expert ablated of capability ``c`` (a key of ``ablations()``); ``policy``:
        play that :data:`~trace_assets.envs.expert.Policy` instead (an adversary)."""

    def next_move(self, task: Task, messages: list[Message], *, lacking: str | None = None) -> Any:
        """The expert's next :class:`~trace_assets.envs.expert.Move` in the conversation ``messages``
        (None: nothing left to do). Deterministic, and able to continue a conversation it started."""

    def ablations(self) -> dict[str, str]:
        """The capabilities the expert can be ablated of, each with what the ablated expert stops
        doing. May be empty or partial: a capability without one gets a weaker isolation measure."""

    def adversaries(self) -> dict[str, Any]:
        """Adversarial scripted agents by name (policies that try to game a reward)."""

    def tool_classes(self) -> dict[str, frozenset[str]]:
        """Tool names by class: ``{"auth": ..., "write": ..., "account": ...}`` (account tools need
        authentication; writes change the state)."""

    def synthetic_task(self, family: str, seed: int, *, scenario: dict[str, Any], difficulty: dict[str, Any]) -> Task:
        """The target's task for the synthetic seed ``seed`` (>= ``splits.SYNTHETIC_SEED_BASE``) of
        ``family``, perturbed by the spec's scenario and difficulty knobs that ``synthesis_knobs()``
        names (defaults filled in). Pure; never a task of the target's test split."""

    def synthesis_knobs(self) -> frozenset[str]:
        """The scenario and difficulty knob names this target's synthetic tasks interpret."""

    def family_complexity(self, family: str) -> float:
        """How complex the family's tasks are (the ordering ``difficulty.family_bias`` tilts by)."""

    def generate_db(self, seed: int) -> Any:
        """A fresh database of ``seed``: the one ``make_task(family, seed)`` builds its task on."""

    def replay_state(self, db: Any, actions: list[dict[str, Any]]) -> str:
        """Apply ``actions`` (``{"name", "arguments"}``, authentication included) to ``db`` in place;
        return the resulting state hash. Raises if an action fails."""


def target_hook(env: Any, name: str) -> Callable[..., Any]:
    """``env``'s optional hook ``name`` (see :class:`TargetHooks`), or an error naming both."""
    known = [n for n in TargetHooks.__dict__ if not n.startswith("_")]
    if name not in known:
        raise AttributeError(f"{name!r} is not a target hook; known: {', '.join(known)}")
    hook = getattr(env, name, None)
    if not callable(hook):
        raise NotImplementedError(f"environment {getattr(env, 'name', env)!r} does not provide the target hook "
                                  f"{name}() (see trace_assets.envs.base.TargetHooks)")
    return hook
