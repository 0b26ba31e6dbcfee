"""``GRPOConfig``: everything that defines a GRPO run (the trainer is ``train/grpo.py``).

Apart from the trainer so that the settings, whose ``[train] grpo`` section is a ``GRPOConfig``,
load without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from trace_assets.agent.lora_targets import DEFAULT_TARGET_MODULES
from trace_assets.agent.rollout import RolloutConfig, derive_seed


LORA_INIT = "seeded-per-layer-v1"
"""How a fresh adapter is initialized: ``agent.lora.seeded_lora_init`` with ``GRPOConfig.seed``.
Until 2026-12-01 it was PEFT's init from torch's global RNG (not a function of the seed)."""


@dataclass(frozen=True)
class GRPOConfig:
    """Everything that defines a GRPO run. The defaults are the paper's (AdamW lr 1e-5, at most 40
    iterations, G = 4 x K = 8, temperature 1.0, 50 steps); each settings profile holds its own in
    ``[train] grpo`` (``trace_assets.settings.PROFILES``)."""

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
    prefix_micro_batches: bool = True
    """Micro-batch each task's samples together, so that the prompt they share (system, tools, a
    decision-point prefix) runs once per micro-batch (``token_logprobs``' prefix broadcast) and
    counts once against ``micro_batch_tokens``. Off: sort by length alone. The same loss and
    gradient either way, up to float rounding (``tests/test_grpo.py``)."""
    pack_suffixes: bool | str = False
    """Within a micro-batch, run what follows the shared prompt as one packed sequence (each sample
    attending to the prompt and to itself) instead of a batch padded to its longest sample
    (``token_logprobs``' ``pack``): the same loss and gradient up to float rounding, fewer positions
    where a task's samples differ in length, but an attention that grows with the square of the
    samples' summed length rather than with the sum of their squares. True always packs; ``"auto"``
    packs a micro-batch where a multiply-add estimate says it is cheaper (``agent.lora.pack_pays``).
    Off by default: neither paid in a real run. Seed 0 of the guided recipe trained the very same
    samples three times (``benchmarks/learning_curve.py``, float32, checkpointing); its 4 optimizer
    steps took 116 / 103 / 96 / 215 s unpacked, 106 / 100 / 102 / 308 s under ``"auto"`` and
    106 / 103 / 114 / 501 s always packed. Alone on kept samples of the base policy's iteration the
    packed step was 1.34x faster (``benchmarks/grpo_memory.py``), a gain the run did not keep.
    ``micro_batch_tokens`` still counts the padded batch, a bound from above."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward: activation memory falls from ~1.6 GB per 1k
    tokens (SmolLM2-135M, bf16 autocast) to the layers' inputs, for about a third more compute. The
    shared-prefix path keeps working (``token_logprobs``' replay-safe caches); the same loss and
    gradient up to float rounding (``tests/test_grpo.py``)."""
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
    resample_rounds: int = 0
    """Dynamic sampling (DAPO; the official TRACE re-samples constant-reward groups): a group whose
    K rewards all tie has zero advantage and trains nothing, so it is replaced by a group on a fresh
    task, for at most this many rounds per iteration. A round plays K episodes on as many fresh tasks
    as groups still tie (seeds from ``seed_offset + grpo.RESAMPLE_OFFSET``); an informative
    replacement takes the tied group's place in the batch. 0: train the G groups as sampled."""
    warmup_iterations: int = 0
    """Linear learning-rate warmup: iteration ``i`` (1-based) steps at ``learning_rate * min(1, i /
    (warmup_iterations + 1))``, so the first ``warmup_iterations`` iterations step below the full
    rate (:meth:`learning_rate_at`). Adam's first steps move every adapter entry by about the
    learning rate whatever its gradient's size. 0: the full rate from the first step."""
    expert_guidance: bool = False
    """Each group also trains on one demonstration of its task by the environment's scripted expert
    (its ``expert`` target hook, played on the same environment and scored by the same reward),
    normalized with the group's K samples: off-policy guidance (as in LUFFY). Its tokens train at
    ratio 1 (no sampler log-probs), only what the expert wrote after the episode's start, and never
    enter the on-policy guard or the iteration's reward metrics. Where a weak base's tool calls are
    mostly wrong, GRPO alone pays the episodes that make none; the expert's right call in every
    group pays calling the right tool. Off where the environment has no expert."""
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
        if self.resample_rounds < 0 or self.warmup_iterations < 0:
            raise ValueError("resample_rounds and warmup_iterations must be >= 0")
        if not (isinstance(self.pack_suffixes, bool) or self.pack_suffixes == "auto"):
            raise ValueError(f'pack_suffixes must be true, false or "auto", not {self.pack_suffixes!r}')
        if not isinstance(self.expert_guidance, bool):
            raise ValueError(f"expert_guidance must be true or false, not {self.expert_guidance!r}")

    @property
    def group_size(self) -> int:
        """Samples per group in the trained batch: K, and the expert's demonstration with guidance."""
        return self.samples_per_group + int(self.expert_guidance)

    def learning_rate_at(self, iteration: int) -> float:
        """The learning rate of iteration ``iteration`` (1-based): :attr:`warmup_iterations`' ramp."""
        return self.learning_rate * min(1.0, iteration / (self.warmup_iterations + 1))

    def rollout_config(self, iteration: int, resample_round: int = 0) -> RolloutConfig:
        """Sampling of iteration ``iteration`` (1-based); round ``r > 0`` is its ``r``-th re-sampling
        of tied groups (:attr:`resample_rounds`), on a stream of its own."""
        seed = derive_seed(self.seed, 1_000_000 + iteration)
        return RolloutConfig.from_limits(self, temperature=self.temperature, top_p=self.top_p,
                                         seed=derive_seed(seed, resample_round) if resample_round else seed)

    EXECUTION_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"micro_batch_size", "micro_batch_tokens", "prefix_micro_batches", "pack_suffixes", "gradient_checkpointing",
         "generation_batch_size", "checkpoint_every", "keep_checkpoints", "onpolicy_max_abs"})
    """Fields that change how a run executes (memory, batching, checkpoint cadence), not the recipe:
    the loss is the same sum however it is split (up to float rounding), and batching generation
    changes at most which random draws a sample gets, not its distribution. The guard's bound only
    decides whether a run stops, never what it computes."""

    LATER_FIELDS: ClassVar[dict[str, Any]] = {"resample_rounds": 0, "warmup_iterations": 0, "expert_guidance": False}
    """Recipe fields added after adapters were stored, with the value that reproduces those runs:
    at that value a field stays out of the identity, so the stored adapters stay current."""

    def identity(self) -> dict[str, Any]:
        """``to_dict()`` without :attr:`EXECUTION_FIELDS`: what an adapter's ``code_version`` and
        folder key hash, so a memory setting tuned for a smaller machine never retrains anything.
        It names the LoRA initialization scheme too (:data:`LORA_INIT`): adapters initialized
        another way are other adapters. :attr:`LATER_FIELDS` count only where they differ from the
        older runs' behaviour."""
        return {**{k: v for k, v in self.to_dict().items()
                   if k not in self.EXECUTION_FIELDS and not (k in self.LATER_FIELDS and v == self.LATER_FIELDS[k])},
                "lora_init": LORA_INIT}

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

