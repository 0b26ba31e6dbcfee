"""The projections a LoRA adapter wraps by default (the names of the Llama / Qwen / SmolLM2 family).

A module of its own, apart from ``agent/lora.py`` (torch, peft), so that a config naming it
(``train.config.GRPOConfig``, read by the settings) loads without importing torch.
"""

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
