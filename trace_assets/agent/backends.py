"""Generation backends: token ids in, completions out.

The protocol is deliberately small so a vLLM backend can sit behind it:
``generate(prompts, params) -> list[Generation]``, one per prompt, in order. Prompts are token-id
lists (already chat-formatted, ending with the generation prompt). A completion stops at the
end-of-turn token ``<|im_end|>``, which is then the last of its ``token_ids``
(``finish_reason="stop"``); otherwise it ran to ``max_new_tokens`` (``finish_reason="length"``).

:class:`TransformersBackend` is the CPU/GPU reference backend on HF ``generate``:

* temperature 0 means greedy; otherwise multinomial sampling with ``temperature`` and ``top_p``;
  no other sampling knob of the model's own generation config leaks in (Qwen ships top_k=20 and a
  repetition penalty).
* With ``seed`` set, a call is reproducible: the same prompts, params and ``batch_size`` give the
  same outputs. The global torch RNG is left untouched (a forked RNG is used).
* ``logprobs[i]`` is the log-probability of token i under ``softmax(logits / T)``, i.e. after the
  temperature (T = 1 for greedy) but before top-p truncation. That is what TRL recomputes for
  the old/reference policy, so the numbers are directly comparable.
* Prompts are sorted by length and cut into batches of at most ``batch_size`` to limit padding;
  results come back in the caller's order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

log = logging.getLogger(__name__)

STOP_TOKEN = "<|im_end|>"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    max_new_tokens: int = 96
    seed: int | None = None


@dataclass
class Generation:
    token_ids: list[int]
    """Generated tokens; ends with the stop token when ``finish_reason == "stop"``."""
    text: str
    """``token_ids`` decoded with special tokens kept."""
    logprobs: list[float] | None
    """One per token (see the module docstring), or None when the backend cannot provide them."""
    finish_reason: Literal["stop", "length"]


@runtime_checkable
class GenerationBackend(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One completion per prompt, in the order of ``prompts``."""


class _LogprobRecorder:
    """A logits processor that records the chosen tokens' log-probs without keeping full logits.

    HF runs custom processors before the sampling warpers, so ``scores`` are the model's logits.
    At step t we learn the token chosen at step t-1 (``input_ids[:, -1]``) and gather its log-prob
    from the row kept from step t-1; the last step is gathered by :meth:`finish`. Memory: one
    batch x vocab row instead of one per step.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self.prev = None
        self.taken: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.prev is not None:
            self.taken.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, sequences: Any) -> Any:
        """``[batch, n_generated]`` log-probs of the generated tokens."""
        import torch

        if self.prev is not None:
            self.taken.append(self.prev.gather(1, sequences[:, -1:]).squeeze(1))
            self.prev = None
        if not self.taken:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.taken, dim=1)


class TransformersBackend:
    """HF ``generate`` behind :class:`GenerationBackend` (see the module docstring)."""

    name = "transformers"

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 32) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_id = tokenizer.convert_tokens_to_ids(STOP_TOKEN)
        if self.stop_id is None or self.stop_id == tokenizer.unk_token_id:
            self.stop_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_id

    def _generation_config(self, params: SamplingParams) -> Any:
        from transformers import GenerationConfig

        greedy = params.temperature <= 0
        # Every knob explicit: unset (None) fields would be filled from the model's own config.
        knobs: dict[str, Any] = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            num_return_sequences=1,
            eos_token_id=self.stop_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=False,
        )
        if not greedy:  # warpers run only when sampling; setting them for greedy only warns
            knobs.update(temperature=float(params.temperature), top_p=float(params.top_p),
                         top_k=0, min_p=0.0, typical_p=1.0)
        return GenerationConfig(**knobs)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        import torch
        from transformers import LogitsProcessorList

        device = self.model.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: the new tokens line up on the right
            if prompt:
                input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                attention[row, width - len(prompt) :] = 1
        recorder = _LogprobRecorder(params.temperature)
        sequences = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            generation_config=self._generation_config(params),
            logits_processor=LogitsProcessorList([recorder]),
        )
        new = sequences[:, width:].cpu()
        logprobs = recorder.finish(sequences[:, width:]).cpu()
        out: list[Generation] = []
        for row in range(len(prompts)):
            ids = new[row].tolist()
            if self.stop_id in ids:  # after the stop token there is only padding
                ids = ids[: ids.index(self.stop_id) + 1]
                reason: Literal["stop", "length"] = "stop"
            else:
                reason = "length"
            out.append(
                Generation(
                    token_ids=ids,
                    text=self.tokenizer.decode(ids, skip_special_tokens=False),
                    logprobs=logprobs[row, : len(ids)].tolist(),
                    finish_reason=reason,
                )
            )
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        import torch

        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        results: list[Generation | None] = [None] * len(prompts)
        devices = [self.model.device] if self.model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                for index, gen in zip(chunk, self._generate_batch([prompts[i] for i in chunk], params)):
                    results[index] = gen
        return [r for r in results if r is not None]
