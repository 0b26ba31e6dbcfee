"""Decision points of user environments: logged trajectories replayed up to their first LACKING step.

For the built-in retail target, ``SyntheticEpisode`` has the target's scripted expert play the
conversation up to the capability's decision point. A user environment has no such expert. What
it has are logged trajectories of its own agent and step labels: for a capability c, the
assistant turn at which c was LACKING. This module cuts each such trajectory before its first
LACKING step and opens an episode of the same task with that prefix:

* The labels are Step 1's (``identify.Label``): a LACKING label's ``step`` indexes the
  trajectory's ``messages`` and names the assistant message judged (the analysts record it; the
  store returns them with ``TraceStore.lacking_steps``).
* :func:`first_lacking_step`: the smallest step labelled LACKING for (trajectory, c) over all
  labelling runs, or None.
* :func:`cut_before`: ``messages[:step]``, deep-copied. ``messages[step]`` must be an assistant
  message, and the prefix must keep the system message and the user's opening; else
  :class:`PrefixError`.
* :func:`logged_prefixes`: one :class:`LoggedPrefix` per trajectory that has a LACKING step for c
  (the others are skipped: there is no decision point to start at).
* :func:`replay`: plays the prefix's assistant turns through a fresh episode of the trajectory's
  task (tool calls through ``call_tool``, unparseable calls through ``malformed_call``, replies
  through ``user_reply``), so its database, simulated user and confirmation state continue from
  where the logged agent left them. Every observation and user answer must equal the logged one,
  else :class:`PrefixError` names the step: the log does not reproduce on this environment
  (another database, a changed tool, a non-deterministic user), and a prefix the environment would
  not have produced must not become training context.
* :class:`LoggedPrefixEnv` is an Environment over those prefixes (the rollout runner, the GRPO
  trainer and the held-out evaluation take it as they take a ``SyntheticEnv``).
  ``initial_messages()`` of its episodes is the logged prefix; the runner renders it all as the
  first prompt (``env_mask`` 0, inside ``prompt_len``), so the prefix is context, never trained on.
  The episode is then the user environment's own, scored by its own reward (an EnvSpec rubric is
  interpreted only on the retail target); ``info["decision_point"]`` records the trajectory and
  the step.

A task is rebuilt from a trajectory by ``task_of(trajectory)``; the default reads the task id the
targets write, ``<env>/<family>/<seed>`` (:func:`task_from_id`).

The pipeline stores such an environment as data, like an EnvSpec: :func:`logged_spec` writes the
document (``kind`` ``"logged_prefixes"``: the capability, the target's name, and every prefix with
its trajectory id, task id, step, messages and side), and :meth:`LoggedPrefixEnv.from_spec` reads
it back, checking each field and naming the one that is wrong. The side of a prefix is drawn from
its trajectory id (:func:`held_out`, a stable hash, ``HELD_OUT_SHARE`` of them): training, the
router's index and calibration draw train-side prefixes (cycling through them), the held-out
evaluation (offsets from ``train.heldout.HELD_OUT_OFFSET``) held-out ones, each at most once, so
no evaluated prefix was trained on and no pair is counted twice.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trace_assets.envs.base import Environment, EpisodeResult, Message, Task
from trace_assets.identify.capabilities import NAME_PATTERN, Label

LACKING = "LACKING"
MALFORMED_PREFIX = "Error: malformed tool call: "
LOGGED_KIND = "logged_prefixes"
"""``kind`` of a logged-decision-point document (:func:`logged_spec`); an EnvSpec has no ``kind``."""
HELD_OUT_SHARE = 0.25
"""Share of the prefixes (by trajectory id) kept for the held-out evaluation."""


class PrefixError(ValueError):
    """A logged trajectory cannot open an episode: a bad cut or a replay that diverged."""


@dataclass(frozen=True)
class LoggedPrefix:
    trajectory_id: str
    capability: str
    step: int
    """Index in the logged messages of the first LACKING assistant turn (the cut)."""
    task: Task
    """The target task the trajectory was played on."""
    messages: tuple[Message, ...]
    """``messages[:step]`` of the trajectory: system, the user's opening, and what followed."""


def first_lacking_step(labels: Iterable[Label], trajectory_id: str, capability: str) -> int | None:
    steps = [label.step for label in labels if label.trajectory_id == trajectory_id and label.capability == capability
             and label.label == LACKING and label.step is not None]
    return min(steps) if steps else None


def cut_before(messages: Sequence[Message], step: int) -> list[Message]:
    """The conversation before ``messages[step]`` (see the module docstring)."""
    if not 0 <= step < len(messages):
        raise PrefixError(f"step {step} is outside the conversation's {len(messages)} messages")
    if messages[step].get("role") != "assistant":
        raise PrefixError(f"step {step} is a {messages[step].get('role')!r} message; a step names an assistant turn")
    roles = [m.get("role") for m in messages[:step]]
    if not roles or roles[0] != "system" or "user" not in roles:
        raise PrefixError(f"the cut before step {step} keeps no system message and user opening")
    return copy.deepcopy(list(messages[:step]))


def task_from_id(target: Environment, trajectory: dict[str, Any]) -> Task:
    """The task of a trajectory whose id is ``<env>/<family>/<seed>``, rebuilt by ``target``."""
    parts = str(trajectory.get("task_id", "")).split("/")
    if len(parts) != 3 or not parts[2].isdigit() or parts[1] not in target.families():
        raise PrefixError(f"task id {trajectory.get('task_id')!r} is not '<env>/<family>/<seed>' of {target.name!r}: "
                          "pass task_of")
    return target.make_task(parts[1], int(parts[2]))


def logged_prefixes(trajectories: Iterable[dict[str, Any]], labels: Iterable[Label], capability: str,
                    target: Environment, *, task_of: Callable[[dict[str, Any]], Task] | None = None) -> list[LoggedPrefix]:
    """One prefix per trajectory with a LACKING step for ``capability``, in the given order."""
    labels = list(labels)
    rebuild = task_of or (lambda t: task_from_id(target, t))
    out = []
    for trajectory in trajectories:
        step = first_lacking_step(labels, trajectory["trajectory_id"], capability)
        if step is None:
            continue
        out.append(LoggedPrefix(trajectory["trajectory_id"], capability, step, rebuild(trajectory),
                                tuple(cut_before(trajectory["messages"], step))))
    return out


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call.get("function", call).get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise PrefixError(f"logged tool call arguments are not JSON: {arguments[:200]!r}") from exc
    return arguments


def replay(episode: Any, prefix: LoggedPrefix, *, to_end: bool = False) -> None:
    """Replay the prefix's assistant turns through ``episode`` (see the module docstring). With
    ``to_end``, ``prefix`` is a whole conversation, and the user may end it at its last message."""
    messages = list(prefix.messages)
    opening = episode.initial_messages()
    logged_user = next((m for m in messages if m.get("role") == "user"), None)
    fresh_user = next((m for m in opening if m.get("role") == "user"), None)
    if logged_user is None or fresh_user is None or logged_user.get("content") != fresh_user.get("content"):
        raise PrefixError(f"{prefix.trajectory_id}: the logged opening differs from the task's")
    i = next(j for j, m in enumerate(messages) if m is logged_user) + 1

    def expect(observed: str, role: str) -> None:
        nonlocal i
        if i >= len(messages) or messages[i].get("role") != role or str(messages[i].get("content")) != observed:
            logged = messages[i].get("content") if i < len(messages) else "(end of prefix)"
            raise PrefixError(f"{prefix.trajectory_id}: the replay diverges at message {i}: logged "
                              f"{str(logged)[:200]!r}, replayed {observed[:200]!r}")
        i += 1

    while i < len(messages):
        message = messages[i]
        if message.get("role") != "assistant":
            raise PrefixError(f"{prefix.trajectory_id}: message {i} ({message.get('role')}) answers no assistant turn")
        i += 1
        calls = message.get("tool_calls") or []
        for call in calls:
            name = call.get("function", call).get("name")
            expect(str(episode.call_tool(name, _arguments(call))), "tool")
        malformed = 0  # a tool message after the parsed calls' answers answers an unparseable call
        while i < len(messages) and messages[i].get("role") == "tool" and not messages[i].get("name"):
            error = str(messages[i].get("content", "")).removeprefix(MALFORMED_PREFIX)
            expect(str(episode.malformed_call(str(message.get("content") or ""), error)), "tool")
            malformed += 1
        if not calls and not malformed:
            answer, done = episode.user_reply(str(message.get("content") or ""))
            if done and not (to_end and i >= len(messages) - 1):
                raise PrefixError(f"{prefix.trajectory_id}: the user ends the conversation before step {prefix.step}")
            if i < len(messages) or not to_end:
                expect(str(answer), "user")


def replayed_outcome(target: Environment, trajectory: dict[str, Any], *,
                     task_of: Callable[[dict[str, Any]], Task] | None = None) -> EpisodeResult:
    """The logged conversation replayed whole through a fresh episode of its task: the logged
    agent's own outcome, reproduced on ``target`` (:class:`PrefixError` where it diverges)."""
    task = (task_of or (lambda t: task_from_id(target, t)))(trajectory)
    messages = tuple(trajectory["messages"])
    episode = target.start(task)
    replay(episode, LoggedPrefix(trajectory["trajectory_id"], "", len(messages), task, messages), to_end=True)
    return episode.result()


class LoggedPrefixEpisode:
    """A user environment's episode opened at a logged decision point (module docstring)."""

    def __init__(self, env: "LoggedPrefixEnv", task: Task, prefix: LoggedPrefix) -> None:
        self.task = task
        self.prefix = prefix
        self.inner = env.target.start(prefix.task)
        replay(self.inner, prefix)

    def initial_messages(self) -> list[Message]:
        return copy.deepcopy(list(self.prefix.messages))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return self.inner.call_tool(name, arguments)

    def malformed_call(self, raw: str, error: str) -> str:
        return self.inner.malformed_call(raw, error)

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        return self.inner.user_reply(assistant_text)

    @property
    def finished(self) -> bool:
        return bool(getattr(self.inner, "finished", False))

    def result(self) -> EpisodeResult:
        result = self.inner.result()
        info = copy.deepcopy(result.info)
        info["decision_point"] = {"source": "logged", "trajectory_id": self.prefix.trajectory_id,
                                  "capability": self.prefix.capability, "step": self.prefix.step,
                                  "prefix_messages": len(self.prefix.messages)}
        return EpisodeResult(reward=result.reward, success=result.success, info=info)


def held_out(trajectory_id: str, share: float = HELD_OUT_SHARE) -> bool:
    """Whether the prefix of ``trajectory_id`` is kept for the held-out evaluation (a stable hash)."""
    digest = hashlib.sha256(f"logged/held_out/{trajectory_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def logged_spec(capability: dict[str, Any], prefixes: Sequence[LoggedPrefix], target: Environment) -> dict[str, Any]:
    """The data document of a logged-decision-point environment (module docstring), prefixes by
    trajectory id. ``capability`` is ``{name, description, failure_modes}``."""
    return {
        "kind": LOGGED_KIND, "version": 1,
        "capability": {k: capability[k] for k in ("name", "description", "failure_modes") if k in capability},
        "target": {"env": target.name},
        "prefixes": [{"trajectory_id": p.trajectory_id, "task_id": p.task.task_id, "step": p.step,
                      "side": "held_out" if held_out(p.trajectory_id) else "train", "messages": list(p.messages)}
                     for p in sorted(prefixes, key=lambda p: p.trajectory_id)],
    }


def is_logged(spec: dict[str, Any]) -> bool:
    return isinstance(spec, dict) and spec.get("kind") == LOGGED_KIND


def _checked(spec: Any, target: Environment) -> list[dict[str, Any]]:
    """The prefixes of a logged document, or :class:`PrefixError` naming the field that is wrong."""
    if not is_logged(spec) or spec.get("version") != 1:
        raise PrefixError(f"not a logged-prefix document (kind {LOGGED_KIND!r}, version 1)")
    name = (spec.get("capability") or {}).get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise PrefixError(f"capability.name {name!r} is not a capability name")
    if (spec.get("target") or {}).get("env") != target.name:
        raise PrefixError(f"target.env {(spec.get('target') or {}).get('env')!r} is not {target.name!r}")
    prefixes = spec.get("prefixes")
    if not isinstance(prefixes, list) or not prefixes:
        raise PrefixError("prefixes: a non-empty list is required")
    for i, p in enumerate(prefixes):
        where = f"prefixes[{i}]"
        if not isinstance(p, dict):
            raise PrefixError(f"{where}: an object is required")
        for key, kind in (("trajectory_id", str), ("task_id", str), ("step", int), ("side", str), ("messages", list)):
            if not isinstance(p.get(key), kind) or isinstance(p.get(key), bool):
                raise PrefixError(f"{where}.{key}: a {kind.__name__} is required")
        if p["side"] not in ("train", "held_out"):
            raise PrefixError(f"{where}.side {p['side']!r} is not 'train' or 'held_out'")
        if len(p["messages"]) != p["step"] or not all(isinstance(m, dict) for m in p["messages"]):
            raise PrefixError(f"{where}.messages: the {p['step']} messages before step {p['step']} are required")
    return prefixes


class LoggedPrefixEnv:
    """An Environment whose episodes start at logged decision points of ``target``.

    ``families()`` are the prefixes' task families (target order); ``make_task(family, seed)`` is the
    ``seed``-th prefix of that family (modulo their number), so it is pure; ``sample_tasks(n,
    offset)`` draws from one side (module docstring): train-side prefixes cycling from ``offset``,
    held-out ones once each. ``held_out_ids`` names the held-out trajectories (none: every prefix
    is train-side, and a held-out draw is empty)."""

    def __init__(self, target: Environment, prefixes: Sequence[LoggedPrefix], *,
                 held_out_ids: Iterable[str] = (), spec: dict[str, Any] | None = None) -> None:
        if not prefixes:
            raise PrefixError("no logged trajectory has a LACKING step for this capability")
        capabilities = {p.capability for p in prefixes}
        if len(capabilities) != 1:
            raise PrefixError(f"prefixes of several capabilities: {sorted(capabilities)}")
        self.target = target
        self.capability = capabilities.pop()
        self.name = f"logged_{self.capability}"
        self.prefixes = list(prefixes)
        held = set(held_out_ids)
        self.sides = {"held_out": [i for i, p in enumerate(self.prefixes) if p.trajectory_id in held],
                      "train": [i for i, p in enumerate(self.prefixes) if p.trajectory_id not in held]}
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: dict[str, Any], target: Environment) -> "LoggedPrefixEnv":
        """The environment of a :func:`logged_spec` document (checked; errors name the field)."""
        entries = _checked(spec, target)
        capability = spec["capability"]["name"]
        prefixes = []
        for i, p in enumerate(entries):
            try:
                task = task_from_id(target, p)
            except PrefixError as exc:
                raise PrefixError(f"prefixes[{i}].task_id: {exc}") from None
            prefixes.append(LoggedPrefix(p["trajectory_id"], capability, p["step"], task, tuple(p["messages"])))
        return cls(target, prefixes, held_out_ids=[p["trajectory_id"] for p in entries if p["side"] == "held_out"],
                   spec=spec)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.target.tool_schemas()

    def system_prompt(self) -> str:
        return self.target.system_prompt()

    def families(self) -> list[str]:
        present = {p.task.family for p in self.prefixes}
        return [f for f in self.target.families() if f in present]

    def _task(self, index: int) -> Task:
        prefix = self.prefixes[index]
        return replace(prefix.task, task_id=f"{self.name}/{prefix.trajectory_id}", env=self.name,
                       meta={**prefix.task.meta, "prefix_index": index, "trajectory_id": prefix.trajectory_id,
                             "step": prefix.step, "target_task_id": prefix.task.task_id})

    def make_task(self, family: str, seed: int) -> Task:
        indices = [i for i, p in enumerate(self.prefixes) if p.task.family == family]
        if not indices:
            raise ValueError(f"unknown family {family!r} for {self.name}; known: {self.families()}")
        return self._task(indices[seed % len(indices)])

    def sample_tasks(self, n: int, *, offset: int = 0) -> list[Task]:
        from trace_assets.train.heldout import HELD_OUT_OFFSET

        if offset >= HELD_OUT_OFFSET:
            return [self._task(i) for i in self.sides["held_out"][offset - HELD_OUT_OFFSET:][:n]]
        train = self.sides["train"]
        if not train:
            raise PrefixError(f"{self.name}: no train-side prefix to draw from")
        return [self._task(train[(offset + i) % len(train)]) for i in range(n)]

    def start(self, task: Task) -> LoggedPrefixEpisode:
        return LoggedPrefixEpisode(self, task, self.prefixes[int(task.meta["prefix_index"])])
