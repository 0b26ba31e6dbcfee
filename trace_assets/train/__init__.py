"""TRACE Step 3 (Train): one LoRA adapter per capability, trained with GRPO on its SyntheticEnv.

Modules: ``grpo`` (``GRPOConfig``, ``GRPOTrainer``, the advantage/loss math, checkpoints),
``heldout`` (greedy reward of the base vs the adapter on held-out synthetic seeds). The MLflow registry that
stores the adapters is the resource ``resources.mlflow_registry.MlflowRegistry``.
"""

from trace_assets.train.grpo import (
    DEMO,
    PAPER,
    PROFILES,
    TINY,
    GRPOConfig,
    GRPOError,
    GRPOResult,
    GRPOTrainer,
    IterationMetrics,
    NonFiniteLossError,
    RolloutError,
    clip_fraction,
    clipped_surrogate_loss,
    group_advantages,
)

__all__ = [
    "DEMO", "PAPER", "PROFILES", "TINY", "GRPOConfig", "GRPOError", "GRPOResult", "GRPOTrainer",
    "IterationMetrics", "NonFiniteLossError", "RolloutError", "clip_fraction", "clipped_surrogate_loss",
    "group_advantages",
]
