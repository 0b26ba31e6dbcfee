"""LoRA plumbing shared by the warm-start SFT and GRPO: configs, memory-lean log-probs, merging.

``token_logprobs`` is the one place that turns a batch of conversations into per-token log-probs.
It never materialises full-vocabulary logits for every position: it runs the transformer body,
keeps the hidden states at the positions that matter (assistant tokens), and applies the LM head
only there. With a 49k vocabulary this is the difference between ~2 GB and a few MB per batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from trace_assets.agent.lora_targets import DEFAULT_TARGET_MODULES


def lora_config(r: int = 16, alpha: int = 32, dropout: float = 0.0, target_modules=DEFAULT_TARGET_MODULES) -> LoraConfig:
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout,
        target_modules=list(target_modules), bias="none", task_type="CAUSAL_LM",
    )


def add_lora(model: PreTrainedModel, config: LoraConfig, *, seed: int | None = None) -> PeftModel:
    """Wrap ``model`` with a fresh LoRA adapter; the base weights are frozen.

    ``seed``: the adapter's initial weights come from :func:`seeded_lora_init` (a function of
    ``seed`` and each layer's name only), and torch's global RNG is left as it was. None keeps
    PEFT's own initialization, which draws from torch's global RNG, i.e. from whatever ran before
    in the process.
    """
    if seed is None:
        peft_model = get_peft_model(model, config)
    else:
        with torch.random.fork_rng(devices=[]):  # PEFT's own init draws are discarded: leave the RNG as it was
            peft_model = get_peft_model(model, config)
        seeded_lora_init(peft_model, seed)
    for name, param in peft_model.named_parameters():
        param.requires_grad = "lora_" in name
    return peft_model


def seeded_lora_init(peft_model: PeftModel, seed: int, adapter_name: str = "default") -> int:
    """Re-draw adapter ``adapter_name``'s initial weights as PEFT's default init does (``A`` Kaiming
    uniform with ``a = sqrt(5)``, ``B`` zero, so ``BA = 0``), from one ``torch.Generator`` per layer
    seeded by ``(seed, layer name)``: the same seed gives the same adapter whatever torch's global RNG
    holds and in whatever order layers are visited; the global RNG is left untouched. Returns the
    number of layers initialized (0 means the adapter has no LoRA layer by that name)."""
    import hashlib
    import math

    count = 0
    for module_name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or adapter_name not in lora_a:
            continue
        digest = hashlib.sha256(f"lora-init:{seed}:{module_name}".encode()).digest()
        gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        weight = lora_a[adapter_name].weight
        with torch.no_grad():
            fresh = torch.empty(weight.shape, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)
            weight.copy_(fresh.to(weight.dtype))
            module.lora_B[adapter_name].weight.zero_()
            bias = getattr(module.lora_B[adapter_name], "bias", None)
            if bias is not None:
                bias.zero_()
        count += 1
    return count


def bf16_supported() -> bool:
    """bf16 autocast helps on CPUs with native bf16 (AVX-512 BF16 / AMX) and on CUDA."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast(enabled: bool, device: str = "cpu"):
    return torch.autocast(device_type=device, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def _body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    causal_lm = model.get_base_model() if isinstance(model, PeftModel) else model
    return causal_lm.get_decoder(), causal_lm.get_output_embeddings()


class _RecordingLayer(DynamicLayer):
    """The prefix pass's KV: the first update stores it; any later one is gradient checkpointing's
    replay of that pass, which must see what the first saw (no cached keys) and store nothing."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and self.keys.numel():
            empty = key_states.new_empty(0)
            return torch.cat([empty, key_states], dim=-2), torch.cat([empty, value_states], dim=-2)
        return super().update(key_states, value_states, *args, **kwargs)


class _PrefixView(DynamicLayer):
    """The stored prefix KV broadcast to ``batch`` rows, read only: every update (and its replay)
    returns prefix + new keys and stores nothing."""

    def __init__(self, recorded: DynamicLayer, batch: int) -> None:
        super().__init__()
        self.lazy_initialization(recorded.keys, recorded.values)
        self.keys = recorded.keys.expand(batch, -1, -1, -1)  # broadcast, not copy
        self.values = recorded.values.expand(batch, -1, -1, -1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant, so gradients reach
    the LoRA weights although the frozen embeddings' output needs none). The layers keep the KV
    cache they are given: the only caches passed in training are :func:`token_logprobs`' replay-safe
    ones (transformers otherwise drops a cache under checkpointing, which would break the
    shared-prefix path)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Length of the token prefix that every row shares (and attends to)."""
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)
    return int(same.long().cumprod(dim=0).sum())


SHAPE_BUCKET = 128
"""Sequence lengths in :func:`token_logprobs` are multiples of this. The CPU kernels behind a
forward and backward pass (oneDNN primitives, PyTorch's mkldnn caches) keep an entry per tensor
shape and never give one back, so with every micro-batch a new length a training process grows
even after ``malloc_trim``. Measured (``benchmarks/training_shapes.py``): +113 MB per optimizer
step with exact lengths, +30 MB and levelling off with 128-token buckets, at 1.19x the time. The
demo's lora_adapter step peaked at 7.7 GB instead of 8.5 (both with GRPO's heap trim); its
optimization took ~20-35 % longer, since a short suffix after a long shared prompt gets up to 127
padded positions and up to 127 more moved out of the shared prefix."""


def _pad_to_bucket(input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad the three ``[batch, width]`` tensors to a width that is a multiple of
    :data:`SHAPE_BUCKET`; the padding is masked out of attention and of the targets."""
    extra = -input_ids.shape[1] % SHAPE_BUCKET
    if not extra:
        return input_ids, attention_mask, target_mask
    pad = torch.nn.functional.pad
    return pad(input_ids, (0, extra)), pad(attention_mask, (0, extra)), pad(target_mask, (0, extra))


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    min_shared_prefix: int = 32,
    pack: bool | str = False,
) -> torch.Tensor:
    """Log-probs of ``input_ids[b, t]`` for every position where ``target_mask[b, t]`` is 1.

    Returns a 1-D tensor in row-major order of the selected positions. Position 0 can never be a
    target (nothing predicts it). LoRA layers injected by PEFT are active inside the body.
    Rows are right-padded.

    Widths are padded (right, masked out) to a multiple of :data:`SHAPE_BUCKET`, and a shared
    prefix is cut to one. The values are unchanged up to float rounding; the point is that training
    meets a bounded set of tensor shapes.

    When every row starts with the same ``>= min_shared_prefix`` tokens (the system prompt and
    tool schemas of one environment), the prefix runs once and its keys/values are broadcast to the
    batch. Gradients still flow through it, so values and gradients equal the plain path up to
    float rounding; only the compute shrinks (the prefix is often most of the tokens). Its caches
    are replay-safe, so this holds under :func:`enable_gradient_checkpointing` too.

    ``pack``: after the shared prefix, the rows' suffixes run as one sequence, each attending to the
    prefix and to itself only (a block-diagonal mask, positions continuing the prefix's), instead of
    as a batch padded to the longest row. Where rows differ in length (GRPO's samples of one task
    do) the padding is most of a batch's suffix positions. The same values and gradients up to float
    rounding. It pays only where the suffixes are short beside the prefix: the packed attention
    grows with the square of their summed length. ``"auto"`` packs where :func:`pack_pays` estimates
    it cheaper for this batch (``GRPOConfig.pack_suffixes``).
    """
    body, head = _body_and_head(model)
    input_ids, attention_mask, target_mask = _pad_to_bucket(input_ids, attention_mask, target_mask)
    shared = shared_prefix_len(input_ids, attention_mask) if input_ids.shape[0] > 1 else 0
    prefix = prefix_run(shared, input_ids.shape[1], min_shared_prefix)
    if prefix and packs(pack, (attention_mask.sum(dim=1) - prefix).tolist(), prefix, input_ids.shape[1], body.config):
        hidden = _packed_hidden(body, input_ids, attention_mask, target_mask, prefix)
    else:
        if prefix:
            batch = input_ids.shape[0]
            first, view = _prefix_pass(body, input_ids, attention_mask, prefix, batch)
            positions = torch.arange(prefix, input_ids.shape[1], device=input_ids.device).expand(batch, -1)
            rest = body(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, past_key_values=view,
                        position_ids=positions, use_cache=True).last_hidden_state
            full = torch.cat([first.expand(batch, -1, -1), rest], dim=1)
        else:
            full = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden = full[:, :-1][target_mask[:, 1:].bool()]
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:][target_mask[:, 1:].bool()]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def packed_width(suffixes: Sequence[int]) -> int:
    """Width of :func:`token_logprobs`' packed sequence for rows of ``suffixes`` tokens after the
    shared prefix: their sum rounded up to a :data:`SHAPE_BUCKET` multiple."""
    return max(SHAPE_BUCKET, -(-sum(suffixes) // SHAPE_BUCKET) * SHAPE_BUCKET)


def packs(pack: bool | str, suffixes: Sequence[int], prefix: int, width: int, config: Any) -> bool:
    """Whether :func:`token_logprobs` under ``pack`` (true, false or ``"auto"``) runs the rows of
    ``suffixes`` tokens after a shared ``prefix`` (> 0) as one packed sequence."""
    return pack_pays(suffixes, prefix, width, config) if pack == "auto" else bool(pack)


def pack_pays(suffixes: Sequence[int], prefix: int, width: int, config: Any) -> bool:
    """Whether :func:`token_logprobs`' packed layout is estimated cheaper than the padded batch, for
    rows of ``suffixes`` tokens after a shared ``prefix`` in a batch of (bucketed) ``width``.

    The estimate is multiply-adds per decoder layer of the model ``config`` describes: every position
    pays the projections and the MLP; every (query, key) pair the attention scores and the weighted
    sum. Both layouts attend over a dense rectangle: the padded one ``rows x S x (prefix + S)`` with
    ``S = width - prefix``, the packed one ``N x (prefix + N)`` with ``N`` the :func:`packed_width`.
    For SmolLM2-135M a position costs as much as ~3,070 pairs. Timed forward + backward passes on
    it alone (float32, checkpointing, a 1,024-token prefix, 5 rows) agree: rows of 300-100 tokens ran
    1.31x faster packed (chosen), 1,000-400 1.13x (chosen), 1,500-700 at par (not chosen). Inside a
    training run it chose worse: the 4th optimizer step of a guided run took 308 s instead of 215 on
    the same samples (``GRPOConfig.pack_suffixes``), so it is an estimate, not a measurement."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    per_position = hidden * (2 * heads * head_dim + 2 * kv * head_dim) + 3 * hidden * config.intermediate_size
    per_pair = 2 * heads * head_dim
    rest = width - prefix
    padded = len(suffixes) * rest * (per_position + per_pair * (prefix + rest))
    n = packed_width(suffixes)
    packed = n * (per_position + per_pair * (prefix + n))
    return packed < padded


def _packed_hidden(body: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   target_mask: torch.Tensor, prefix: int) -> torch.Tensor:
    """:func:`token_logprobs`' ``pack`` path: the hidden states that predict the target tokens, in
    its row-major order. The first ``prefix`` tokens, which every row shares, run once; then every
    row's remaining tokens run as one sequence (padded to a :data:`SHAPE_BUCKET` multiple) in which a
    token attends to the prefix and to its own row's earlier tokens only."""
    device = input_ids.device
    rows = input_ids.shape[0]
    sizes = attention_mask.sum(dim=1) - prefix  # right padding: a row's tokens after the prefix
    starts = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    width = packed_width(sizes.tolist())
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), sizes)
    position = prefix + torch.arange(total, device=device) - starts[row_of]
    pad = width - total
    ids = torch.cat([input_ids[row_of, position], input_ids.new_zeros(pad)])
    segment = torch.cat([row_of, row_of.new_full((pad,), -1)])  # -1: padding, which attends to the prefix only
    position = torch.cat([position, position.new_full((pad,), prefix)])
    own = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None]) & (segment[:, None] >= 0)
    mask = torch.cat([own.new_ones((width, prefix)), own], dim=1)[None, None]
    if getattr(body.config, "_attn_implementation", None) == "eager":  # eager adds its mask: 0 or the dtype's min
        mask = torch.zeros(mask.shape, dtype=body.dtype, device=device).masked_fill(~mask, torch.finfo(body.dtype).min)
    first, view = _prefix_pass(body, input_ids, attention_mask, prefix, 1)
    rest = body(input_ids=ids[None], attention_mask=mask, past_key_values=view, position_ids=position[None],
                use_cache=True).last_hidden_state[0]
    row, col = target_mask[:, 1:].bool().nonzero(as_tuple=True)  # col predicts token col + 1, row-major
    index = torch.where(col < prefix, col, prefix + starts[row] + col - prefix)
    return torch.cat([first[0], rest])[index]


def _prefix_pass(body: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int,
                 batch: int) -> tuple[torch.Tensor, Cache]:
    """Row 0's first ``prefix`` tokens through ``body`` once: their hidden states ``[1, prefix, H]``
    and a read-only cache of their keys/values broadcast to ``batch`` rows (replay-safe)."""
    recorded = Cache(layer_class_to_replicate=_RecordingLayer)
    first = body(input_ids=input_ids[:1, :prefix], attention_mask=attention_mask[:1, :prefix],
                 past_key_values=recorded, use_cache=True).last_hidden_state
    return first, Cache(layers=[_PrefixView(layer, batch) for layer in recorded.layers])


def prefix_run(shared: int, width: int, min_shared_prefix: int = 32) -> int:
    """How many leading tokens :func:`token_logprobs` runs once for rows of (bucketed) ``width``
    that share ``shared`` tokens: rounded down to :data:`SHAPE_BUCKET`, at least one token left
    after it; 0 (no shared pass) below ``min_shared_prefix``."""
    prefix = min(shared, width - 1) // SHAPE_BUCKET * SHAPE_BUCKET
    return prefix if prefix >= min_shared_prefix else 0


def merge_and_save(peft_model: PeftModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> Path:
    """Fold the adapter into the base weights (W' = W + BA) and save a plain HF model folder."""
    merged = peft_model.merge_and_unload()
    folder.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def null_adapter(adapter_dir: str | Path, out_dir: str | Path, *, seed: int = 0) -> Path:
    """The null control of a trained adapter: per LoRA layer, random directions with the trained
    delta's norm. For every wrapped weight, ``A'`` and ``B'`` are standard normal draws (seeded by
    ``seed`` and the layer's name) and ``B'`` is rescaled so that ``||B'A'||_F = ||BA||_F`` (same
    scaling, same config). An adapter whose effect on success is no larger than its null's has
    learned nothing that a perturbation of the same size would not do. Written atomically."""
    import hashlib
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from trace_assets.paths import atomic_folder

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    null: dict[str, torch.Tensor] = {}
    for key, a in weights.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                null[key] = a.clone()
            continue
        b_key = key.replace(".lora_A.", ".lora_B.")
        b = weights[b_key]
        digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        a_new = torch.randn(a.shape, generator=gen, dtype=torch.float32)
        b_new = torch.randn(b.shape, generator=gen, dtype=torch.float32)
        target = torch.linalg.matrix_norm(b.float() @ a.float())
        current = torch.linalg.matrix_norm(b_new @ a_new)
        b_new = b_new * (target / current) if current > 0 else torch.zeros_like(b_new)
        null[key], null[b_key] = a_new.to(a.dtype).contiguous(), b_new.to(b.dtype).contiguous()
    with atomic_folder(out_dir) as tmp:
        save_file(null, str(tmp / "adapter_model.safetensors"))
        shutil.copy(adapter_dir / "adapter_config.json", tmp / "adapter_config.json")
        (tmp / "null_control.json").write_text(json.dumps({"null_of": str(adapter_dir), "seed": seed}))
    return out_dir
