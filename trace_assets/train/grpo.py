"""GRPO for one capability: a frozen base, one LoRA adapter, multi-turn rollouts in a SyntheticEnv.

Contract of :class:`GRPOTrainer` (``GRPOTrainer(model, tokenizer, env, config, output_dir).train()``):

* The base model is frozen; a fresh LoRA adapter (``config.lora_*``) is the only trainable part. Its
  initial weights are a function of ``config.seed`` alone (``agent.lora.seeded_lora_init``), so the
  training seed drives both the initialization and the sampling.
* Iteration ``i`` (1-based) samples ``G = config.groups`` tasks on the env's seeds
  ``seed_offset + (i-1)*G ...`` and plays ``K = config.samples_per_group`` episodes per task through
  the shared batched runner (:func:`run_rollouts`, temperature ``config.temperature``, sampling seed
  derived from ``(config.seed, i)``). So iteration ``i`` is the same after a resume.
* Advantage ``A = (r - mean_group) / (std_group + eps)`` (population std). The loss is the PPO-style
  clipped surrogate, averaged over every loss token of the iteration (token-level mean), plus
  ``beta * KL`` (k3 estimator) against the reference = the base with the adapter disabled
  (``beta = 0``, the default, skips the reference forward entirely).
* Only tokens the model generated (``Rollout.env_mask == 1``) enter the loss; the system prompt, tool
  results and simulated-user turns do not.
* Hints (``config.swap_hints``, off by default): a hinted episode was sampled under the hinted
  system prompt. With the swap, its prefix is re-rendered and re-tokenized with the plain system
  prompt before the gradient step, so the adapter learns to act that way *without* the hint. Those
  tokens are off-policy twice over (another prompt, and a prefix sampled under it), so they do not
  enter the PPO clip, whose ratio pi(a | plain) / pi_old(a | hinted) would be unbounded for a
  negative advantage. They use truncated importance sampling instead (:func:`hint_swap_loss`):
  per token ``-min(rho, c) * A * log pi_theta(a | plain)`` with ``rho`` detached and
  ``c = config.hint_is_cap``, the per-token truncation of V-trace / ACER. Its gradient weight lies in
  ``[0, c]`` for either sign of A; the per-token weight ignores the prefix's own ratio (the
  product over the prefix would be unbounded), a bias traded for the bound. Without the swap a
  hinted episode is trained as sampled, under its hinted prompt (exactly on-policy).
* On-policy guard: every iteration compares the log-probs the sampler reported with the trainer's
  own log-probs of the same tokens (on-policy tokens only; computed by the loss's forward pass
  anyway): ``onpolicy_mean_abs = mean |lp_sampler - lp_trainer|`` and ``onpolicy_kl`` (the k3
  estimate of KL(sampler || trainer)). Above ``config.onpolicy_max_abs`` the iteration raises
  :class:`OffPolicyError` before its optimizer step: the sampler served another policy than the
  one being trained (a stale or missing adapter, another model, temperature or template). The bound
  sits above the numerical gap between a bf16 sampler and a bf16-autocast trainer (measured in
  ``benchmarks/adapter_fidelity.py``, "on-policy"), so it catches gross mismatches; an adapter too
  small to move log-probs past numerics is caught by the fidelity probe (``agent/fidelity.py``).
* Old log-probs are never recomputed. Non-hinted tokens with ``steps_per_iteration == 1``: the
  policy that sampled them is the policy being differentiated, so the ratio is exactly 1 and only
  its gradient matters; we use ``old = current.detach()`` (no forward pass, and no ratio noise from
  generate-time fp32 vs train-time bf16 numerics). Otherwise (hinted tokens, or several steps per
  iteration) ``old`` is the rollout's own log-probs (the behaviour policy, free).
* Groups whose rewards are all equal have zero advantage; with ``beta = 0`` they contribute no
  gradient, so they are skipped in the optimization (their tokens still count in the token-mean
  denominator, so the step is identical to computing them).
* Robustness: a checkpoint (adapter, optimizer, iteration, RNG state, metrics history) is written
  every ``checkpoint_every`` iterations into ``output_dir/checkpoints/iter-NNNN`` through a temporary
  folder and an atomic rename; ``train()`` resumes from the newest one. A non-finite loss or
  gradient, an environment error or a reward-function error raises :class:`GRPOError` (naming the
  iteration and the task) *before* the optimizer step, so the newest checkpoint on disk is the last
  good state.
* The final adapter is saved (atomically) to ``output_dir/adapter`` (PEFT format) and the run summary
  to ``output_dir/summary.json``.

Why not TRL's ``GRPOTrainer`` (trl 1.16, read in ``trl/trainer/grpo_trainer.py``)? Its
``rollout_func`` can drive our multi-turn runner (it returns prompt_ids/completion_ids/logprobs and
``env_mask``), runs on CPU with ``use_vllm=False`` and can be given the plain prompt ids for hinted
episodes. What it provably cannot do:

1. Use the rollout's log-probs as the old policy. With ``use_vllm=False`` the ``logprobs`` returned by
   ``rollout_func`` are dropped (they only feed the vLLM importance-sampling correction, gated on
   ``use_vllm and vllm_importance_sampling_correction``). ``old_per_token_logps`` is either
   ``per_token_logps.detach()`` or recomputed by an extra no-grad forward on the returned (plain)
   prompt. So the hinted-prompt behaviour log-probs can never enter the clipped ratio (the hint
   nudge above), and with several steps per iteration it pays the recomputation we must avoid.
2. Stop on a NaN loss keeping the last good checkpoint: HF ``Trainer`` has no such stop
   (``logging_nan_inf_filter`` hides NaN losses from the logs and keeps training).
3. Write checkpoints atomically: ``Trainer._save_checkpoint`` writes ``checkpoint-N`` in place, and a
   kill mid-write leaves a folder that ``resume_from_checkpoint`` picks up and fails on.

(2) and (3) could be patched by subclassing private methods; (1) cannot without re-implementing
``_generate_and_score_completions``. ``rollout_func`` is also flagged experimental. So this is a
small typed loop with TRL-like names; the math lives in pure functions below.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from trace_assets.agent.backends import TransformersBackend
from trace_assets.agent.chat import render
from trace_assets.agent.lora import (
    DEFAULT_TARGET_MODULES,
    add_lora,
    autocast,
    bf16_supported,
    lora_config,
    token_logprobs,
)
from trace_assets.agent.rollout import Rollout, RolloutConfig, derive_seed, run_rollouts
from trace_assets.envs.base import Environment
from trace_assets.paths import swap_in_folder

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
LORA_INIT = "seeded-per-layer-v1"
"""How a fresh adapter is initialized: ``agent.lora.seeded_lora_init`` with ``GRPOConfig.seed``.
Until 2026-12-01 it was PEFT's init from torch's global RNG (not a function of the seed)."""


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class GRPOConfig:
    """Everything that defines a GRPO run. Profiles: :data:`PAPER`, :data:`DEMO`, :data:`TINY`."""

    iterations: int = 40
    """At most this many iterations (the paper's limit)."""
    groups: int = 4
    """G: tasks (seeds) per iteration."""
    samples_per_group: int = 8
    """K: rollouts per task; one advantage group."""
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    """Clip the adapter's gradient norm; 0 disables clipping (the norm is still reported)."""
    epsilon: float = 0.2
    """PPO ratio clip: ratios outside [1 - epsilon, 1 + epsilon] get no gradient."""
    beta: float = 0.0
    """KL weight against the base (adapter disabled); 0 skips the reference forward."""
    advantage_eps: float = 1e-4
    steps_per_iteration: int = 1
    """Optimizer steps on each iteration's batch."""
    micro_batch_size: int = 4
    """At most this many sequences per forward/backward pass."""
    micro_batch_tokens: int = 6144
    """And at most this many (padded) tokens per pass: activation memory grows with tokens, about
    1.5-1.8 GB per 1k tokens for SmolLM2-135M with LoRA in bf16 autocast (measured), so 4 target-env
    episodes of 4k tokens (~25 GB) killed a 24 GB machine. A longer sequence still goes alone. The
    loss is the same sum whatever the split."""
    bf16: bool | None = None
    """bf16 autocast for the training forward; None = where supported (``bf16_supported``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_steps: int = 50
    """Assistant turns per episode."""
    max_new_tokens: int = 96
    max_context_tokens: int = 4096
    generation_batch_size: int = 32
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    swap_hints: bool = False
    """Re-tokenize hinted episodes with the plain system prompt before the gradient step (trained
    by :func:`hint_swap_loss`). Off: it is kept only where it measurably beats training hinted
    episodes as sampled (``benchmarks/hint_swap.py``)."""
    hint_is_cap: float = 1.0
    """``c`` of the swapped tokens' truncated importance weight ``min(rho, c)``."""
    onpolicy_max_abs: float = 0.25
    """The on-policy guard's bound on ``mean |lp_sampler - lp_trainer|`` (nats per token); 0 disables."""
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    seed: int = 0
    seed_offset: int = 0
    """Training tasks use env seeds from ``seed_offset`` on (keep evaluation seeds elsewhere)."""

    def __post_init__(self) -> None:
        if self.groups < 1 or self.samples_per_group < 1 or self.iterations < 0:
            raise ValueError("groups and samples_per_group must be >= 1, iterations >= 0")
        if self.micro_batch_size < 1 or self.steps_per_iteration < 1 or self.checkpoint_every < 1 or self.micro_batch_tokens < 1:
            raise ValueError("micro_batch_size, micro_batch_tokens, steps_per_iteration and checkpoint_every must be >= 1")
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError("epsilon must lie in [0, 1)")
        if self.hint_is_cap <= 0 or self.onpolicy_max_abs < 0:
            raise ValueError("hint_is_cap must be > 0 and onpolicy_max_abs >= 0")

    def rollout_config(self, iteration: int) -> RolloutConfig:
        return RolloutConfig(
            max_steps=self.max_steps, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            top_p=self.top_p, seed=derive_seed(self.seed, 1_000_000 + iteration),
            max_context_tokens=self.max_context_tokens,
        )

    EXECUTION_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"micro_batch_size", "micro_batch_tokens", "generation_batch_size", "checkpoint_every", "keep_checkpoints",
         "onpolicy_max_abs"})
    """Fields that change how a run executes (memory, batching, checkpoint cadence), not the recipe:
    the loss is the same sum however it is split (up to float rounding), and batching generation
    changes at most which random draws a sample gets, not its distribution. The guard's bound only
    decides whether a run stops, never what it computes."""

    def identity(self) -> dict[str, Any]:
        """``to_dict()`` without :attr:`EXECUTION_FIELDS`: what an adapter's ``code_version`` and
        folder key hash, so a memory setting tuned for a smaller machine never retrains anything.
        It names the LoRA initialization scheme too (:data:`LORA_INIT`): adapters initialized
        another way are other adapters."""
        return {**{k: v for k, v in self.to_dict().items() if k not in self.EXECUTION_FIELDS}, "lora_init": LORA_INIT}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["adam_betas"] = list(self.adam_betas)
        data["target_modules"] = list(self.target_modules)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GRPOConfig":
        data = dict(data)
        if "adam_betas" in data:
            data["adam_betas"] = tuple(data["adam_betas"])
        if "target_modules" in data:
            data["target_modules"] = tuple(data["target_modules"])
        return cls(**data)


PAPER = GRPOConfig()
"""The paper's settings: AdamW lr 1e-5, at most 40 iterations, temperature 1.0, 50 steps."""

DEMO = replace(
    PAPER, learning_rate=1e-4, iterations=4, groups=4, samples_per_group=4, max_steps=12, temperature=0.7,
    micro_batch_size=4, steps_per_iteration=1,
)
"""The 2-core CPU demo. Differs from the paper on purpose, and says why:

* lr 1e-4: 1e-5 barely moves a 135M LoRA in a few iterations; DESIGN's prototype moved a capability
  with 1e-4, one step per iteration, bf16 autocast, micro-batches of 4, within 4-8 iterations.
* 4 iterations of G=4 x K=4, 12 turns per episode: the equal-rollout GRPO-on-target baseline then
  costs as much again, and both must fit the demo's 45 minutes on 2 cores (an iteration costs
  ~2 min here, and ~1.3 min more of baseline). 5 iterations measured the adapter's held-out synthetic
  reward 0.625 -> 0.677 (success 0.56 -> 0.63) but a 78-minute demo. 12 turns, not 8: the base agent's
  successful multi-step train episodes take 8-9 turns.
* temperature 0.7: measured on the TRAIN side (calibration round 0 of the two demo capabilities,
  16 seeds x 2, 12 turns): at T = 1.0 mean reward 0.125 / 0.193 and success 0.031 / 0.094; at
  T = 0.7, 0.207 / 0.307 and 0.062 / 0.156. At T = 1.0 a 135M model's samples are mostly noise.
"""

TINY = replace(
    PAPER, learning_rate=1e-3, iterations=2, groups=2, samples_per_group=2, max_steps=2,
    max_new_tokens=8, micro_batch_size=4, generation_batch_size=8, max_context_tokens=4096,
)
"""Tests and UI checks with the tiny random model: two iterations of 2 x 2 short episodes."""

PROFILES = {"paper": PAPER, "demo": DEMO, "tiny": TINY}


# ---------------------------------------------------------------- the math (pure functions)


def micro_batches(lengths: Sequence[int], max_sequences: int, max_tokens: int) -> list[list[int]]:
    """Consecutive index chunks of ``lengths`` with at most ``max_sequences`` sequences and at most
    ``max_tokens`` padded tokens (``len(chunk) * longest``) each; a sequence longer than
    ``max_tokens`` forms a chunk of its own. Order is kept (sort by length first for less padding)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) >= max_sequences or max(widest, n) * (len(current) + 1) > max_tokens):
            chunks.append(current)
            current, widest = [], 0
        current.append(i)
        widest = max(widest, n)
    if current:
        chunks.append(current)
    return chunks


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` per group; ``rewards`` is ``[groups, samples]``.

    Population std (``unbiased=False``): a group of equal rewards gets exactly 0 advantage.
    """
    rewards = rewards.to(torch.float64) if rewards.dtype != torch.float64 else rewards
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)
    return (rewards - mean) / (std + eps)


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_t mask_t * (-min(rho_t A_t, clip(rho_t) A_t) + beta KL_t) / normalizer``.

    All tensors are element-aligned (any shape). ``rho = exp(logprobs - old_logprobs)``; KL is the k3
    estimator ``exp(ref - lp) - (ref - lp) - 1`` (>= 0, unbiased for KL(pi || ref)). ``normalizer``
    defaults to ``mask.sum()`` (token-level mean). Masked positions are selected with ``where``, so
    even inf/NaN log-probs there cannot leak into the loss or its gradient.
    """
    keep = mask.bool()
    lp = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    old = torch.where(keep, old_logprobs.to(lp.dtype), torch.zeros_like(lp))
    adv = torch.where(keep, advantages.to(lp.dtype), torch.zeros_like(lp))
    ratio = torch.exp(lp - old)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv)
    per_token = -surrogate
    if beta and ref_logprobs is not None:
        diff = torch.where(keep, ref_logprobs.to(lp.dtype), torch.zeros_like(lp)) - lp
        per_token = per_token + beta * (torch.exp(diff) - diff - 1)
    total = torch.where(keep, per_token, torch.zeros_like(per_token)).sum()
    denom = mask.sum() if normalizer is None else normalizer
    return total / torch.clamp(torch.as_tensor(denom, dtype=total.dtype), min=1)


def hint_swap_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    *, cap: float = 1.0, normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated importance sampling for tokens sampled under another prompt (the hint swap).

    ``sum_t mask_t * -(min(rho_t, cap) * A_t * logprobs_t) / normalizer`` with ``rho = exp(logprobs -
    old_logprobs)`` detached: the gradient is ``-min(rho, cap) * A * grad log pi``, whose weight lies
    in ``[0, cap]`` whatever the ratio and the sign of A (the PPO clip bounds neither a negative
    advantage's ratio from above nor helps a positive one below ``1 - eps``). Masked positions are
    selected with ``where``, as in :func:`clipped_surrogate_loss`.
    """
    keep = mask.bool()
    lp = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    old = torch.where(keep, old_logprobs.to(lp.dtype), torch.zeros_like(lp))
    adv = torch.where(keep, advantages.to(lp.dtype), torch.zeros_like(lp))
    weight = torch.clamp(torch.exp(lp.detach() - old), max=cap)
    per_token = -(weight * adv * lp)
    total = torch.where(keep, per_token, torch.zeros_like(per_token)).sum()
    denom = mask.sum() if normalizer is None else normalizer
    return total / torch.clamp(torch.as_tensor(denom, dtype=total.dtype), min=1)


def onpolicy_gap(sampler_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor) -> tuple[float, float, int]:
    """``(sum |d|, sum k3, n)`` over aligned tokens, ``d = trainer - sampler``; k3 = exp(d) - d - 1
    estimates KL(sampler || trainer) from the sampler's own tokens (>= 0, unbiased)."""
    d = (trainer_logprobs.detach().double() - sampler_logprobs.double())
    return float(d.abs().sum()), float((torch.exp(d) - d - 1).sum()), int(d.numel())


def clip_fraction(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    *, epsilon: float = 0.2,
) -> torch.Tensor:
    """Share of masked tokens whose clipped term is active (they get no gradient)."""
    keep = mask.bool()
    ratio = torch.exp(torch.where(keep, logprobs - old_logprobs, torch.zeros_like(logprobs)))
    clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon) & (advantages > 0))
    return (clipped & keep).sum().float() / torch.clamp(keep.sum(), min=1).float()


# ---------------------------------------------------------------- samples


@dataclass
class Sample:
    """One rollout as the optimizer sees it (after the hint swap and trimming)."""

    token_ids: list[int]
    loss_mask: list[int]
    """1 on generated tokens (the only ones in the loss)."""
    old_logprobs: list[float]
    """Aligned with ``token_ids``: the sampling log-probs (0 where not generated)."""
    advantage: float
    rollout_old: bool
    """True: the ratio uses ``old_logprobs``; False: ratio 1 (old = current, detached)."""
    task_id: str
    swapped: bool = False
    """Sampled under a hinted prompt and re-tokenized with the plain one: trained by
    :func:`hint_swap_loss`, left out of the on-policy guard."""
    hinted: bool = False
    reward: float = 0.0
    success: bool = False
    """The environment's own success flag (kept even when ``reward_fn`` reshapes the reward)."""


def swap_system_prompt(rollout: Rollout, tokenizer: Any, tools: list[dict[str, Any]], plain_prompt: str) -> Rollout:
    """A copy of ``rollout`` whose first prompt is rendered with ``plain_prompt`` as the system message.

    Everything after ``prompt_len`` (generated and environment tokens) is kept as it is; the old
    log-probs of the generated tokens therefore remain those sampled under the hinted prompt.
    """
    # The opening ends at the first *generated* assistant message: an episode that starts at a
    # decision point opens with assistant messages of its own (an expert prefix, all prompt).
    assistants = [i for i, m in enumerate(rollout.messages) if m.get("role") == "assistant"]
    prefix = len(assistants) - len(rollout.assistant_texts)
    first_reply = assistants[prefix] if 0 <= prefix < len(assistants) else len(rollout.messages)
    opening = rollout.messages[:first_reply]
    if not opening or opening[0].get("role") != "system":
        raise ValueError(f"{rollout.task.task_id}: the conversation does not open with a system message")

    def encode(messages: list[dict[str, Any]]) -> list[int]:
        text = render(tokenizer, messages, tools, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    if encode(opening) != rollout.token_ids[: rollout.prompt_len]:
        raise ValueError(f"{rollout.task.task_id}: re-rendered prefix differs from the sampled one")
    plain = encode([{**opening[0], "content": plain_prompt}] + opening[1:])
    tail = slice(rollout.prompt_len, None)
    return replace(
        rollout,
        messages=[{**opening[0], "content": plain_prompt}] + rollout.messages[1:],
        token_ids=plain + rollout.token_ids[tail],
        env_mask=[0] * len(plain) + rollout.env_mask[tail],
        logprobs=[0.0] * len(plain) + rollout.logprobs[tail],
        prompt_len=len(plain),
    )


def trim(sample: Sample) -> Sample:
    """Drop the tokens after the last loss token (the closing tool/user turn): no loss, no need."""
    last = max((i for i, m in enumerate(sample.loss_mask) if m), default=-1)
    return replace(
        sample, token_ids=sample.token_ids[: last + 1], loss_mask=sample.loss_mask[: last + 1],
        old_logprobs=sample.old_logprobs[: last + 1],
    )


# ---------------------------------------------------------------- metrics and errors


@dataclass
class IterationMetrics:
    iteration: int
    mean_reward: float
    success_rate: float
    reward_std: float
    loss: float
    clip_fraction: float
    grad_norm: float
    kl: float
    gen_time_s: float
    opt_time_s: float
    iter_time_s: float
    loss_tokens: int
    """Generated tokens in the iteration (the token-mean denominator)."""
    trained_sequences: int
    """Sequences that went through forward/backward (zero-advantage groups skipped)."""
    zero_std_groups: int
    hinted: int
    optimizer_steps: int
    onpolicy_mean_abs: float | None = None
    """Mean |sampler - trainer| log-prob of the iteration's on-policy tokens (None: none trained)."""
    onpolicy_kl: float | None = None
    """k3 estimate of KL(sampler || trainer) on the same tokens."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One progress line, as the assets log it."""
        return (f"iteration {self.iteration}: reward {self.mean_reward:.3f}, success {self.success_rate:.2f}, "
                f"loss {self.loss:.4f}, trained {self.trained_sequences} seqs / {self.loss_tokens} tokens, "
                f"on-policy |d| {_fmt(self.onpolicy_mean_abs)} KL {_fmt(self.onpolicy_kl)}, "
                f"gen {self.gen_time_s:.0f}s, opt {self.opt_time_s:.0f}s")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


class GRPOError(RuntimeError):
    """Training stopped: non-finite loss/gradient, environment or reward error.

    ``iteration`` (1-based) and ``task_id`` say where; ``checkpoint`` is the last good checkpoint
    (None when none was written yet). The checkpoint is never overwritten by the failed iteration.
    """

    def __init__(self, reason: str, *, iteration: int, task_id: str | None, checkpoint: Path | None) -> None:
        self.reason, self.iteration, self.task_id, self.checkpoint = reason, iteration, task_id, checkpoint
        where = f"iteration {iteration}" + (f", task {task_id}" if task_id else "")
        super().__init__(f"GRPO stopped at {where}: {reason}. Last good checkpoint: {checkpoint or 'none'}")

    def __reduce__(self) -> Any:  # keyword-only fields: keep the error picklable across processes
        return (_rebuild_error, (type(self), self.reason, self.iteration, self.task_id, self.checkpoint))


def _rebuild_error(cls: type, reason: str, iteration: int, task_id: str | None, checkpoint: Path | None) -> GRPOError:
    return cls(reason, iteration=iteration, task_id=task_id, checkpoint=checkpoint)


class NonFiniteLossError(GRPOError):
    """The loss or the gradient norm was NaN or infinite."""


class RolloutError(GRPOError):
    """The environment or the reward function failed on a task."""


class OffPolicyError(GRPOError):
    """The sampler's log-probs disagree with the trainer's beyond ``GRPOConfig.onpolicy_max_abs``."""


@dataclass
class GRPOResult:
    adapter_dir: Path
    history: list[IterationMetrics]
    config: GRPOConfig
    resumed_from: int
    """Iterations already done when this call started (0 = fresh)."""
    output_dir: Path

    @property
    def iterations_done(self) -> int:
        return self.history[-1].iteration if self.history else 0

    def summary(self) -> dict[str, Any]:
        return {
            "adapter_dir": str(self.adapter_dir), "iterations_done": self.iterations_done,
            "resumed_from": self.resumed_from, "config": self.config.to_dict(),
            "history": [m.to_dict() for m in self.history],
        }


RewardFn = Callable[[Rollout], float]
ProgressFn = Callable[[IterationMetrics], None]
BackendFactory = Callable[[Any, Any], Any]


# ---------------------------------------------------------------- the trainer


class GRPOTrainer:
    """GRPO with a LoRA adapter on a frozen base (see the module docstring for the contract).

    ``model`` is a plain causal LM (the base; an adapter is added) or a ``PeftModel`` to continue.
    ``reward_fn`` overrides ``rollout.result.reward`` (reward shaping); ``backend_factory(model,
    tokenizer)`` overrides the generation backend (default: :class:`TransformersBackend`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        env: Environment,
        config: GRPOConfig,
        output_dir: str | Path,
        *,
        reward_fn: RewardFn | None = None,
        progress: ProgressFn | None = None,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        from peft import PeftModel

        self.config = config
        self.tokenizer = tokenizer
        self.env = env
        self.output_dir = Path(output_dir)
        self.reward_fn = reward_fn
        self.progress = progress
        if isinstance(model, PeftModel):
            self.model = model
        else:
            self.model = add_lora(model, lora_config(config.lora_r, config.lora_alpha, config.lora_dropout,
                                                     config.target_modules), seed=config.seed)
        self.params = [p for _, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.learning_rate, betas=config.adam_betas,
                                           weight_decay=config.weight_decay)
        self.backend = (backend_factory or _default_backend(config))(self.model, tokenizer)
        self.bf16 = bf16_supported() if config.bf16 is None else bool(config.bf16)
        self.device = next(self.model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.history: list[IterationMetrics] = []
        self.iteration = 0
        self.tools = env.tool_schemas()
        self.plain_prompt = env.system_prompt()

    # ---- checkpoints -----------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def latest_checkpoint(self) -> Path | None:
        if not self.checkpoint_root.is_dir():
            return None
        done = sorted(p for p in self.checkpoint_root.glob("iter-*") if (p / "state.json").is_file())
        return done[-1] if done else None

    def save_checkpoint(self) -> Path:
        """Write adapter + optimizer + iteration + RNG + history; atomic (tmp folder, then rename)."""
        root = self.checkpoint_root
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"iter-{self.iteration:04d}"
        tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            self.model.save_pretrained(tmp / "adapter")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
            state = {"format": CHECKPOINT_FORMAT, "iteration": self.iteration, "config": self.config.to_dict(),
                     "history": [m.to_dict() for m in self.history]}
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            if final.exists():  # a re-run of the same iteration: swap it in
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        older = sorted(p for p in root.glob("iter-*") if p != final)
        keep_older = max(self.config.keep_checkpoints - 1, 0)
        for stale in older[: len(older) - keep_older]:
            shutil.rmtree(stale, ignore_errors=True)
        return final

    def load_checkpoint(self, folder: Path) -> int:
        """Restore the adapter, optimizer, RNG and history from ``folder``; returns its iteration."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = json.loads((folder / "state.json").read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{folder}: unknown checkpoint format {state.get('format')!r}")
        saved = GRPOConfig.from_dict(state["config"])
        if saved.identity() != replace(self.config, iterations=saved.iterations).identity():
            log.warning("resuming %s with a different config than it was trained with", folder)
        weights = load_file(str(folder / "adapter" / "adapter_model.safetensors"), device=str(self.device))
        result = set_peft_model_state_dict(self.model, weights)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{folder}: adapter does not fit the model: {result.unexpected_keys[:5]}")
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=self.device))
        rng = torch.load(folder / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        self.history = [IterationMetrics(**m) for m in state["history"]]
        self.iteration = int(state["iteration"])
        return self.iteration

    def resume(self) -> int:
        """Clean leftovers of killed writes and load the newest checkpoint; iterations done."""
        for stale in self.checkpoint_root.glob(".tmp-*") if self.checkpoint_root.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)
        latest = self.latest_checkpoint()
        if latest is None:
            return 0
        done = self.load_checkpoint(latest)
        log.info("resumed from %s (iteration %d done)", latest, done)
        return done

    # ---- one iteration ---------------------------------------------------------------------

    def collect(self, iteration: int) -> tuple[list[Rollout], list[Sample]]:
        """Play the iteration's G x K episodes; return the rollouts and the optimizer's samples."""
        cfg = self.config
        try:
            tasks = self.env.sample_tasks(cfg.groups, offset=cfg.seed_offset + (iteration - 1) * cfg.groups)
        except Exception as exc:
            raise RolloutError(f"sampling tasks failed: {type(exc).__name__}: {exc}", iteration=iteration,
                               task_id=None, checkpoint=self.latest_checkpoint()) from exc
        batch = [task for task in tasks for _ in range(cfg.samples_per_group)]
        self.model.eval()
        rollouts = run_rollouts(self.env, batch, self.backend, self.tokenizer, cfg.rollout_config(iteration))
        rewards = [self._reward(r, iteration) for r in rollouts]
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float64).view(cfg.groups, cfg.samples_per_group),
                               cfg.advantage_eps).view(-1).tolist()
        samples = []
        for rollout, reward, advantage in zip(rollouts, rewards, adv):
            hinted = bool(rollout.messages) and rollout.messages[0].get("content") != self.plain_prompt
            if hinted and cfg.swap_hints:
                rollout = swap_system_prompt(rollout, self.tokenizer, self.tools, self.plain_prompt)
            swapped = hinted and cfg.swap_hints
            samples.append(trim(Sample(
                token_ids=list(rollout.token_ids), loss_mask=list(rollout.env_mask),
                old_logprobs=list(rollout.logprobs), advantage=float(advantage),
                rollout_old=swapped or cfg.steps_per_iteration > 1, swapped=swapped,
                task_id=rollout.task.task_id, hinted=hinted, reward=reward,
                success=bool(rollout.result.success),
            )))
        return rollouts, samples

    def _reward(self, rollout: Rollout, iteration: int) -> float:
        task_id = rollout.task.task_id
        if rollout.error:
            raise RolloutError(f"environment error: {rollout.error}", iteration=iteration, task_id=task_id,
                               checkpoint=self.latest_checkpoint())
        try:
            reward = float(self.reward_fn(rollout) if self.reward_fn else rollout.result.reward)
        except Exception as exc:
            raise RolloutError(f"reward function failed: {type(exc).__name__}: {exc}", iteration=iteration,
                               task_id=task_id, checkpoint=self.latest_checkpoint()) from exc
        if not math.isfinite(reward):
            raise RolloutError(f"non-finite reward {reward}", iteration=iteration, task_id=task_id,
                               checkpoint=self.latest_checkpoint())
        return reward

    def _micro_batch(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        width = max(len(s.token_ids) for s in samples)
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        target = torch.zeros((len(samples), width), dtype=torch.long)
        old, adv, use_old, swapped = [], [], [], []
        for row, s in enumerate(samples):  # right padding: positions match generation's
            n = len(s.token_ids)
            ids[row, :n] = torch.tensor(s.token_ids)
            attention[row, :n] = 1
            target[row, :n] = torch.tensor(s.loss_mask)
            target[row, 0] = 0  # nothing predicts position 0
            picked = [t for t in range(1, n) if s.loss_mask[t]]  # token_logprobs' row-major order
            old += [s.old_logprobs[t] for t in picked]
            adv += [s.advantage] * len(picked)
            use_old += [s.rollout_old] * len(picked)
            swapped += [s.swapped] * len(picked)
        dev = self.device
        return {"input_ids": ids.to(dev), "attention_mask": attention.to(dev), "target_mask": target.to(dev),
                "old": torch.tensor(old, dtype=torch.float32, device=dev),
                "advantages": torch.tensor(adv, dtype=torch.float32, device=dev),
                "use_old": torch.tensor(use_old, dtype=torch.bool, device=dev),
                "swapped": torch.tensor(swapped, dtype=torch.bool, device=dev)}

    def optimize(self, samples: list[Sample], iteration: int) -> dict[str, float]:
        """``steps_per_iteration`` optimizer steps on ``samples``; raises before a non-finite step."""
        cfg = self.config
        n_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
        active = [s for s in samples if s.advantage != 0.0 or cfg.beta > 0]
        active = [s for s in active if any(s.loss_mask[1:])]
        active.sort(key=lambda s: -len(s.token_ids))  # similar lengths together: less padding
        stats = {"loss": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "kl": 0.0, "steps": 0,
                 "trained_sequences": len(active), "loss_tokens": n_tokens,
                 "onpolicy_mean_abs": None, "onpolicy_kl": None}
        if not active or n_tokens == 0:
            return stats  # no signal: an optimizer step would only apply Adam's momentum
        self.model.train()
        losses, clips, kls, norms = [], [], [], []
        for step in range(cfg.steps_per_iteration):
            self.optimizer.zero_grad(set_to_none=True)
            step_loss, clipped, kl_sum, counted = 0.0, 0.0, 0.0, 0
            gap_abs, gap_kl, gap_n = 0.0, 0.0, 0
            for chunk in micro_batches([len(x.token_ids) for x in active], cfg.micro_batch_size, cfg.micro_batch_tokens):
                chunk = [active[i] for i in chunk]
                mb = self._micro_batch(chunk)
                with autocast(self.bf16, self.device.type):
                    lp = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], mb["target_mask"],
                                        temperature=cfg.temperature)
                old = torch.where(mb["use_old"], mb["old"], lp.detach())
                ref = None
                if cfg.beta > 0:
                    with torch.no_grad(), self.model.disable_adapter(), autocast(self.bf16, self.device.type):
                        ref = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], mb["target_mask"],
                                             temperature=cfg.temperature)
                plain = ~mb["swapped"]
                loss = clipped_surrogate_loss(lp, old, mb["advantages"], plain, epsilon=cfg.epsilon,
                                              ref_logprobs=ref, beta=cfg.beta, normalizer=n_tokens)
                if mb["swapped"].any():
                    loss = loss + hint_swap_loss(lp, mb["old"], mb["advantages"], mb["swapped"], cap=cfg.hint_is_cap,
                                                 normalizer=n_tokens)
                if step == 0 and plain.any():  # before any step of this iteration: the sampled policy
                    a, k, n = onpolicy_gap(mb["old"][plain], lp[plain])
                    gap_abs, gap_kl, gap_n = gap_abs + a, gap_kl + k, gap_n + n
                ones = torch.ones_like(lp)
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(f"non-finite loss {loss.item()}", iteration=iteration,
                                             task_id=", ".join(sorted({s.task_id for s in chunk})),
                                             checkpoint=self.latest_checkpoint())
                loss.backward()
                step_loss += loss.item()
                clipped += clip_fraction(lp.detach(), old, mb["advantages"], ones, epsilon=cfg.epsilon).item() * lp.numel()
                if ref is not None:
                    diff = (ref - lp.detach()).float()
                    kl_sum += (torch.exp(diff) - diff - 1).sum().item()
                counted += lp.numel()
            if step == 0 and gap_n:
                stats["onpolicy_mean_abs"], stats["onpolicy_kl"] = gap_abs / gap_n, gap_kl / gap_n
                if cfg.onpolicy_max_abs and stats["onpolicy_mean_abs"] > cfg.onpolicy_max_abs:
                    self.optimizer.zero_grad(set_to_none=True)
                    raise OffPolicyError(
                        f"the sampler's log-probs differ from the trainer's by {stats['onpolicy_mean_abs']:.4f} nats "
                        f"per token on average (bound onpolicy_max_abs = {cfg.onpolicy_max_abs}; KL estimate "
                        f"{stats['onpolicy_kl']:.4f}, {gap_n} tokens): the rollouts were not sampled from the policy "
                        "being trained (stale or missing adapter, another model, temperature or chat template)",
                        iteration=iteration, task_id=None, checkpoint=self.latest_checkpoint())
            limit = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.params, limit).item()
            if not math.isfinite(norm):
                raise NonFiniteLossError(f"non-finite gradient norm {norm}", iteration=iteration, task_id=None,
                                         checkpoint=self.latest_checkpoint())
            self.optimizer.step()
            losses.append(step_loss)
            clips.append(clipped / max(counted, 1))
            kls.append(kl_sum / max(counted, 1))
            norms.append(norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        stats.update(loss=sum(losses) / len(losses), clip_fraction=sum(clips) / len(clips),
                     grad_norm=sum(norms) / len(norms), kl=sum(kls) / len(kls), steps=len(losses))
        return stats

    def step(self) -> IterationMetrics:
        """Run the next iteration (generation, then optimization) and return its metrics."""
        cfg = self.config
        iteration = self.iteration + 1
        start = time.perf_counter()
        _, samples = self.collect(iteration)
        gen_time = time.perf_counter() - start
        opt_start = time.perf_counter()
        stats = self.optimize(samples, iteration)
        opt_time = time.perf_counter() - opt_start
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        grouped = rewards.view(cfg.groups, cfg.samples_per_group)
        metrics = IterationMetrics(
            iteration=iteration, mean_reward=float(rewards.mean()),
            success_rate=sum(s.success for s in samples) / len(samples), reward_std=float(rewards.std(unbiased=False)),
            loss=stats["loss"], clip_fraction=stats["clip_fraction"], grad_norm=stats["grad_norm"],
            kl=stats["kl"], gen_time_s=gen_time, opt_time_s=opt_time, iter_time_s=0.0,
            loss_tokens=int(stats["loss_tokens"]), trained_sequences=int(stats["trained_sequences"]),
            zero_std_groups=int((grouped.std(dim=1, unbiased=False) == 0).sum()),
            hinted=sum(s.hinted for s in samples), optimizer_steps=int(stats["steps"]),
            onpolicy_mean_abs=stats["onpolicy_mean_abs"], onpolicy_kl=stats["onpolicy_kl"],
        )
        self.iteration = iteration
        self.history.append(metrics)
        if iteration % cfg.checkpoint_every == 0 or iteration == cfg.iterations:
            self.save_checkpoint()
        metrics.iter_time_s = time.perf_counter() - start
        self.history[-1] = metrics
        log.info("GRPO %s, clip %.3f, grad %.3f", metrics.line(), metrics.clip_fraction, metrics.grad_norm)
        return metrics

    def train(self, *, resume: bool = True) -> GRPOResult:
        """Train up to ``config.iterations`` (resuming from the newest checkpoint); save the adapter."""
        resumed_from = self.resume() if resume else 0
        while self.iteration < self.config.iterations:
            metrics = self.step()
            if self.progress is not None:
                self.progress(metrics)
        adapter_dir = self.save_adapter(self.output_dir / "adapter")
        result = GRPOResult(adapter_dir=adapter_dir, history=list(self.history), config=self.config,
                            resumed_from=resumed_from, output_dir=self.output_dir)
        _atomic_write_text(self.output_dir / "summary.json", json.dumps(result.summary(), indent=1))
        return result

    def save_adapter(self, folder: Path) -> Path:
        """Save the adapter (PEFT format) to ``folder`` atomically, replacing an older one."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.parent / f".tmp-{folder.name}-{uuid.uuid4().hex[:8]}"
        try:
            self.model.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return swap_in_folder(tmp, folder)


def _default_backend(config: GRPOConfig) -> BackendFactory:
    return lambda model, tokenizer: TransformersBackend(model, tokenizer, batch_size=config.generation_batch_size)


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)
