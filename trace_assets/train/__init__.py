"""TRACE Step 3 (Train): one LoRA adapter per capability, trained with GRPO on its SyntheticEnv.

Modules: ``config`` (``GRPOConfig``, torch-free: the settings hold one), ``grpo`` (``GRPOTrainer``,
the advantage/loss math, checkpoints), ``heldout`` (greedy reward of the base vs the adapter on
held-out synthetic seeds, and the promotion gate). The MLflow registry that stores the adapters is
the resource ``resources.mlflow_registry.MlflowRegistry``.

Import from the modules; this package imports nothing, so ``train.config`` loads without torch.
"""
