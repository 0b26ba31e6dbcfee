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
  results and simulated-user turns do not. Nor do the turns after the episode closed the loss
  (``Rollout.loss_end``: an environment whose reward judges one decision, ``end.train_through``).
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
  denominator, so the step is identical to computing them). With ``config.resample_rounds`` such a
  group is replaced by a group on a fresh task (DAPO's dynamic sampling), so that more of the
  iteration's optimizer work carries signal; the replaced group leaves the batch.
* Expert guidance (``config.expert_guidance``, off by default): each group gains one sample, the
  environment's scripted expert playing the same task (plain prompt, ``expert`` target hook, played
  through the same environment), scored by the same reward; the advantage is normalized over the
  K + 1 rewards. Its tokens (what the expert wrote after the episode's start; the rendering of
  ``agent.warmstart.tokenize_demo``) were not sampled, so they train at ratio 1 (``old = current``,
  no clip) and stay out of the on-policy guard and of the iteration's reward and success metrics.
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
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from trace_assets.agent.backends import TransformersBackend
from trace_assets.agent.chat import render
from trace_assets.agent.lora import (
    add_lora,
    autocast,
    bf16_supported,
    enable_gradient_checkpointing,
    lora_config,
    token_logprobs,
)
from trace_assets.agent.model import release_memory
from trace_assets.agent.rollout import Rollout, run_rollouts
from trace_assets.envs.base import Environment, Task, target_hook
from trace_assets.paths import atomic_folder, atomic_write
from trace_assets.train.config import LORA_INIT, GRPOConfig

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
RESAMPLE_OFFSET = 200_000
"""Fresh tasks for tied groups (``GRPOConfig.resample_rounds``) are env seeds from ``seed_offset +
RESAMPLE_OFFSET``, G per (iteration, round): apart from the iterations' own seeds (from
``seed_offset``) and below the router's (``synthesize.validate.CALIBRATION_OFFSET`` lays the range out)."""


# ---------------------------------------------------------------- the math (pure functions)


def micro_batches(lengths: Sequence[int], max_sequences: int, max_tokens: int,
                  shared: Sequence[int] | None = None) -> list[list[int]]:
    """Consecutive index chunks of ``lengths`` with at most ``max_sequences`` sequences and at most
    ``max_tokens`` tokens of activations each; a sequence longer than ``max_tokens`` forms a chunk of
    its own. Order is kept (put similar sequences together first).

    A chunk's cost is its padded tokens, ``len(chunk) * longest``, minus what a shared prefix saves:
    ``shared[i]`` is how many leading tokens sequence ``i`` shares with sequence ``i - 1``, and the
    prefix every row of a chunk shares runs once (``token_logprobs`` broadcasts it), so a chunk costs
    ``p + len(chunk) * (longest - p)`` with ``p`` the smallest ``shared`` inside it."""
    chunks: list[list[int]] = []
    current: list[int] = []
    widest, prefix = 0, 0
    for i, n in enumerate(lengths):
        if current:
            p = min(prefix, shared[i]) if shared is not None else 0
            w = max(widest, n)
            if len(current) >= max_sequences or p + (len(current) + 1) * (w - p) > max_tokens:
                chunks.append(current)
                current = []
        if not current:
            current, widest, prefix = [i], n, n
            continue
        current.append(i)
        widest, prefix = max(widest, n), min(prefix, shared[i]) if shared is not None else 0
    if current:
        chunks.append(current)
    return chunks


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_order(samples: Sequence["Sample"]) -> list[int]:
    """Indices of ``samples`` with each task's samples together (they share the task's prompt:
    system, tools and, in a decision-point environment, the expert's prefix), longest tasks first
    and, within a task, longest first: micro-batches then share long prefixes and pad little."""
    longest: dict[str, int] = {}
    for s in samples:
        longest[s.task_id] = max(longest.get(s.task_id, 0), len(s.token_ids))
    return sorted(range(len(samples)), key=lambda i: (-longest[samples[i].task_id], samples[i].task_id,
                                                      -len(samples[i].token_ids)))


def training_plan(samples: Sequence["Sample"], config: GRPOConfig) -> tuple[list["Sample"], list[list[int]]]:
    """What one optimizer step on ``samples`` runs: the samples that carry a gradient (kept, with a
    non-zero advantage or ``beta > 0``, and a trained token), in micro-batch order, and its
    micro-batches as index chunks into that list (:func:`micro_batches` under ``config``'s limits)."""
    active = [s for s in samples if s.kept and (s.advantage != 0.0 or config.beta > 0) and any(s.loss_mask[1:])]
    if config.prefix_micro_batches:  # a task's samples together: their shared prompt runs once
        active = [active[i] for i in prefix_order(active)]
        shared = [0] + [common_prefix_len(a.token_ids, b.token_ids) for a, b in zip(active, active[1:])]
    else:
        active.sort(key=lambda s: -len(s.token_ids))  # similar lengths together: less padding
        shared = None
    return active, micro_batches([len(s.token_ids) for s in active], config.micro_batch_size,
                                 config.micro_batch_tokens, shared)


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
    """1 on the generated tokens that enter the loss (:func:`loss_mask`)."""
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
    kept: bool = True
    """In the batch the optimizer trains; False: a tied group that a re-sampled one replaced."""
    demo: bool = False
    """The expert's demonstration (``GRPOConfig.expert_guidance``), not a sample of the policy."""


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
        loss_end=None if rollout.loss_end is None else rollout.loss_end - rollout.prompt_len + len(plain),
    )


def loss_mask(rollout: Rollout) -> list[int]:
    """1 on the generated tokens that enter the loss: ``env_mask``, cut at ``loss_end``."""
    end = len(rollout.env_mask) if rollout.loss_end is None else rollout.loss_end
    return list(rollout.env_mask[:end]) + [0] * (len(rollout.env_mask) - end)


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
    resampled_groups: int = 0
    """Groups played to replace tied ones (``GRPOConfig.resample_rounds``); the reward and success
    above are of the iteration's own G x K draw."""
    informative_groups: int | None = None
    """Groups of the trained batch whose rewards do not all tie (None: not recorded)."""
    demo_reward: float | None = None
    """Mean reward of the expert's demonstrations in the trained batch (None: no guidance)."""
    sequence_tokens: int | None = None
    """Tokens of the trained sequences, each with its prompt (a prompt that a micro-batch runs once
    is counted for every sequence sharing it): what the optimizer step's cost follows, where
    ``loss_tokens`` counts only the generated ones (None: not recorded)."""
    micro_batches: int | None = None
    """Forward/backward passes per optimizer step (None: not recorded)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One progress line, as the assets log it."""
        return (f"iteration {self.iteration}: reward {self.mean_reward:.3f}, success {self.success_rate:.2f}, "
                f"loss {self.loss:.4f}, trained {self.trained_sequences} seqs / {self.loss_tokens} tokens"
                + (f" ({self.sequence_tokens} in context, {self.micro_batches} micro-batches), "
                   if self.sequence_tokens is not None else ", ")
                + f"on-policy |d| {_fmt(self.onpolicy_mean_abs)} KL {_fmt(self.onpolicy_kl)}, "
                + (f"KL to the base {self.kl:.4f}, " if self.kl else "")  # measured only with beta > 0
                + (f"expert's reward {self.demo_reward:.2f}, " if self.demo_reward is not None else "")
                + (f"{self.resampled_groups} group{'s' * (self.resampled_groups != 1)} re-sampled, "
                   if self.resampled_groups else "")
                + f"gen {self.gen_time_s:.0f}s, opt {self.opt_time_s:.0f}s")


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

    @property
    def rollouts_played(self) -> int:
        """Episodes sampled over the history: G x K per iteration, plus the re-sampled groups."""
        return sum(self.config.groups + m.resampled_groups for m in self.history) * self.config.samples_per_group

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
    ``reward_fn`` overrides ``rollout.result.reward`` (reward shaping), for the expert's
    demonstrations too; ``backend_factory(model, tokenizer)`` overrides the generation backend
    (default: :class:`TransformersBackend`).
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
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
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
        self.expert = _expert(env) if config.expert_guidance else None

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
        with atomic_folder(final) as tmp:  # a re-run of the same iteration swaps it in
            self.model.save_pretrained(tmp / "adapter")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
            state = {"format": CHECKPOINT_FORMAT, "iteration": self.iteration, "config": self.config.to_dict(),
                     "history": [m.to_dict() for m in self.history]}
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
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
        # Every hidden entry is one: a temporary folder (``paths.atomic_folder``) or a swapped-out one.
        for stale in self.checkpoint_root.glob(".*") if self.checkpoint_root.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)
        latest = self.latest_checkpoint()
        if latest is None:
            return 0
        done = self.load_checkpoint(latest)
        log.info("resumed from %s (iteration %d done)", latest, done)
        return done

    # ---- one iteration ---------------------------------------------------------------------

    def collect(self, iteration: int) -> tuple[list[Rollout], list[Sample]]:
        """Play the iteration's G x K episodes, then re-sample its tied groups (``resample_rounds``).

        Returns every rollout played and its sample, in play order: the first G x K are the
        iteration's own draw (its reward and success metrics); ``Sample.kept`` marks the G groups
        the optimizer trains (a tied group stays where no replacement was informative)."""
        cfg = self.config
        k = cfg.group_size
        rollouts, samples = self._play(iteration, cfg.groups, cfg.seed_offset + (iteration - 1) * cfg.groups, 0)
        slots = [list(range(g * k, (g + 1) * k)) for g in range(cfg.groups)]  # sample indices per trained group

        def tied(indices: list[int]) -> bool:
            return len({samples[i].reward for i in indices}) == 1

        for round_index in range(1, cfg.resample_rounds + 1):
            waiting = [g for g, slot in enumerate(slots) if tied(slot)]
            if not waiting:
                break
            offset = cfg.seed_offset + RESAMPLE_OFFSET + ((iteration - 1) * cfg.resample_rounds + round_index - 1) * cfg.groups
            start = len(samples)
            more_rollouts, more = self._play(iteration, len(waiting), offset, round_index)
            rollouts, samples = rollouts + more_rollouts, samples + more
            for j, g in enumerate(waiting):
                fresh = list(range(start + j * k, start + (j + 1) * k))
                if not tied(fresh):
                    slots[g] = fresh
        kept = {i for slot in slots for i in slot}
        return rollouts, [replace(s, kept=i in kept) for i, s in enumerate(samples)]

    def _play(self, iteration: int, groups: int, offset: int, resample_round: int) -> tuple[list[Rollout], list[Sample]]:
        """K episodes on each of ``groups`` tasks from env seed ``offset``, with their samples."""
        cfg = self.config
        try:
            tasks = self.env.sample_tasks(groups, offset=offset)
        except Exception as exc:
            raise RolloutError(f"sampling tasks failed: {type(exc).__name__}: {exc}", iteration=iteration,
                               task_id=None, checkpoint=self.latest_checkpoint()) from exc
        batch = [task for task in tasks for _ in range(cfg.samples_per_group)]
        self.model.eval()
        rollouts = run_rollouts(self.env, batch, self.backend, self.tokenizer, cfg.rollout_config(iteration, resample_round))
        rewards = [self._reward(r, iteration) for r in rollouts]
        demos = [self._demonstration(task, iteration) for task in tasks] if self.expert is not None else []
        table = torch.tensor(rewards, dtype=torch.float64).view(groups, cfg.samples_per_group)
        if demos:
            table = torch.cat([table, torch.tensor([[d.reward] for d in demos], dtype=torch.float64)], dim=1)
        adv = group_advantages(table, cfg.advantage_eps)
        samples = []
        for index, (rollout, reward) in enumerate(zip(rollouts, rewards)):
            group, member = divmod(index, cfg.samples_per_group)
            advantage = float(adv[group, member])
            hinted = bool(rollout.messages) and rollout.messages[0].get("content") != self.plain_prompt
            if hinted and cfg.swap_hints:
                rollout = swap_system_prompt(rollout, self.tokenizer, self.tools, self.plain_prompt)
            swapped = hinted and cfg.swap_hints
            samples.append(trim(Sample(
                token_ids=list(rollout.token_ids), loss_mask=loss_mask(rollout),
                old_logprobs=list(rollout.logprobs), advantage=float(advantage),
                rollout_old=swapped or cfg.steps_per_iteration > 1, swapped=swapped,
                task_id=rollout.task.task_id, hinted=hinted, reward=reward,
                success=bool(rollout.result.success),
            )))
            if demos and member == cfg.samples_per_group - 1:
                samples.append(replace(demos[group], advantage=float(adv[group, -1])))
        return rollouts, samples

    def _demonstration(self, task: Task, iteration: int) -> Sample:
        """The expert's play of ``task`` (plain prompt) as a sample, rewarded as the group's samples are
        (``reward_fn`` where one is given, else the environment's reward); its advantage is set by the caller."""
        from trace_assets.agent.warmstart import tokenize_demo
        from trace_assets.synthesize.env import without_hint

        task = without_hint(task)
        try:
            opening = len(self.env.start(task).initial_messages())  # system, user, any expert prefix: context
            messages, result = self.expert(task)
        except Exception as exc:
            raise RolloutError(f"the expert's demonstration failed: {type(exc).__name__}: {exc}", iteration=iteration,
                               task_id=task.task_id, checkpoint=self.latest_checkpoint()) from exc
        ids, mask = tokenize_demo(self.tokenizer, messages, self.tools, self.config.max_context_tokens, start=opening)
        reward = self._reward(Rollout(task=task, messages=messages, token_ids=ids, env_mask=mask,
                                      prompt_len=mask.index(1) if 1 in mask else len(ids), result=result), iteration)
        return trim(Sample(token_ids=ids, loss_mask=mask, old_logprobs=[0.0] * len(ids), advantage=0.0,
                           rollout_old=False, task_id=task.task_id, reward=reward,
                           success=bool(result.success), demo=True))

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
        old, adv, use_old, swapped, demo = [], [], [], [], []
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
            demo += [s.demo] * len(picked)
        dev = self.device
        return {"input_ids": ids.to(dev), "attention_mask": attention.to(dev), "target_mask": target.to(dev),
                "old": torch.tensor(old, dtype=torch.float32, device=dev),
                "advantages": torch.tensor(adv, dtype=torch.float32, device=dev),
                "use_old": torch.tensor(use_old, dtype=torch.bool, device=dev),
                "swapped": torch.tensor(swapped, dtype=torch.bool, device=dev),
                "demo": torch.tensor(demo, dtype=torch.bool, device=dev)}

    def optimize(self, samples: list[Sample], iteration: int) -> dict[str, float]:
        """``steps_per_iteration`` optimizer steps on ``samples``; raises before a non-finite step."""
        cfg = self.config
        samples = [s for s in samples if s.kept]
        n_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
        active, chunks = training_plan(samples, cfg)
        stats = {"loss": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "kl": 0.0, "steps": 0,
                 "trained_sequences": len(active), "loss_tokens": n_tokens,
                 "sequence_tokens": sum(len(s.token_ids) for s in active), "micro_batches": len(chunks),
                 "onpolicy_mean_abs": None, "onpolicy_kl": None}
        if not active or n_tokens == 0:
            return stats  # no signal: an optimizer step would only apply Adam's momentum
        self.model.train()
        for group in self.optimizer.param_groups:  # from the iteration alone: a resumed run steps alike
            group["lr"] = cfg.learning_rate_at(iteration)
        losses, clips, kls, norms = [], [], [], []
        for step in range(cfg.steps_per_iteration):
            self.optimizer.zero_grad(set_to_none=True)
            step_loss, clipped, kl_sum, counted = 0.0, 0.0, 0.0, 0
            gap_abs, gap_kl, gap_n = 0.0, 0.0, 0
            for chunk in chunks:
                chunk = [active[i] for i in chunk]
                mb = self._micro_batch(chunk)
                with autocast(self.bf16, self.device.type):
                    lp = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], mb["target_mask"],
                                        temperature=cfg.temperature, pack=cfg.pack_suffixes)
                old = torch.where(mb["use_old"], mb["old"], lp.detach())
                ref = None
                if cfg.beta > 0:
                    with torch.no_grad(), self.model.disable_adapter(), autocast(self.bf16, self.device.type):
                        ref = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], mb["target_mask"],
                                             temperature=cfg.temperature, pack=cfg.pack_suffixes)
                plain = ~mb["swapped"]
                loss = clipped_surrogate_loss(lp, old, mb["advantages"], plain, epsilon=cfg.epsilon,
                                              ref_logprobs=ref, beta=cfg.beta, normalizer=n_tokens)
                if mb["swapped"].any():
                    loss = loss + hint_swap_loss(lp, mb["old"], mb["advantages"], mb["swapped"], cap=cfg.hint_is_cap,
                                                 normalizer=n_tokens)
                sampled = plain & ~mb["demo"]  # the expert's tokens were never sampled
                if step == 0 and sampled.any():  # before any step of this iteration: the sampled policy
                    a, k, n = onpolicy_gap(mb["old"][sampled], lp[sampled])
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
        release_memory()  # the freed activations' pages go back before the next generation
        opt_time = time.perf_counter() - opt_start
        drawn = [s for s in samples[: cfg.groups * cfg.group_size] if not s.demo]  # its own draw: unbiased metrics
        rewards = torch.tensor([s.reward for s in drawn], dtype=torch.float64)
        grouped = rewards.view(cfg.groups, cfg.samples_per_group)
        trained = torch.tensor([s.reward for s in samples if s.kept], dtype=torch.float64).view(cfg.groups, -1)
        metrics = IterationMetrics(
            iteration=iteration, mean_reward=float(rewards.mean()),
            success_rate=sum(s.success for s in drawn) / len(drawn), reward_std=float(rewards.std(unbiased=False)),
            loss=stats["loss"], clip_fraction=stats["clip_fraction"], grad_norm=stats["grad_norm"],
            kl=stats["kl"], gen_time_s=gen_time, opt_time_s=opt_time, iter_time_s=0.0,
            loss_tokens=int(stats["loss_tokens"]), trained_sequences=int(stats["trained_sequences"]),
            zero_std_groups=int((grouped.std(dim=1, unbiased=False) == 0).sum()),
            hinted=sum(s.hinted for s in drawn), optimizer_steps=int(stats["steps"]),
            onpolicy_mean_abs=stats["onpolicy_mean_abs"], onpolicy_kl=stats["onpolicy_kl"],
            resampled_groups=(len(samples) - cfg.groups * cfg.group_size) // cfg.group_size,
            informative_groups=int((trained.std(dim=1, unbiased=False) > 0).sum()),
            demo_reward=(sum(d) / len(d) if (d := [s.reward for s in samples if s.kept and s.demo]) else None),
            sequence_tokens=int(stats["sequence_tokens"]), micro_batches=int(stats["micro_batches"]),
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
        atomic_write(self.output_dir / "summary.json", json.dumps(result.summary(), indent=1))
        return result

    def save_adapter(self, folder: Path) -> Path:
        """Save the adapter (PEFT format) to ``folder`` atomically, replacing an older one."""
        with atomic_folder(folder) as tmp:
            self.model.save_pretrained(tmp)
        return folder


def _expert(env: Environment) -> Callable[[Task], tuple[list[dict[str, Any]], Any]]:
    """``task -> (messages, result)``: the scripted expert of ``env``'s target (a synthetic
    environment's, or the environment's own) played through ``env``."""
    target = getattr(env, "target", env)
    hook = target_hook(target, "expert")
    return lambda task: hook(task, via=env)


def _default_backend(config: GRPOConfig) -> BackendFactory:
    return lambda model, tokenizer: TransformersBackend(model, tokenizer, batch_size=config.generation_batch_size)

