"""``RetailEnv`` and ``RetailEpisode``: the built-in target environment behind base.py's protocols.

Scoring (tau2-bench style, binary): ``reward = state_match * info_score * confirmed_writes``:

* ``state_match``: the final database hash equals the task's ``expected_state_hash``;
* ``info_score``: 1 when every ``required_info`` string occurs (case-insensitively) in what the
  agent *told* the user (:func:`spoken_text`: the plain assistant messages passed to
  ``user_reply`` or ``record_assistant_text``, with every verbatim tool observation and every
  JSON object cut out), else 0. Pasting a tool result to the user therefore says nothing;
* ``confirmed_writes``: 1 when no successful write was made without an explicit yes (the policy
  requires confirmation before every write), else 0.

``info["checks"]`` gives the per-check breakdown (id, passed, detail), so a reward of 0 says why.

Confirmation is not enforced by the tools: a successful write made when the last user message was
not an explicit yes to a confirmation question adds a ``confirm_before_write`` violation (and
zeroes ``confirmed_writes``). One yes covers one write.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

from ..base import EpisodeResult, Message, Task, jsonable, spoken_text
from .db import RetailDB, generate_db
from .tasks import FAMILIES, make_task, replay_actions
from .tools import ACCOUNT_TOOLS, AUTH_TOOLS, TOOL_SCHEMAS, WRITE_TOOLS, Session, run_tool
from .user import ScriptedUser

ROLE = "You are a retail customer service agent. Use the tools and follow this policy."


def load_policy() -> str:
    return resources.files(__package__).joinpath("policy.md").read_text(encoding="utf-8").strip()


class RetailEpisode:
    """One conversation: its own database copy, scripted user and action log."""

    def __init__(self, task: Task, system_prompt: str, max_user_turns: int = 10) -> None:
        self.task = task
        self.session = Session(generate_db(task.seed))
        self.user = ScriptedUser(task.scenario, max_turns=max_user_turns)
        self._system_prompt = system_prompt
        self.actions: list[dict[str, Any]] = []
        self.observations: list[str] = []
        self.tool_errors: list[str] = []
        self.policy_violations: list[dict[str, str]] = []
        self.assistant_texts: list[str] = []
        self.confirmations = 0
        self._confirmed = False  # the last user message was an explicit yes to a confirmation

    # ---- protocol ------------------------------------------------------------------------

    def initial_messages(self) -> list[Message]:
        return [
            {"role": "system", "content": self._system_prompt},
            {"role": "user", "content": self.user.opening()},
        ]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        outcome = run_tool(self.session, name, arguments)
        self.observations.append(outcome.observation)
        self.actions.append({"name": name, "arguments": jsonable(arguments), "ok": outcome.ok})
        if not outcome.ok:
            self.tool_errors.append(outcome.observation)
        if outcome.violation is not None:
            self.policy_violations.append(outcome.violation)
        if outcome.ok and name in WRITE_TOOLS:
            if not self._confirmed:
                detail = f"{name} {json.dumps(arguments, sort_keys=True)}"
                self.policy_violations.append({"rule": "confirm_before_write", "detail": detail})
            self._confirmed = False  # one yes covers one write
        return outcome.observation

    def malformed_call(self, raw: str, error: str) -> str:
        observation = f"Error: malformed tool call: {error}"
        self.tool_errors.append(observation)
        return observation

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        self.record_assistant_text(assistant_text)
        if self.session.transferred:
            self.user.done = True
            self._confirmed = False
            return "Thank you, I will wait for the human agent.", True
        turn = self.user.reply(assistant_text, self._handled)
        if turn.kind in ("confirm_yes", "confirm_no"):
            self.confirmations += 1
        self._confirmed = turn.kind == "confirm_yes"
        return turn.text, turn.done

    def result(self) -> EpisodeResult:
        state_match = self.session.db.state_hash() == self.task.expected_state_hash
        said = [spoken_text(text, self.observations).lower() for text in self.assistant_texts]
        missing = [info for info in self.task.required_info if not any(info.lower() in t for t in said)]
        info_score = 0.0 if missing else 1.0
        unconfirmed = [v["detail"] for v in self.policy_violations if v["rule"] == "confirm_before_write"]
        reward = float(state_match) * info_score * float(not unconfirmed)
        checks = [
            {"id": "state_match", "passed": state_match,
             "detail": "final state matches the gold replay" if state_match else "final state differs from the gold replay"},
            {"id": "info_communicated", "passed": not missing,
             "detail": "told the user every required detail" if not missing
             else f"not told in the agent's own words (tool output pasted verbatim does not count): {missing}"},
            {"id": "confirmed_writes", "passed": not unconfirmed,
             "detail": "every write had an explicit yes" if not unconfirmed else f"wrote without an explicit yes: {unconfirmed[0][:120]}"},
        ]
        info = {
            "family": self.task.family,
            "state_match": state_match,
            "info_score": info_score,
            "missing_info": missing,
            "actions": copy.deepcopy(self.actions),
            "tool_errors": list(self.tool_errors),
            "policy_violations": copy.deepcopy(self.policy_violations),
            "authenticated": self.session.user_id is not None,
            "confirmations": self.confirmations,
            "n_writes": sum(1 for a in self.actions if a["ok"] and a["name"] in WRITE_TOOLS),
            "gold_writes": [a["name"] for a in self.task.gold_actions if a["name"] in WRITE_TOOLS],
            "transferred": self.session.transferred,
            "user_turns": self.user.turns,
            "user_done": self.user.done,
            "checks": checks,
        }
        return EpisodeResult(reward=reward, success=reward == 1.0, info=info)

    # ---- helpers -------------------------------------------------------------------------

    def record_assistant_text(self, text: str) -> None:
        """Count ``text`` as said to the user (for required info) without a user turn."""
        self.assistant_texts.append(text if isinstance(text, str) else str(text))

    def grant_confirmation(self) -> None:
        """Act as if the user had just said yes to a confirmation question (for replays)."""
        self.confirmations += 1
        self._confirmed = True

    def _handled(self, intent: dict[str, Any]) -> bool:
        if intent["tool"] is None:  # the user hears only what was said in the agent's own words
            said = " ".join(spoken_text(t, self.observations) for t in self.assistant_texts).lower()
            return all(s.lower() in said for s in intent["must_say"])
        for action in self.actions:
            args = action["arguments"] if isinstance(action["arguments"], dict) else {}
            target = args.get("order_id", args.get("user_id"))
            if action["ok"] and action["name"] == intent["tool"] and target == intent["target"]:
                return True
        return False


class RetailEnv:
    """The built-in retail target environment (see base.Environment), with every base.TargetHooks hook."""

    name = "retail"

    def __init__(self, max_user_turns: int = 10) -> None:
        self.max_user_turns = max_user_turns

    def tool_schemas(self) -> list[dict[str, Any]]:
        return copy.deepcopy(TOOL_SCHEMAS)

    def system_prompt(self) -> str:
        return f"{ROLE}\n\n{load_policy()}"

    def families(self) -> list[str]:
        return list(FAMILIES)

    def make_task(self, family: str, seed: int) -> Task:
        return make_task(family, seed)

    def start(self, task: Task) -> RetailEpisode:
        episode = RetailEpisode(task, self.system_prompt(), self.max_user_turns)
        if task.meta.get("distractor_orders"):  # a synthetic task's extra orders (retail.synthetic)
            from .synthetic import apply_distractors

            apply_distractors(episode.session.db, task.meta["distractor_orders"])
        return episode

    def replay(self, task: Task, actions: list[dict[str, Any]], *, say: list[str] | None = None,
               confirm: bool = True) -> EpisodeResult:
        """Apply ``actions`` ({"name", "arguments"}) in a fresh episode, then score it.

        With ``confirm`` each write is preceded by an implied user yes; ``say`` lists assistant
        texts counted as said to the user.
        """
        episode = self.start(task)
        for action in actions:
            if confirm and action["name"] in WRITE_TOOLS:
                episode.grant_confirmation()
            episode.call_tool(action["name"], action["arguments"])
        for text in say or []:
            episode.record_assistant_text(text)
        return episode.result()

    # ---- target hooks (base.TargetHooks) ----------------------------------------------------

    def expert(self, task: Task, *, confirm: bool = True, via: Any = None, lacking: str | None = None,
               policy: Any = None) -> tuple[list[Message], EpisodeResult]:
        from .expert import demonstrate

        return demonstrate(via or self, task, confirm=confirm, lacking=lacking, policy=policy)

    def next_move(self, task: Task, messages: list[Message], *, lacking: str | None = None) -> Any:
        from .expert import next_move

        return next_move(task, messages, lacking=lacking)

    def ablations(self) -> dict[str, str]:
        from .expert import ABLATIONS

        return dict(ABLATIONS)

    def adversaries(self) -> dict[str, Any]:
        from .expert import ADVERSARIES

        return dict(ADVERSARIES)

    def tool_classes(self) -> dict[str, frozenset[str]]:
        return {"auth": AUTH_TOOLS, "write": WRITE_TOOLS, "account": ACCOUNT_TOOLS}

    def synthetic_task(self, family: str, seed: int, *, scenario: dict[str, Any], difficulty: dict[str, Any]) -> Task:
        from .synthetic import synthetic_task

        return synthetic_task(family, seed, scenario=scenario, difficulty=difficulty)

    def synthesis_knobs(self) -> frozenset[str]:
        from .synthetic import KNOBS

        return KNOBS

    def family_complexity(self, family: str) -> float:
        """Mean (gold actions + intents) of the family's tasks on seeds 0, 1, 2."""
        tasks = [self.make_task(family, s) for s in (0, 1, 2)]
        return sum(len(t.gold_actions) + len(t.scenario.get("intents", [])) for t in tasks) / len(tasks)

    def generate_db(self, seed: int) -> RetailDB:
        return generate_db(seed)

    def replay_state(self, db: RetailDB, actions: list[dict[str, Any]]) -> str:
        return replay_actions(db, actions).state_hash()
