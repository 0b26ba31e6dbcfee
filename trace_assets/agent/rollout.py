"""The batched multi-turn rollout runner (data collection, GRPO and evaluation all use it).

``run_rollouts(env, tasks, backend, tokenizer, config)`` plays one episode per task. Each round
generates ONE assistant turn for every still-active episode in a single ``backend.generate`` call,
then feeds each turn to its episode:

* every valid ``<tool_call>`` -> ``episode.call_tool`` -> a ``tool`` message;
* every malformed block -> ``episode.malformed_call`` -> a ``tool`` message with its observation;
* a turn with neither -> ``episode.user_reply(content)`` -> a ``user`` message (omitted when the user
  is done and says nothing); the episode ends when the user is done.

An episode also ends (``stop_reason``) when it says so itself (``"env_done"``: an episode with a
horizon, e.g. a synthetic environment's ``end``, sets an optional ``finished`` attribute); after ``max_steps`` assistant turns (``"max_steps"``); after
``max_errors`` error observations (``"max_errors"``, tau2-bench's rule); when
the next turn would not fit in ``max_context_tokens`` (prompt + generation prompt +
``max_new_tokens``; ``"context"``); when two consecutive turns hit ``max_new_tokens`` without the
stop token (``"length"``; the second turn is still processed and counted); or on an exception
from the environment (``"error"``, message in ``error``). ``truncated`` is True for ``"context"``
and ``"length"``: the model's output was cut off. A turn cut by the length limit is closed with
``<|im_end|>`` (mask 0) and parsed like any other turn.

Token bookkeeping is incremental: past turns are never re-tokenized. ``token_ids`` is exactly what
the model saw and produced. After the generated tokens (ending with ``<|im_end|>``) the runner
appends the tokens of the rendered new segment (``"\\n"`` + the tool/user turn) and, just before the
next generation, of the generation prompt ``"<|im_start|>assistant\\n"``; all with ``env_mask`` 0.
Segments are cut from the tokenizer's own chat template (rendering is prefix-stable), and every
boundary is at a special token, so:

* ``decode(token_ids)`` equals ``apply_chat_template(messages', tools)`` where ``messages'`` replaces
  each assistant message by its raw text (``assistant_texts``); when the model wrote its turns in
  the canonical format (what the template renders for the parsed message), that is simply
  ``apply_chat_template(messages, tools)``, and then ``token_ids`` also equal the tokenization of
  that text (ChatML tokenizes stably at ``<|im_start|>``/``<|im_end|>``);
* ``env_mask`` is 1 exactly on generated tokens, and ``logprobs`` (aligned with ``token_ids``) holds
  the backend's log-probs there and 0.0 elsewhere.
* ``loss_end``: an episode that judges one decision may close the loss (an optional ``loss_closed``
  attribute turning true: a synthetic environment's ``end.train_through``); ``loss_end`` is then the
  length of ``token_ids`` after the turn that closed it, and a trainer leaves the generated tokens
  from there on out of the loss (``env_mask`` still marks them generated). None: it never closed.

Admission: a backend with a bounded KV cache (``kv_capacity_tokens``: vLLM) gets, each round, the
running episodes in task order while their tokens (the shared system + tools prefix counted once,
each with room for ``max_new_tokens``) fit in ``KV_FILL`` of it; the others wait for a round in
which they fit. Why: a conversation's next turn reuses its cached KV blocks only if they are still
there. With more episodes in a round than the cache holds, each round evicted the blocks of the
episodes that had finished their turn first, so their next turn prefilled the whole conversation
again, round after round. The first episodes always go first, so the same ones keep their cache
until one ends. When every episode fits, every round plays all of them, as without a bound (the
same batches, hence the same rollouts at any temperature); when some wait, greedy rollouts are the
same and sampled ones are drawn in other batches.

Seeds: round r of a call uses sampling seed ``derive_seed(config.seed, r)``. So the same tasks,
config and backend batch size reproduce the same rollouts, at T = 0 and at T > 0. Samples within one
batch differ from each other (one RNG stream per batch), which is what GRPO groups need.

Model garbage never crashes the runner: any text is parsed into content/tool calls/errors.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from trace_assets.agent.backends import GenerationBackend, SamplingParams
from trace_assets.agent.chat import IM_END, assistant_message, parse_assistant, render
from trace_assets.envs.base import Environment, Episode, EpisodeResult, Message, Task

log = logging.getLogger(__name__)


ROLLOUT_LIMITS = ("max_steps", "max_new_tokens", "max_context_tokens", "max_errors")
"""An episode's limits. Several configs carry them (the ``[rollout]`` settings, ``GRPOConfig``,
``EvalConfig``, ``RolloutConfig``); :func:`with_limits` is how one config takes them from another."""


def with_limits(cls: type, source: Any, **values: Any) -> Any:
    """``cls(**values)``, with each limit of :data:`ROLLOUT_LIMITS` that both ``cls`` and ``source``
    have read from ``source`` unless ``values`` sets it; a limit ``source`` lacks keeps ``cls``'s
    default. The classmethod ``from_limits`` of :class:`RolloutConfig` and ``EvalConfig``."""
    names = {f.name for f in fields(cls)}
    limits = {name: getattr(source, name) for name in ROLLOUT_LIMITS if name in names and hasattr(source, name)}
    return cls(**{**limits, **values})


@dataclass(frozen=True)
class RolloutConfig:
    max_steps: int = 50
    """Maximum assistant turns (the paper's interaction limit)."""
    max_new_tokens: int = 96
    """Per assistant turn."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_context_tokens: int = 4096
    max_errors: int = 10
    """End the episode after this many error observations (tool observations starting with
    ``"Error:"``, the Environment protocol's error convention), as tau2-bench's ``max_errors``
    does: an agent stuck repeating failing calls only burns the step budget. 0 disables it."""

    from_limits = classmethod(with_limits)
    """``RolloutConfig.from_limits(source, temperature=..., seed=...)``: the episode limits of
    ``source`` (e.g. the ``[rollout]`` settings), the sampling given (:func:`with_limits`)."""


@dataclass
class Rollout:
    task: Task
    messages: list[Message]
    """OpenAI-format conversation, starting with the system and first user message."""
    token_ids: list[int]
    """The whole conversation exactly as the model saw and produced it."""
    env_mask: list[int]
    """1 for generated tokens, 0 for prompt/environment/user tokens. Same length as token_ids."""
    prompt_len: int
    """Tokens before the first generated token (the first prompt incl. the generation prompt)."""
    result: EpisodeResult
    steps: int = 0
    n_generated: int = 0
    truncated: bool = False
    error: str | None = None
    stop_reason: str = ""
    """One of user_done, env_done, max_steps, max_errors, context, length, error."""
    logprobs: list[float] = field(default_factory=list)
    """Aligned with token_ids: the backend's log-prob on generated tokens, 0.0 elsewhere."""
    assistant_texts: list[str] = field(default_factory=list)
    """Raw decoded text of every generated turn (stop token included when generated)."""
    seed: int = 0
    """The config seed the rollout was sampled with."""
    loss_end: int | None = None
    """Generated tokens at or after this index stay out of the loss (the episode closed it; see the
    module docstring). None: every generated token may enter it."""


ProgressFn = Callable[[int, int], None]


def logged_progress(log: Callable[[str], None], what: str, parts: int = 10) -> ProgressFn:
    """A ``run_rollouts`` progress callback that logs ``"<what>: <done>/<total> episodes finished"``
    about ``parts`` times over a run, and at its end (a long evaluation shows it is moving)."""
    def progress(done: int, total: int) -> None:
        if done % max(1, total // parts) == 0 or done == total:
            log(f"{what}: {done}/{total} episodes finished")

    return progress


def derive_seed(seed: int, round_index: int) -> int:
    """A well-mixed 31-bit seed for generation round ``round_index`` of a run seeded ``seed``."""
    digest = hashlib.sha256(f"{seed}:{round_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _failed_result(reason: str) -> EpisodeResult:
    return EpisodeResult(reward=0.0, success=False, info={"error": reason})


class _Live:
    """Mutable state of one running episode."""

    def __init__(self, task: Task, episode: Episode | None, rollout: Rollout) -> None:
        self.task = task
        self.adapter: str | None = None
        self.episode = episode
        self.rollout = rollout
        self.length_hits = 0
        self.errors = 0
        self.done = False

    def finish(self, reason: str, *, error: str | None = None) -> None:
        r = self.rollout
        r.stop_reason = reason
        r.truncated = reason in ("context", "length")
        if error is not None:
            r.error = error
        self.done = True
        if self.episode is not None:
            try:
                r.result = self.episode.result()
            except Exception as exc:  # an environment bug: keep the rollout, record the failure
                log.exception("episode.result() failed for %s", self.task.task_id)
                r.error = r.error or f"result: {type(exc).__name__}: {exc}"
                r.result = _failed_result(r.error)


class _Encoder:
    """Renders and tokenizes conversation segments with the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.stop_id = tokenizer.convert_tokens_to_ids(IM_END)
        if self.stop_id is None or self.stop_id == tokenizer.unk_token_id:
            self.stop_id = tokenizer.eos_token_id

    def render(self, messages: list[Message], generation_prompt: bool = False) -> str:
        return render(self.tokenizer, messages, self.tools, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        # The template spells out every special token, so nothing may be added.
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def generation_prompt(self, messages: list[Message]) -> list[int]:
        plain = self.render(messages)
        prompted = self.render(messages, True)
        if not prompted.startswith(plain):
            raise ValueError("chat template is not prefix-stable at the generation prompt")
        return self.encode(prompted[len(plain) :])

    def segment(self, before: list[Message], after: list[Message]) -> list[int]:
        """Tokens that follow the generated ``<|im_end|>`` of the last message of ``before``."""
        text_before, text_after = self.render(before), self.render(after)
        if not text_after.startswith(text_before):
            raise ValueError("chat template is not prefix-stable; cannot extend incrementally")
        cut = text_before.rfind(IM_END)
        closing = text_before[cut + len(IM_END) :] if cut >= 0 else ""
        return self.encode(closing + text_after[len(text_before) :])


def _append(r: Rollout, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
    r.token_ids.extend(ids)
    r.env_mask.extend([mask] * len(ids))
    r.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def _start(env: Environment, task: Task, enc: _Encoder, seed: int) -> _Live:
    blank = Rollout(task=task, messages=[], token_ids=[], env_mask=[], prompt_len=0,
                    result=_failed_result("not run"), seed=seed)
    try:
        episode = env.start(task)
        blank.messages = [dict(m) for m in episode.initial_messages()]
        _append(blank, enc.encode(enc.render(blank.messages)), 0)
    except Exception as exc:
        log.exception("could not start an episode for %s", task.task_id)
        live = _Live(task, None, blank)
        live.finish("error", error=f"start: {type(exc).__name__}: {exc}")
        live.rollout.result = _failed_result(live.rollout.error or "start failed")
        return live
    return _Live(task, episode, blank)


def _process_turn(live: _Live, text: str, enc: _Encoder, config: RolloutConfig) -> None:
    """Feed one generated turn to the episode; append messages and their tokens."""
    r, episode = live.rollout, live.episode
    assert episode is not None
    parsed = parse_assistant(text)
    r.messages.append(assistant_message(parsed))
    before = list(r.messages)
    user_done = False
    if parsed.tool_calls or parsed.errors:
        for call in parsed.tool_calls:
            obs = str(episode.call_tool(call.name, call.arguments))
            r.messages.append({"role": "tool", "name": call.name, "content": obs})
            live.errors += obs.startswith("Error:")
        for raw, reason in parsed.errors:
            obs = str(episode.malformed_call(raw, reason))
            r.messages.append({"role": "tool", "content": obs})
            live.errors += obs.startswith("Error:")
    else:
        reply, user_done = episode.user_reply(parsed.content)
        if reply or not user_done:
            r.messages.append({"role": "user", "content": str(reply)})
    r.steps += 1
    _append(r, enc.segment(before, r.messages), 0)
    if r.loss_end is None and getattr(episode, "loss_closed", False):
        r.loss_end = len(r.token_ids)
    if user_done:
        live.finish("user_done")
    elif getattr(episode, "finished", False):
        live.finish("env_done")
    elif r.steps >= config.max_steps:
        live.finish("max_steps")
    elif config.max_errors and live.errors >= config.max_errors:
        live.finish("max_errors")
    elif live.length_hits >= 2:
        live.finish("length")


KV_FILL = 0.9
"""Share of a backend's KV cache that admitted episodes may claim; the rest is room for their next turns."""


class _Admission:
    """Which episodes play the next round (the module docstring's "Admission")."""

    def __init__(self, lives: list[_Live], capacity: int | None, max_new_tokens: int) -> None:
        self.lives = lives
        self.budget = None if capacity is None else int(capacity * KV_FILL)
        self.max_new_tokens = max_new_tokens
        self.shared = _common_prefix_length([live.rollout.token_ids for live in lives if not live.done])

    def live(self) -> list[_Live]:
        """The running episodes that play this round: all of them, or the first ones in task order
        whose tokens fit in the budget (at least one, so that an episode larger than the cache
        still plays). Always the first ones: the same episodes keep their place, and their cache,
        round after round, until one of them ends."""
        running = [live for live in self.lives if not live.done]
        if self.budget is None:
            return running
        chosen, demand = [], self.shared
        for live in running:
            need = len(live.rollout.token_ids) - self.shared + self.max_new_tokens
            if chosen and demand + need > self.budget:
                break
            chosen.append(live)
            demand += need
        return chosen


def _common_prefix_length(sequences: list[list[int]]) -> int:
    if not sequences:
        return 0
    first, n = sequences[0], min(map(len, sequences))
    for seq in sequences[1:]:
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    return n


def run_rollouts(
    env: Environment,
    tasks: list[Task],
    backend: GenerationBackend,
    tokenizer: Any,
    config: RolloutConfig | None = None,
    *,
    progress: ProgressFn | None = None,
    adapters: Sequence[str | None] | None = None,
) -> list[Rollout]:
    """Play one episode per task, batching generation across episodes. See the module docstring.

    ``adapters`` (one LoRA name or None per task) runs each episode under its own adapter in the
    same batches; only backends whose ``generate`` takes ``adapters=`` (vLLM) support it.
    """
    config = config or RolloutConfig()
    if adapters is not None and len(adapters) != len(tasks):
        raise ValueError(f"{len(adapters)} adapters for {len(tasks)} tasks")
    enc = _Encoder(tokenizer, env.tool_schemas())
    lives = [_start(env, task, enc, config.seed) for task in tasks]
    for live, adapter in zip(lives, adapters or []):
        live.adapter = adapter
    total, finished = len(lives), 0

    def report() -> None:
        nonlocal finished
        now = sum(live.done for live in lives)
        if progress is not None and now != finished:
            progress(now, total)
        finished = now

    report()
    admit = _Admission(lives, getattr(backend, "kv_capacity_tokens", None), config.max_new_tokens)
    round_index = 0
    while True:
        active: list[_Live] = []
        for live in admit.live():
            r = live.rollout
            try:
                prompt_tail = enc.generation_prompt(r.messages)
            except Exception as exc:
                live.finish("error", error=f"template: {type(exc).__name__}: {exc}")
                continue
            if len(r.token_ids) + len(prompt_tail) + config.max_new_tokens > config.max_context_tokens:
                live.finish("context")
                continue
            _append(r, prompt_tail, 0)
            if r.steps == 0:
                r.prompt_len = len(r.token_ids)
            active.append(live)
        report()
        if not active:
            if not all(live.done for live in lives):  # the round's episodes all ended before generating
                continue
            break
        params = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            max_new_tokens=config.max_new_tokens,
            seed=derive_seed(config.seed, round_index),
        )
        prompts = [live.rollout.token_ids for live in active]
        if adapters is None:
            generations = backend.generate(prompts, params)
        else:
            generations = backend.generate(prompts, params, adapters=[live.adapter for live in active])
        round_index += 1
        for live, gen in zip(active, generations):
            r = live.rollout
            _append(r, list(gen.token_ids), 1, list(gen.logprobs) if gen.logprobs else None)
            r.n_generated += len(gen.token_ids)
            r.assistant_texts.append(gen.text)
            if gen.finish_reason == "stop" and gen.token_ids and gen.token_ids[-1] == enc.stop_id:
                live.length_hits = 0
            else:  # close the cut turn so the conversation stays well-formed
                live.length_hits += 1
                _append(r, [enc.stop_id], 0)
            try:
                _process_turn(live, gen.text, enc, config)
            except Exception as exc:  # environment bug: record it, keep the other episodes going
                log.exception("episode %s failed", live.task.task_id)
                live.finish("error", error=f"{type(exc).__name__}: {exc}")
        report()
    return [live.rollout for live in lives]


def trajectory_id(task_id: str, policy: str, seed: int, messages: list[Message], agent_id: str = "") -> str:
    parts = [task_id, policy, str(seed), json.dumps(messages, sort_keys=True, default=str)]
    payload = "\x1f".join(parts + ([agent_id] if agent_id else []))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def rollout_to_record(rollout: Rollout, *, policy: str, source: str, split: str, agent_id: str = "") -> dict[str, Any]:
    """The trajectory record (see DESIGN's data model) for one rollout. ``agent_id`` names the agent
    that played it (:func:`trace_assets.agent.identity.agent_id`): the same conversation played by
    another agent (another warm-start, adapter, backend or dtype) is another trajectory."""
    task, result = rollout.task, rollout.result
    info = {
        **result.info,
        "family": task.family,
        "steps": rollout.steps,
        "n_generated": rollout.n_generated,
        "truncated": rollout.truncated,
        "stop_reason": rollout.stop_reason,
    }
    if rollout.error:
        info["runner_error"] = rollout.error
    return {
        "trajectory_id": trajectory_id(task.task_id, policy, rollout.seed, rollout.messages, agent_id),
        "task_id": task.task_id,
        "env": task.env,
        "split": split,
        "policy": policy,
        "messages": rollout.messages,
        "reward": float(result.reward),
        "success": bool(result.success),
        "info": info,
        "source": source,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "agent_id": agent_id,
    }
