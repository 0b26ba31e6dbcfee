"""A minimal client for OpenAI-compatible chat endpoints (vLLM server, hosted providers, local).

Used by the ``llm`` analyst, the ``llm`` synthesizer and the optional LLM user. Standard library
only. ``complete_json`` is the one bounded retry loop: it asks, parses JSON, validates with the
caller's check, and on failure shows the model its error and asks again, at most ``max_retries``
more times.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trace_assets.settings import clip

T = TypeVar("T")
ECHOED_REPLY_CHARS = 8000
"""How much of an invalid answer a retry shows the model again (a spec is a few thousand)."""


class LLMError(RuntimeError):
    """The endpoint failed, or its output stayed invalid after every retry."""


@dataclass
class ChatClient:
    base_url: str
    model: str
    api_key: str = ""
    timeout_s: float = 120.0
    calls: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)

    def chat(self, messages: list[dict[str, Any]], *, temperature: float = 0.0, max_tokens: int = 1024, seed: int | None = None) -> str:
        """One chat completion; returns the assistant text."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        if seed is not None:
            body["seed"] = seed
        payload = self._post("/chat/completions", body)
        try:
            return payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as exc:
            raise LLMError(f"{self.base_url}: not an OpenAI chat completion response") from exc

    def complete_tokens(self, prompt: list[int], *, max_tokens: int, temperature: float = 0.0,
                        seed: int | None = None) -> tuple[list[int], list[float], str]:
        """One completion of a token-id prompt: (generated token ids, their log-probs, finish reason).

        Needs a vLLM server started with ``--return-tokens-as-token-ids`` (``trace serve`` is), so
        that each reported token is its id (``"token_id:123"``) rather than text to re-tokenize."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": temperature, "logprobs": 0, "skip_special_tokens": False}
        if seed is not None:
            body["seed"] = seed
        payload = self._post("/completions", body)
        try:
            choice = payload["choices"][0]
            tokens, logprobs = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
            ids = [int(t.removeprefix("token_id:")) for t in tokens]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LLMError(f"{self.base_url}: not a completion with token-id log-probs (is the server started "
                           "with --return-tokens-as-token-ids?)") from exc
        return ids, [float(x) for x in logprobs], choice.get("finish_reason") or "length"

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` to ``base_url + path``; the parsed JSON reply. Retries 5xx and network
        errors twice with backoff; anything else is an :class:`LLMError`."""
        key = self.api_key or os.environ.get("TRACE_LLM_API_KEY", "")
        request = urllib.request.Request(
            self.base_url.rstrip("/") + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
        )
        self.calls += 1
        for attempt in range(3):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or attempt == 2:
                    raise LLMError(f"{self.base_url}: HTTP {exc.code}: {exc.read()[:300]!r}") from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == 2:
                    raise LLMError(f"{self.base_url}: {exc}") from exc
            except json.JSONDecodeError as exc:
                raise LLMError(f"{self.base_url}{path}: the reply is not JSON") from exc
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


def extract_json(text: str) -> Any:
    """The first JSON object in ``text`` (code fences and chatter around it are ignored)."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    candidate = fenced.group(1) if fenced else text
    start = candidate.find("{")
    if start < 0:
        raise ValueError("no JSON object in the answer")
    obj, _ = json.JSONDecoder().raw_decode(candidate[start:])
    return obj


def complete_json(
    client: ChatClient,
    messages: list[dict[str, Any]],
    check: Callable[[Any], T],
    *,
    max_retries: int = 2,
    temperature: float = 0.0,
    seed: int | None = None,
    max_tokens: int = 1024,
) -> T:
    """Ask until ``check(parsed_json)`` returns without raising; raise ``LLMError`` with every
    attempt's reason when the retries are spent.

    Whatever the answer makes parsing or ``check`` raise (``ValueError``, but also ``RecursionError``
    from absurd nesting, or a ``TypeError``/``KeyError`` on an unexpected shape) counts as an invalid
    answer. The retry echoes at most ``ECHOED_REPLY_CHARS`` of the bad answer back to the model.
    """
    convo = list(messages)
    reasons = []
    for attempt in range(max_retries + 1):
        text = client.chat(convo, temperature=temperature, seed=None if seed is None else seed + attempt, max_tokens=max_tokens)
        try:
            return check(extract_json(text))
        except (ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError) as exc:
            reason = clip(str(exc) if not isinstance(exc, RecursionError) else "the JSON is nested too deeply", 300)
            reasons.append(reason)
            convo = convo + [
                {"role": "assistant", "content": clip(text, ECHOED_REPLY_CHARS)},
                {"role": "user", "content": f"That answer is invalid: {reason}. Reply with the corrected JSON object only."},
            ]
    raise LLMError(f"invalid output after {max_retries + 1} attempts: " + " | ".join(reasons))
