"""``SyntheticEnv`` / ``SyntheticEpisode``: an EnvSpec interpreted on top of the target's machinery.

Contract (base.Environment / base.Episode, exactly):

* ``name = "synthetic_<capability>"`` (it must fit the trajectory schema's ``env`` pattern, which has
  no ``/``). ``tool_schemas()`` are the target's schemas of the spec's tools, verbatim and in the
  target's order; ``system_prompt()`` is the target's (the policy is always inherited);
  ``families()`` are the spec's families, in spec order.
* ``make_task(family, seed)`` is pure. ``seed`` must lie in the spec's ``seed_range`` (which lies at or
  above ``SYNTHETIC_SEED_BASE``). The target task ``target.make_task(family, seed)`` is the base; then,
  each from its own seeded stream (so turning one knob never reshuffles another):
  the user's id method (``scenario.name_zip_share``), a declined last write (``scenario.decline_share``;
  the gold drops that write), identity volunteered in the opening (``difficulty.volunteer_identity``),
  extra distractor orders on the user's account (``difficulty.distractor_orders``) and whether the hint
  is shown (``difficulty.hint_share``; ``task.meta["hinted"]``). ``gold_actions`` and
  ``expected_state_hash`` (a replay of the gold on the perturbed database) follow the perturbations.
* ``start(task)`` returns a :class:`SyntheticEpisode` that delegates the conversation to a target
  episode (tools outside the spec's subset answer ``"Error: unknown tool ..."``) and scores it with the
  rubric. ``result().info`` keeps every key of the target's info (so the Step-1 heuristic analyst can
  label synthetic rollouts) and adds ``rubric``, ``rubric_reward``, ``target_reward``,
  ``target_success``, ``capability``, ``hinted`` and ``spec_hash``. ``success = reward >=
  rubric.success_threshold`` (default 1.0).
* Decision points (``spec.start``): ``start(task)`` plays the target's scripted expert
  (``envs.retail.expert.next_move``, deterministic from the task) in the episode up to, not including,
  its first move of a kind in ``start.before`` (and of ``start.intent`` / ``start.tool`` when given).
  ``initial_messages()`` then returns the system message, the user's opening and that prefix: the
  rollout runner renders it all as the first prompt (env_mask 0, inside ``prompt_len``), so the
  prefix is context and never trained on. The database, the simulated user and the confirmation
  state continue from where the expert left them. ``info["decision_point"]`` records the prefix.
* Horizon (``spec.end``): the episode sets ``finished`` (the runner and ``demonstrate`` stop on it)
  right after the agent's first call of ``end.after_call`` (successful only with ``ok_only``), after its
  first plain reply (``after_reply``) or after ``max_actions`` agent actions.
* The hint is appended to the system message only; ``episode.plain_system_prompt`` is the un-hinted
  prompt, for a trainer that swaps it back before the gradient step.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

from trace_assets.envs.base import Environment, EpisodeResult, Message, Task, jsonable, target_hook
from trace_assets.synthesize.rubric import CallRecord, Trace, evaluate, text_slots
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
_COMPLEXITY_PROBE_SEEDS = (0, 1, 2)
_complexity_cache: dict[tuple[str, str], float] = {}


def family_complexity(target_env: Environment, family: str) -> float:
    """Mean (gold actions + intents) of a few target tasks: the ordering ``family_bias`` tilts by."""
    key = (target_env.name, family)
    if key not in _complexity_cache:
        tasks = [target_env.make_task(family, s) for s in _COMPLEXITY_PROBE_SEEDS]
        _complexity_cache[key] = sum(len(t.gold_actions) + len(t.scenario.get("intents", [])) for t in tasks) / len(tasks)
    return _complexity_cache[key]


def _uniform(knob: str, family: str, seed: int) -> float:
    return random.Random(f"synthetic/{knob}/{family}/{seed}").random()


def _auth_action(scenario: dict[str, Any]) -> dict[str, Any]:
    if scenario["id_method"] == "name_zip":
        return {"name": "find_user_id_by_name_zip", "arguments": {
            "first_name": scenario["first_name"], "last_name": scenario["last_name"], "zip": scenario["zip"]}}
    return {"name": "find_user_id_by_email", "arguments": {"email": scenario["email"]}}


def _identity_sentence(scenario: dict[str, Any]) -> str:
    if scenario["id_method"] == "name_zip":
        return f"My name is {scenario['first_name']} {scenario['last_name']} and my zip code is {scenario['zip']}."
    return f"My email is {scenario['email']}."


def _distractor_orders(db: Any, scenario: dict[str, Any], n: int, family: str, seed: int) -> list[dict[str, Any]]:
    """``n`` extra orders for the task's user: same products as the target order where possible."""
    if n <= 0:
        return []
    rng = random.Random(f"synthetic/distractors/{family}/{seed}")
    user = db.users[scenario["user_id"]]
    target_oid = next((i.get("order_id") for i in scenario["intents"] if i.get("order_id")), None)
    target_products = sorted({it["product_id"] for it in db.orders[target_oid]["items"]}) if target_oid else []
    all_products = sorted(db.products)
    used_oid = {int(oid[1:]) for oid in db.orders}
    used_trk = {int(o["tracking_id"][1:]) for o in db.orders.values() if o.get("tracking_id")}
    out = []
    for _ in range(n):
        oid = _fresh(rng, 1000, 9999, used_oid)
        pids = [rng.choice(target_products or all_products)]
        if rng.random() < 0.5:
            pids.append(rng.choice([p for p in all_products if p not in pids]))
        items = []
        for pid in pids:
            product = db.products[pid]
            variant = product["variants"][rng.choice(sorted(product["variants"]))]
            items.append({"item_id": variant["item_id"], "product_id": pid, "name": product["name"],
                          "options": dict(variant["options"]), "price": variant["price"]})
        status = rng.choice(["pending", "processed", "delivered"])
        tracking = None
        if status == "delivered":
            tracking = _fresh(rng, 100000, 999999, used_trk)
        out.append({"order_id": f"W{oid}", "user_id": user["user_id"], "status": status, "items": items,
                    "address": dict(user["address"]), "payment_method_id": rng.choice(sorted(user["payment_methods"])),
                    "tracking_id": f"T{tracking}" if tracking else None, "refunds": []})
    return out


def _fresh(rng: random.Random, low: int, high: int, used: set[int]) -> int:
    while True:  # deterministic retry, as in the target's own id generator
        value = rng.randint(low, high)
        if value not in used:
            used.add(value)
            return value


def apply_distractors(db: Any, orders: list[dict[str, Any]]) -> None:
    """Insert distractor orders into a retail database in place (same order every time)."""
    for order in orders:
        db.orders[order["order_id"]] = copy.deepcopy(order)
        db.users[order["user_id"]]["orders"].append(order["order_id"])


def _instruction(scenario: dict[str, Any]) -> str:
    s = scenario
    requests = " ".join(
        f"({i}) {intent['request']}" + ("" if intent["confirm"] else " When asked to confirm this one, say no.")
        for i, intent in enumerate(s["intents"], 1)
    )
    tail = " Confirm when asked." if all(i["confirm"] for i in s["intents"]) else ""
    return f"You are {s['first_name']} {s['last_name']} (email {s['email']}, zip {s['zip']}). Your requests, in order: {requests}{tail}"


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
        self.prefix: list[Message] = []
        self.finished = False
        self._agent_actions = 0
        self._mark = (0, 0, 0, 0)  # calls, said, violations, confirmations made by the prefix
        self._end = env.spec.get("end") or {}
        self._in_prefix = False  # the expert's prefix actions are not the agent's
        if env.spec.get("start"):
            self._in_prefix = True
            self._play_prefix(env.spec["start"])
            self._in_prefix = False

    def _opening(self) -> list[Message]:
        messages = self.target_episode.initial_messages()
        return [{"role": "system", "content": self.system_prompt}] + [m for m in messages if m["role"] != "system"]

    def initial_messages(self) -> list[Message]:
        return self._opening() + copy.deepcopy(self.prefix)

    def _play_prefix(self, start: dict[str, Any]) -> None:
        """The expert's conversation up to the decision point (see the module docstring)."""
        from trace_assets.envs.retail.expert import next_move, play_move

        before, intent, tool = set(start["before"]), start.get("intent"), start.get("tool")
        messages = self._opening()
        opening = len(messages)
        for _ in range(60):
            move = next_move(self.task, messages)
            if move is None:
                break
            if (move.kind in before and (intent is None or move.intent == intent)
                    and (tool is None or (move.call or {}).get("name") == tool)):
                self.prefix = messages[opening:]
                target = self.target_episode
                self._mark = (len(self.calls), len(self.said), len(target.policy_violations), target.confirmations)
                return
            observation, done = play_move(self, messages, move)
            if done or (observation or "").startswith("Error:"):
                break
        raise ValueError(f"{self.task.task_id}: the expert never reaches the decision point {start} "
                         "(this family has no such move)")

    def _act(self, name: str | None = None, ok: bool = False, reply: bool = False) -> None:
        """Count one agent action and apply the horizon (``spec.end``)."""
        if self._in_prefix:
            return
        self._agent_actions += 1
        end = self._end
        if name is not None and "after_call" in end and name in selector_tools(end["after_call"], self.env.groups):
            if ok or not end.get("ok_only"):
                self.finished = True
        if reply and end.get("after_reply"):
            self.finished = True
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
        answer = self.target_episode.user_reply(assistant_text)
        self._act(reply=True)
        return answer

    def record_assistant_text(self, text: str) -> None:
        """Count ``text`` as said to the user without a user turn (replays)."""
        self.said.append(text)
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
                      confirmations=int(target.info.get("confirmations", 0)) - confirmations)
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
            "decision_point": {"start": copy.deepcopy(self.env.spec.get("start")), "prefix_messages": len(self.prefix),
                               "prefix_calls": calls, "agent_actions": self._agent_actions, "finished": self.finished},
        })
        threshold = float(self.env.spec["rubric"].get("success_threshold", 1.0))
        return EpisodeResult(reward=score.reward, success=score.reward >= threshold - 1e-9, info=info)


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
        base = self.target.make_task(family, seed)
        scenario = copy.deepcopy(base.scenario)
        intents = scenario["intents"]
        intent_actions = copy.deepcopy(base.meta["intent_actions"])
        meta: dict[str, Any] = {"target_task_id": base.task_id, "capability": self.capability,
                                "spec_hash": self.spec_hash}

        share = self.scenario["name_zip_share"]
        if share is not None:
            scenario["id_method"] = "name_zip" if _uniform("id_method", family, seed) < share else "email"
        writes = [i for i, intent in enumerate(intents) if intent["tool"] is not None and intent["confirm"]]
        declined = bool(writes) and _uniform("decline", family, seed) < self.scenario["decline_share"]
        if declined:
            intents[writes[-1]]["confirm"] = False  # the expert still proposes it; the user says no
        gold = [_auth_action(scenario)] + [
            action for intent, group in zip(intents, intent_actions) for action in group
            if intent["confirm"] or action["name"] not in write_tools
        ]
        volunteered = _uniform("volunteer", family, seed) < self.difficulty["volunteer_identity"]
        if volunteered:
            scenario["opening"] = f"Hi! {_identity_sentence(scenario)} {intents[0]['request']}"
        hinted = bool(self.spec.get("hint")) and _uniform("hint", family, seed) < self.difficulty["hint_share"]

        db = target_hook(self.target, "generate_db")(seed)
        distractors = _distractor_orders(db, scenario, int(self.difficulty["distractor_orders"]), family, seed)
        if distractors or declined:
            apply_distractors(db, distractors)
            expected = target_hook(self.target, "replay_state")(db, gold)
        else:  # the authentication call never changes the state
            expected = base.expected_state_hash
        meta.update({"intent_actions": intent_actions,
                     "gold_writes": [a["name"] for a in gold if a["name"] in write_tools],
                     "hinted": hinted, "volunteered": volunteered, "declined": declined,
                     "id_method": scenario["id_method"], "distractor_orders": distractors})
        return Task(
            task_id=f"{self.name}/{family}/{seed}", env=self.name, family=family, seed=seed,
            instruction=_instruction(scenario), scenario=scenario, gold_actions=gold,
            required_info=list(base.required_info), expected_state_hash=expected, meta=meta,
        )

    def start(self, task: Task) -> SyntheticEpisode:
        target_episode = self.target.start(task)
        if task.meta.get("distractor_orders"):
            apply_distractors(target_episode.session.db, task.meta["distractor_orders"])
        return SyntheticEpisode(self, task, target_episode)

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
