"""TRACE Step 4 (Route): the training-free label-logit router.

The router is the frozen base model itself. For a task it reads a prompt made of

1. the task's first user prompt ``o1`` (``episode.initial_messages()[1]["content"]``);
2. every candidate capability under a one-token label (``A``, ``B``, ...), with its description and
   one short successful trajectory sampled from its synthetic environment (:func:`example_text`);
3. one more label, the last one, meaning "use the base model" (no adapter);
4. a request for the single best label,

and picks the label whose token gets the largest next-token logit. Nothing is trained.

Rendering (decided here, checked by :func:`label_token_ids`):

* :func:`build_router_prompt` returns the user-turn text (items 1-4). :func:`router_chat_text` wraps
  it as a chat through the tokenizer's own chat template: a short system message
  (:data:`ROUTER_SYSTEM`), the user turn, the assistant generation prompt, and then the literal
  prefix ``"Answer:"`` (:data:`ANSWER_PREFIX`) inside the assistant turn. Pre-filling the answer
  makes the very next token the label, so one forward pass scores every label.
* A label is read as it would be written after ``"Answer:"``: with ONE leading space (``" A"``).
  Byte-level BPE vocabularies (GPT-2, Llama-3, Qwen, SmolLM2) hold ``"ĠA"`` ... ``"ĠZ"`` as single
  tokens, while a prompt ending in ``"Answer: "`` would end on a lone ``"Ġ"`` token the model never
  sees before a letter. :func:`label_token_ids` tokenizes ``prefix + " " + label`` and requires the
  prefix's tokens to be unchanged and exactly one token added; otherwise ``ValueError`` names the label.

Contracts of :class:`LogitRouter`:

* ``scores(prompts)`` runs ONE forward pass per batch of at most ``batch_size`` prompts (left padding,
  explicit position ids so padding never shifts positions, ``torch.inference_mode``, only the last
  position's logits), and returns, per prompt, the raw next-token logits of exactly the label tokens,
  keyed by candidate name, with key ``None`` (:data:`BASE`) for the base label. If the model is a
  ``PeftModel`` its adapters are disabled for the pass: the router is the frozen base.
* ``route(prompts)`` returns one :class:`Decision` per prompt: ``probs`` is the softmax over the label
  logits only (after optional calibration); ``choice`` is the arg-max (``None`` = base; ties go to the
  earlier label); ``label`` is the winning letter.
* Contextual calibration (Zhao et al., 2021), off by default: with ``calibrate=True`` the label
  probabilities of content-free tasks (:data:`CONTENT_FREE` in place of ``o1``; averaged) are
  computed once, and each prompt's probabilities are divided by them and renormalised, i.e.
  ``logit - log p_cf`` before the softmax. It removes the model's prior for a letter (small models
  like ``A``), at the cost of one extra batch. With a single content-free prompt a constant bias on
  the label logits cancels exactly; averaging several (the default, as in the paper) makes that
  approximate.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""Label letters, in order; the base model takes the letter after the last candidate's."""
BASE: None = None
"""The key/choice meaning "the base model, no adapter"."""
BASE_NAME = "base"
"""How the base choice is written where ``None`` cannot be (tables, JSON)."""
ANSWER_PREFIX = "Answer:"
ROUTER_SYSTEM = (
    "You are a router. You read a customer-service task and decide which specialist assistant "
    "should handle it. Reply with a single letter."
)
CONTENT_FREE = ("N/A", "", "[MASK]")
"""Content-free first user prompts used by contextual calibration."""


@dataclass(frozen=True)
class RouterCandidate:
    """One capability adapter the router may pick."""

    name: str
    description: str
    example: str
    """One short successful trajectory of the capability's synthetic env (see :func:`example_text`)."""


@dataclass
class Decision:
    """A routing decision for one task (shared by every router in this package)."""

    choice: str | None
    """Candidate (adapter) name, or ``None`` for the base model."""
    probs: dict[str | None, float]
    """Probability per candidate name (``None`` = base); sums to 1."""
    label: str
    """The router's own label for ``choice``: the letter for :class:`LogitRouter`; the capability
    name (``"base"`` for the base) for retrieval routers."""
    similarity: float | None = None
    """Retrieval routers: the best cosine similarity seen (what the threshold compares)."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def choice_name(self) -> str:
        return BASE_NAME if self.choice is None else self.choice

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: ``None`` keys and choices are written as ``"base"``."""
        return {
            "choice": self.choice_name,
            "probs": {BASE_NAME if k is None else k: float(v) for k, v in self.probs.items()},
            "label": self.label,
            "similarity": self.similarity,
            "info": self.info,
        }


# ---------------------------------------------------------------- prompt pieces


def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def example_text(messages: Sequence[dict[str, Any]], max_chars: int = 600) -> str:
    """A trajectory as compact text: one line per turn, system prompt dropped, long turns clipped.

    Lines look like ``User: ...``, ``Assistant: ...``, ``Assistant calls get_order({"order_id": ...})``
    and ``Tool: ...``. The whole text is at most ``max_chars`` characters (ends with ``…`` if cut).
    """
    lines: list[str] = []
    for message in messages:
        role = message.get("role")
        if role == "system":
            continue
        content = message.get("content") or ""
        if role == "assistant":
            if content.strip():
                lines.append("Assistant: " + _clip(content, 200))
            for call in message.get("tool_calls") or []:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args_text = args if isinstance(args, str) else json.dumps(args, sort_keys=True)
                lines.append(f"Assistant calls {fn.get('name')}({_clip(args_text, 120)})")
        elif role == "tool":
            lines.append("Tool: " + _clip(content, 120))
        elif role == "user":
            lines.append("User: " + _clip(content, 200))
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max(max_chars - 1, 0)] + "…"


def choose_example(trajectories: Iterable[Sequence[dict[str, Any]]], max_chars: int = 600) -> str:
    """The shortest (rendered) of some successful trajectories, as :func:`example_text`.

    The caller passes successes only; an empty input gives ``""``.
    """
    best: tuple[int, str] | None = None
    for messages in trajectories:
        full = example_text(messages, max_chars=10**9)
        if best is None or len(full) < best[0]:
            best = (len(full), example_text(messages, max_chars))
    return best[1] if best else ""


def first_user_prompt(env: Any, task: Any) -> str:
    """The task's first user prompt ``o1``: ``env.start(task).initial_messages()[1]["content"]``."""
    return str(env.start(task).initial_messages()[1]["content"])


def router_labels(n_candidates: int) -> list[str]:
    """The labels of ``n_candidates`` candidates plus the base label (last)."""
    if n_candidates + 1 > len(LABELS):
        raise ValueError(f"at most {len(LABELS) - 1} candidates fit the one-letter labels")
    return list(LABELS[: n_candidates + 1])


def label_token_ids(tokenizer: Any, n: int, *, labels: Sequence[str] = LABELS,
                    prefix: str = ANSWER_PREFIX) -> list[int]:
    """Token id of each of the first ``n`` labels as it appears after ``prefix`` (``" " + label``).

    ``n`` counts every label the prompt uses, i.e. ``len(candidates) + 1`` with the base label.
    Raises ``ValueError`` naming the label when appending it to ``prefix`` does not add exactly one
    token (or changes the prefix's own tokens), and when two labels share a token.
    """
    if n > len(labels):
        raise ValueError(f"{n} labels requested, only {len(labels)} available")
    base = tokenizer.encode(prefix, add_special_tokens=False)
    ids: list[int] = []
    for label in labels[:n]:
        full = tokenizer.encode(prefix + " " + label, add_special_tokens=False)
        if len(full) != len(base) + 1 or full[: len(base)] != base:
            added = tokenizer.convert_ids_to_tokens(full[len(base):]) if full[: len(base)] == base else full
            raise ValueError(f"router label {label!r} is not a single token after {prefix!r}: {added}")
        ids.append(full[-1])
    if len(set(ids)) != len(ids):
        raise ValueError(f"router labels {list(labels[:n])} do not map to distinct tokens")
    return ids


def build_router_prompt(first_user_prompt: str, candidates: Sequence[RouterCandidate]) -> str:
    """The router's user-turn text: the task, each candidate under its label, the base label, the ask."""
    labels = router_labels(len(candidates))
    base_label = labels[-1]
    parts = [
        "A customer wrote to an assistant:",
        f'"""\n{first_user_prompt.strip()}\n"""',
        "",
        "Which assistant should handle this conversation? The options:",
    ]
    for label, cand in zip(labels, candidates):
        parts.append("")
        parts.append(f"{label}. Specialist '{cand.name}': {cand.description.strip()}")
        if cand.example.strip():
            parts.append(f"Example of a conversation it handled well:\n{cand.example.strip()}")
    parts.append("")
    parts.append(f"{base_label}. The general assistant: use it when no specialist above fits the task.")
    parts.append("")
    letters = ", ".join(labels)
    parts.append(f"Answer with the single best letter ({letters}).")
    return "\n".join(parts)


def router_chat_text(tokenizer: Any, first_user_prompt: str, candidates: Sequence[RouterCandidate]) -> str:
    """The full text fed to the model: chat template (system + user + generation prompt) + ``"Answer:"``."""
    messages = [
        {"role": "system", "content": ROUTER_SYSTEM},
        {"role": "user", "content": build_router_prompt(first_user_prompt, candidates)},
    ]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return chat + ANSWER_PREFIX


# ---------------------------------------------------------------- the router


def _frozen_base(model: Any) -> Any:
    """Context in which ``model`` runs without adapters (a no-op for plain models)."""
    disable = getattr(model, "disable_adapter", None)
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but keep the router usable without it
        return contextlib.nullcontext()
    return disable() if isinstance(model, PeftModel) and disable is not None else contextlib.nullcontext()


def _softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def last_position_logits(model: Any, tokenizer: Any, texts: Sequence[str], token_ids: Sequence[int]) -> Any:
    """``[len(texts), len(token_ids)]`` fp32 next-token logits at the end of each text.

    One forward pass: left padding, position ids counted over real tokens only, inference mode,
    only the last position through the LM head (``logits_to_keep=1``), adapters disabled.
    """
    import torch

    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        attention[i, width - len(row):] = 1
    # Left padding shifts every real token right; explicit positions keep RoPE as if unpadded.
    positions = (attention.cumsum(dim=-1) - 1).clamp(min=0)
    device = getattr(model, "device", torch.device("cpu"))
    with torch.inference_mode(), _frozen_base(model):
        out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                    position_ids=positions.to(device), logits_to_keep=1, use_cache=False)
    logits = out.logits[:, -1, :].float()
    return logits[:, torch.tensor(list(token_ids), device=logits.device)].cpu()


class LogitRouter:
    """The paper's label-logit router over ``candidates`` (plus the base). See the module docstring."""

    def __init__(self, model: Any, tokenizer: Any, candidates: Sequence[RouterCandidate], *,
                 batch_size: int = 8, calibrate: bool = False,
                 content_free: Sequence[str] = CONTENT_FREE) -> None:
        names = [c.name for c in candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate candidate names: {names}")
        self.model = model
        self.tokenizer = tokenizer
        self.candidates = list(candidates)
        self.batch_size = max(1, batch_size)
        self.calibrate = calibrate
        self.content_free = tuple(content_free)
        self.labels = router_labels(len(self.candidates))
        self.names: list[str | None] = [*names, BASE]
        self.token_ids = label_token_ids(tokenizer, len(self.labels))
        self._content_free: list[float] | None = None

    def prompt(self, first_user_prompt: str) -> str:
        return router_chat_text(self.tokenizer, first_user_prompt, self.candidates)

    def _logits(self, first_user_prompts: Sequence[str]) -> list[list[float]]:
        out: list[list[float]] = []
        for start in range(0, len(first_user_prompts), self.batch_size):
            chunk = first_user_prompts[start:start + self.batch_size]
            logits = last_position_logits(self.model, self.tokenizer, [self.prompt(p) for p in chunk], self.token_ids)
            out.extend(logits.tolist())
        return out

    def scores(self, first_user_prompts: Sequence[str]) -> list[dict[str | None, float]]:
        """Raw label logits per prompt, keyed by candidate name (``None`` = base)."""
        return [dict(zip(self.names, row)) for row in self._logits(list(first_user_prompts))]

    def content_free_probs(self) -> list[float]:
        """Mean label probabilities over the content-free prompts (computed once)."""
        if self._content_free is None:
            rows = [_softmax(r) for r in self._logits(list(self.content_free))]
            self._content_free = [sum(col) / len(rows) for col in zip(*rows)]
        return self._content_free

    def route(self, first_user_prompts: Sequence[str]) -> list[Decision]:
        rows = self._logits(list(first_user_prompts))
        prior = self.content_free_probs() if self.calibrate else None
        decisions = []
        for raw in rows:
            row = raw
            if prior is not None:  # p / p_cf, renormalised == softmax(logit - log p_cf)
                row = [v - math.log(max(p, 1e-30)) for v, p in zip(row, prior)]
            probs = _softmax(row)
            best = max(range(len(probs)), key=lambda i: (probs[i], -i))
            decisions.append(Decision(
                choice=self.names[best], probs=dict(zip(self.names, probs)), label=self.labels[best],
                info={"logits": dict(zip(self.labels, raw))},
            ))
        return decisions
