"""``SyntheticEnv`` / ``SyntheticEpisode``: an EnvSpec interpreted on top of the target's machinery.

Contract (base.Environment / base.Episode, exactly):

* ``name = "synthetic_<capability>"`` (it must fit the trajectory schema's ``env`` pattern, which has
  no ``/``). ``tool_schemas()`` are the target's schemas of the spec's tools, verbatim and in the
  target's order; ``system_prompt()`` is the target's (the policy is always inherited);
  ``families()`` are the spec's families, in spec order.
* ``make_task(family, seed)`` is pure. ``seed`` must lie in the spec's ``seed_range`` (which lies at or
  above ``SYNTHETIC_SEED_BASE``). The target makes the task (its ``synthetic_task`` hook: a task of
  that family for that seed, perturbed by the scenario and difficulty knobs it interprets, e.g.
  retail's id method, declined write, volunteered identity and distractor orders; see
  ``envs.retail.synthetic`` and ``envs.mcp.McpEnv.synthetic_task``); the hint is this environment's
  own knob: shown when ``difficulty.hint_share`` says so (``task.meta["hinted"]``), from its own
  seeded stream (``splits.synthetic_draw``), so turning one knob never reshuffles another.
* ``start(task)`` returns a :class:`SyntheticEpisode` that delegates the conversation to a target
  episode (tools outside the spec's subset answer ``"Error: unknown tool ..."``) and scores it with the
  rubric. ``result().info`` keeps every key of the target's info (so the Step-1 heuristic analyst can
  label synthetic rollouts) and adds ``rubric``, ``rubric_reward``, ``target_reward``,
  ``target_success``, ``capability``, ``hinted`` and ``spec_hash``. ``success = decision >=
  rubric.success_threshold`` (default 1.0), where the decision is the reward without the rubric's
  shaping checks.
* Decision points (``spec.start``): ``start(task)`` plays the target's scripted expert (its
  ``next_move`` hook, deterministic from the task) in the episode up to, not including,
  its first move of a kind in ``start.before`` (and of ``start.intent`` / ``start.tool`` when given).
  ``initial_messages()`` then returns the system message, the user's opening and that prefix: the
  rollout runner renders it all as the first prompt (env_mask 0, inside ``prompt_len``), so the
  prefix is context and never trained on. The database, the simulated user and the confirmation
  state continue from where the expert left them. ``info["decision_point"]`` records the start and
  the prefix. ``start.variants`` give a share of the tasks another start (``make_task`` draws it from
  the task's own stream and records its id in ``task.meta["start"]``; a check's ``when.start`` selects
  on it): e.g. right after the user's answer, where a confirmation question is one asked twice.
* Horizon (``spec.end``): the episode sets ``finished`` (the runner and ``demonstrate`` stop on it)
  right after the agent's first call of ``end.after_call`` (successful only with ``ok_only``; with
  ``then_reply``, after the agent's next plain reply instead, so that what it tells the user after
  the decision is scored too), after its first plain reply (``after_reply``) or after
  ``max_actions`` agent actions. Confirmation questions the user answered after the agent's first
  successful write are counted apart (``Trace.confirmations_after_write``), and so are those asked
  again right after one was answered, with no successful write between (``Trace.confirmations_repeated``).
* Training horizon (``end.train_through``): with ``"first_reply"``, ``loss_closed`` turns true at the
  agent's first plain reply; the runner records where (``Rollout.loss_end``) and GRPO trains only the
  turns up to it. The episode itself runs on and is scored as without it.
* The hint is appended to the system message only; ``episode.plain_system_prompt`` is the un-hinted
  prompt, for a trainer that swaps it back before the gradient step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from typing import Any

from trace_assets.envs.base import Environment, EpisodeResult, Message, Task, jsonable, target_hook
from trace_assets.envs.expert import play_move
from trace_assets.envs.splits import synthetic_draw
from trace_assets.synthesize.rubric import CallRecord, Trace, applies, evaluate, text_slots
from trace_assets.synthesize.spec import (
    difficulty_of,
    fill_text,
    scenario_of,
    selector_tools,
    spec_hash,
    tool_groups,
    validate_spec,
)

HINT_PREFIX = "Hint: "
_complexity_cache: dict[tuple[str, str], float] = {}


def family_complexity(target_env: Environment, family: str) -> float:
    """The target's complexity of ``family`` (its ``family_complexity`` hook), cached per process."""
    key = (target_env.name, family)
    if key not in _complexity_cache:
        _complexity_cache[key] = float(target_hook(target_env, "family_complexity")(family))
    return _complexity_cache[key]


def play_to_decision_point(target: Environment, task: Task, episode: Any, messages: list[Message],
                           start: dict[str, Any]) -> None:
    """Play ``target``'s scripted expert (its ``next_move`` hook) in ``episode``, appending to
    ``messages``, up to, not including, its first move of a kind in ``start["before"]`` (and of
    ``start["intent"]`` / ``start["tool"]`` when given): a spec's ``start`` block. ``ValueError``
    when the expert never makes such a move on ``task``."""
    next_move = target_hook(target, "next_move")
    before, intent, tool = set(start["before"]), start.get("intent"), start.get("tool")
    for _ in range(60):
        move = next_move(task, messages)
        if move is None:
            break
        if (move.kind in before and (intent is None or move.intent == intent)
                and (tool is None or (move.call or {}).get("name") == tool)):
            return
        observation, done = play_move(episode, messages, move)
        if done or (observation or "").startswith("Error:"):
            break
    raise ValueError(f"{task.task_id}: the expert never reaches the decision point {start} "
                     "(this family has no such move)")


def start_block(spec: dict[str, Any], task: Task) -> dict[str, Any]:
    """The start ``task`` plays ({"before", "intent"?, "tool"?}): its variant's
    (``task.meta["start"]``), or the spec's main start; {} when the spec has none."""
    start = spec.get("start") or {}
    chosen = task.meta.get("start", "main")
    if chosen != "main":
        start = next(v for v in start.get("variants", []) if v["id"] == chosen)
    return {k: copy.deepcopy(start[k]) for k in ("before", "intent", "tool") if k in start}


def without_hint(task: Task) -> Task:
    """``task`` with its hint off (``meta["hinted"]`` false), otherwise the same task.

    Evaluation plays this: the hint is a training aid (``difficulty.hint_share``), and an agent is
    measured on what it does without it."""
    if not task.meta.get("hinted"):
        return task
    return dataclasses.replace(task, meta={**task.meta, "hinted": False})


class SyntheticEpisode:
    """One conversation in a synthetic environment (see the module docstring)."""

    def __init__(self, env: "SyntheticEnv", task: Task, target_episode: Any) -> None:
        self.env = env
        self.task = task
        self.target_episode = target_episode
        self.hinted = bool(task.meta.get("hinted"))
        self.plain_system_prompt = env.system_prompt()
        self.system_prompt = self.plain_system_prompt
        if self.hinted:
            self.system_prompt += "\n\n" + HINT_PREFIX + fill_text(env.spec["hint"], text_slots(task))
        self.calls: list[CallRecord] = []
        self.said: list[str] = []
        self.asked: list[bool] = []  # per entry of said: answered as a confirmation question
        self.prefix: list[Message] = []
        self.finished = False
        self.loss_closed = False  # end.train_through reached: later turns stay out of the loss
        self._agent_actions = 0
        self._wrote = False  # the agent made a successful write
        self._await_reply = False  # end.after_call matched under then_reply: the next reply ends it
        self.confirmations_after_write = 0
        self.confirmations_repeated = 0
        self._question_open = False  # the agent's last reply was answered as a confirmation question, no write since
        self._mark = (0, 0, 0, 0)  # calls, said, violations, confirmations made by the prefix
        self._end = env.spec.get("end") or {}
        self._in_prefix = False  # the expert's prefix actions are not the agent's
        self.start_block = start_block(env.spec, task)
        if self.start_block:
            self._in_prefix = True
            self._play_prefix(self.start_block)
            self._in_prefix = False

    def _opening(self) -> list[Message]:
        messages = self.target_episode.initial_messages()
        return [{"role": "system", "content": self.system_prompt}] + [m for m in messages if m["role"] != "system"]

    def initial_messages(self) -> list[Message]:
        return self._opening() + copy.deepcopy(self.prefix)

    def _play_prefix(self, start: dict[str, Any]) -> None:
        """The expert's conversation up to the decision point (see the module docstring)."""
        messages = self._opening()
        opening = len(messages)
        play_to_decision_point(self.env.target, self.task, self, messages, start)
        self.prefix = messages[opening:]
        target = self.target_episode
        self._mark = (len(self.calls), len(self.said), len(target.policy_violations), target.confirmations)
        # A start right after the user's answer: asking again at once is asking twice.
        self._question_open = bool(self.asked) and self.asked[-1]

    def _act(self, name: str | None = None, ok: bool = False, reply: bool = False) -> None:
        """Count one agent action and apply the horizon (``spec.end``)."""
        if self._in_prefix:
            return
        self._agent_actions += 1
        end = self._end
        if ok and name in self.env.groups["@write"]:
            self._wrote = True
            self._question_open = False
        if name is not None and "after_call" in end and name in selector_tools(end["after_call"], self.env.groups):
            if ok or not end.get("ok_only"):
                if end.get("then_reply"):
                    self._await_reply = True
                else:
                    self.finished = True
        if reply and (end.get("after_reply") or self._await_reply):
            self.finished = True
        if reply and end.get("train_through") == "first_reply":
            self.loss_closed = True
        if end.get("max_actions") and self._agent_actions >= end["max_actions"]:
            self.finished = True

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in self.env.tools:
            observation = f"Error: unknown tool '{name}'"  # the same words the target uses
        else:
            observation = self.target_episode.call_tool(name, arguments)
        self.calls.append(CallRecord(name if isinstance(name, str) else str(name), jsonable(arguments),
                                     not observation.startswith("Error:"), observation))
        self._act(self.calls[-1].name, self.calls[-1].ok)
        return observation

    def malformed_call(self, raw: str, error: str) -> str:
        observation = self.target_episode.malformed_call(raw, error)
        self.calls.append(CallRecord("", raw, False, observation, malformed=True))
        self._act()
        return observation

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        self.said.append(assistant_text if isinstance(assistant_text, str) else str(assistant_text))
        asked_before = self.target_episode.confirmations
        answer = self.target_episode.user_reply(assistant_text)
        self.asked.append(self.target_episode.confirmations > asked_before)
        if self._wrote and self.asked[-1]:  # _wrote: the agent's own write
            self.confirmations_after_write += 1
        if not self._in_prefix:
            if self._question_open and self.asked[-1]:
                self.confirmations_repeated += 1
            self._question_open = self.asked[-1]
        self._act(reply=True)
        return answer

    def record_assistant_text(self, text: str) -> None:
        """Count ``text`` as said to the user without a user turn (replays)."""
        self.said.append(text)
        self.asked.append(False)
        self.target_episode.record_assistant_text(text)

    def grant_confirmation(self) -> None:
        """Act as if the user had just said yes to a confirmation question (replays)."""
        self.target_episode.grant_confirmation()

    def result(self) -> EpisodeResult:
        target = self.target_episode.result()
        calls, said, violations, confirmations = self._mark
        trace = Trace(calls=list(self.calls), said=list(self.said[said:]),
                      violations=list(target.info.get("policy_violations", []))[violations:],
                      state_match=bool(target.info.get("state_match")), prefix_calls=calls,
                      confirmations=int(target.info.get("confirmations", 0)) - confirmations,
                      confirmations_after_write=self.confirmations_after_write,
                      confirmations_repeated=self.confirmations_repeated, asked=list(self.asked[said:]))
        score = evaluate(self.env.spec["rubric"], trace, self.task, self.env.groups, fallback=target.reward)
        info = copy.deepcopy(target.info)
        # Rebuilt from our own log so calls to tools outside the subset keep their place.
        info["actions"] = [{"name": c.name, "arguments": copy.deepcopy(c.arguments), "ok": c.ok}
                           for c in self.calls if not c.malformed]
        info["tool_errors"] = [c.observation for c in self.calls if not c.ok]
        info.update({
            "rubric": score.to_dicts(),
            "rubric_reward": score.reward,
            "target_reward": target.reward,
            "target_success": target.success,
            "capability": self.env.capability,
            "hinted": self.hinted,
            "spec_hash": self.env.spec_hash,
            "decision_point": {"start": {"id": self.task.meta.get("start", "main"), **copy.deepcopy(self.start_block)}
                               if self.start_block else None, "prefix_messages": len(self.prefix),
                               "prefix_calls": calls, "agent_actions": self._agent_actions, "finished": self.finished},
        })
        threshold = float(self.env.spec["rubric"].get("success_threshold", 1.0))
        decided = score.reward if score.decision is None else score.decision
        return EpisodeResult(reward=score.reward, success=decided >= threshold - 1e-9, info=info)


class SyntheticEnv:
    """A capability-targeted environment defined by an EnvSpec (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], target_env: Environment) -> None:
        self.spec = validate_spec(spec, target_env)
        self.target = target_env
        self.capability: str = self.spec["capability"]["name"]
        self.name = f"synthetic_{self.capability}"
        self.tools: list[str] = [s["function"]["name"] for s in target_env.tool_schemas()
                                 if s["function"]["name"] in self.spec["target"]["tools"]]
        self.groups = tool_groups(target_env)
        self.spec_hash = spec_hash(self.spec)
        self.seed_range: tuple[int, int] = tuple(self.spec["tasks"]["seed_range"])  # type: ignore[assignment]
        self.difficulty = difficulty_of(self.spec)
        self.scenario = scenario_of(self.spec)

    # ---- protocol ------------------------------------------------------------------------

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [s for s in self.target.tool_schemas() if s["function"]["name"] in self.tools]

    def system_prompt(self) -> str:
        return self.target.system_prompt()

    def families(self) -> list[str]:
        return [f["name"] for f in self.spec["tasks"]["families"]]

    def make_task(self, family: str, seed: int) -> Task:
        if family not in self.families():
            raise ValueError(f"unknown family {family!r} for {self.name}; known: {self.families()}")
        start, end = self.seed_range
        if not (isinstance(seed, int) and start <= seed < end):
            raise ValueError(f"seed {seed} is outside {self.name}'s seed range [{start}, {end})")
        write_tools = target_hook(self.target, "tool_classes")()["write"]
        knobs = {"scenario": self.scenario, "difficulty": self.difficulty}
        base = target_hook(self.target, "synthetic_task")(family, seed, **copy.deepcopy(knobs))
        hinted = bool(self.spec.get("hint")) and synthetic_draw("hint", family, seed) < self.difficulty["hint_share"]
        meta = {"target_task_id": base.task_id, "capability": self.capability, "spec_hash": self.spec_hash,
                **base.meta, "gold_writes": [a["name"] for a in base.gold_actions if a["name"] in write_tools],
                "hinted": hinted}
        variants = (self.spec.get("start") or {}).get("variants") or []
        if variants:  # only then: the tasks of a spec without variants stay as they were
            meta["start"] = self._start_id(variants, base, seed)
        return dataclasses.replace(base, task_id=f"{self.name}/{family}/{seed}", env=self.name, family=family,
                                   seed=seed, meta=meta)

    def start(self, task: Task) -> SyntheticEpisode:
        return SyntheticEpisode(self, task, self.target.start(task))

    def _start_id(self, variants: list[dict[str, Any]], base: Task, seed: int) -> str:
        """The start ``base`` (the target's task of that family and seed) plays: the first variant
        whose ``when`` holds and whose cumulative share covers the task's own draw, else "main"."""
        u, acc = synthetic_draw("start", base.family, seed), 0.0
        for variant in variants:
            if applies(variant, base, self.groups):
                acc += float(variant["share"])
                if u < acc:
                    return variant["id"]
        return "main"

    # ---- sampling ------------------------------------------------------------------------

    def family_weights(self) -> dict[str, float]:
        """Normalised family weights after ``difficulty.family_bias`` (> 0 favours complex families)."""
        families = self.spec["tasks"]["families"]
        bias = float(self.difficulty["family_bias"])
        complexity = [family_complexity(self.target, f["name"]) for f in families]
        mean = sum(complexity) / len(complexity)
        std = math.sqrt(sum((c - mean) ** 2 for c in complexity) / len(complexity))
        raw = [f["weight"] * math.exp(bias * ((c - mean) / std if std else 0.0)) for f, c in zip(families, complexity)]
        total = sum(raw)
        return {f["name"]: w / total for f, w in zip(families, raw)}

    def family_for_seed(self, seed: int) -> str:
        """The family a seed is drawn for, by the weights (deterministic)."""
        u = random.Random(f"synthetic/family/{seed}").random()
        acc = 0.0
        weights = self.family_weights()
        for family, weight in weights.items():
            acc += weight
            if u < acc:
                return family
        return list(weights)[-1]

    def sample_tasks(self, n: int, *, offset: int = 0) -> list[Task]:
        """``n`` tasks on consecutive seeds ``start + offset + i``, families drawn by weight."""
        start, end = self.seed_range
        if start + offset + n > end or offset < 0:
            raise ValueError(f"{n} tasks at offset {offset} do not fit the seed range [{start}, {end})")
        seeds = range(start + offset, start + offset + n)
        return [self.make_task(self.family_for_seed(s), s) for s in seeds]
