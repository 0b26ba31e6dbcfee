"""Scripted policies that play an environment: the experts' moves, the conversation they read, and
the loop that plays them. Target-independent; each target's expert (``envs.retail.expert``, the
tau2 gold replay in ``envs.tau2``) decides its moves, this module plays them.

* A :class:`Move` is one assistant turn: a plain message or one tool call, with the ``kind`` that
  synthetic decision points name (:data:`MOVE_KINDS`) and the request (``intent``) it serves.
* A :data:`Policy` is ``(task, messages) -> Move | None``: it reads the conversation so far, so it
  can take over any conversation another policy started (a synthetic episode's expert prefix).
* :func:`play` plays a policy through ``env.start(task)`` until the policy has nothing more to do,
  the user is done, the episode says it is ``finished`` (a synthetic horizon) or ``max_moves``.
  With ``strict`` a tool error on one of the policy's own calls raises ``RuntimeError`` (an expert
  whose solution does not work); without it, the error is part of the conversation.
* :data:`GENERIC_ADVERSARIES` are the adversarial agents that need no expert (refuse everything,
  end at once); each target adds those that imitate its expert (echoing, writing without asking).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable

from .base import EpisodeResult, Message, Task

MOVE_KINDS = ("ask_identity", "authenticate", "lookup", "propose", "write", "report")
"""``report`` is every closing message of a request: an outcome, an answer, a refusal, a goodbye."""


@dataclass(frozen=True)
class Move:
    """One assistant turn: ``text`` (plain message) or ``call`` ({"name", "arguments"})."""

    kind: str
    intent: int | None = None
    text: str | None = None
    call: dict[str, Any] | None = None


Policy = Callable[[Task, list[Message]], "Move | None"]


@dataclass
class Call:
    """One tool call seen in a conversation, with the observation that answered it."""

    name: str
    arguments: Any
    observation: str

    @property
    def ok(self) -> bool:
        return not self.observation.startswith("Error:")

    def parsed(self) -> Any:
        try:
            return json.loads(self.observation)
        except json.JSONDecodeError:
            return self.observation


@dataclass
class Conversation:
    """What a conversation shows, by message index: calls with observations, plain assistant texts,
    user replies."""

    calls: list[tuple[int, Call]]
    texts: list[tuple[int, str]]
    users: list[tuple[int, str]]

    @classmethod
    def read(cls, messages: list[Message]) -> "Conversation":
        calls, texts, users = [], [], []
        for i, message in enumerate(messages):
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls"):
                observations = [m for m in messages[i + 1:i + 1 + len(message["tool_calls"])] if m.get("role") == "tool"]
                for call, obs in zip(message["tool_calls"], observations):
                    fn = call.get("function", {})
                    calls.append((i, Call(fn.get("name", ""), fn.get("arguments"), str(obs.get("content", "")))))
            elif role == "assistant" and message.get("content"):
                texts.append((i, str(message["content"])))
            elif role == "user":
                users.append((i, str(message.get("content", ""))))
        return cls(calls, texts, users)


def play_move(episode: Any, messages: list[Message], move: Move) -> tuple[str | None, bool]:
    """Apply ``move`` to ``episode`` and append its messages; return (tool observation or None, user done)."""
    if move.call is not None:
        arguments = copy.deepcopy(move.call["arguments"])
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": move.call["name"], "arguments": arguments}}]})
        observation = episode.call_tool(move.call["name"], copy.deepcopy(arguments))
        messages.append({"role": "tool", "name": move.call["name"], "content": observation})
        return observation, False
    messages.append({"role": "assistant", "content": move.text})
    reply, done = episode.user_reply(move.text)
    messages.append({"role": "user", "content": reply})
    return None, bool(done)


def play(env: Any, task: Task, policy: Policy, *, strict: bool = False, max_moves: int = 60) -> tuple[list[Message], EpisodeResult]:
    """Play ``policy`` on ``task`` through ``env.start(task)`` (see the module docstring)."""
    episode = env.start(task)
    messages = episode.initial_messages()
    done = bool(getattr(episode, "finished", False))
    for _ in range(max_moves):
        if done:
            break
        move = policy(task, messages)
        if move is None:
            break
        observation, done = play_move(episode, messages, move)
        if strict and observation is not None and observation.startswith("Error:"):
            raise RuntimeError(f"expert action failed: {move.call} -> {observation}")
        done = done or bool(getattr(episode, "finished", False))
    return messages, episode.result()


REFUSAL = "Sorry, I cannot help with that."


def refuse_everything(task: Task, messages: list[Message]) -> Move | None:
    """Says it cannot help, three times, and never calls a tool."""
    said = Conversation.read(messages).texts
    return None if len(said) >= 3 else Move("report", text=REFUSAL)


def end_at_once(task: Task, messages: list[Message]) -> Move | None:
    """Does nothing at all."""
    return None


GENERIC_ADVERSARIES: dict[str, Policy] = {"refuse_everything": refuse_everything, "end_at_once": end_at_once}
