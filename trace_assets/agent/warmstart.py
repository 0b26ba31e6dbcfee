"""The demo base agent: a short LoRA SFT of the raw model on scripted expert demonstrations.

The raw 135M SmolLM2 makes no valid tool calls, so TRACE would have nothing to contrast. This
module turns it into a real but imperfect agent, the way DESIGN.md measured:

* demonstrations come from the target's scripted expert (its ``expert`` hook) playing the
  train split's *demo* tasks through a real episode, so every demo reaches reward 1;
* the loss covers assistant tokens only (system, user and tool tokens are context);
* LoRA r16 on all projections, AdamW, bf16 autocast where the CPU supports it; the adapter is then
  merged (W' = W + BA) and the result saved as a plain HF folder, the frozen base of Steps 2-4.

Imperfection comes from the model being small and the warm-start short (36 optimizer steps), and
from ``confirm_rate``: the demo settings let half of the demos skip the confirmation question
before writes (DESIGN's prototype used 25%), so the agent does not reliably respect the policy.
How the settings were chosen (train split only) is in ``settings.WarmStartSettings``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from trace_assets.agent.lora import (
    add_lora,
    autocast,
    bf16_supported,
    enable_gradient_checkpointing,
    lora_config,
    merge_and_save,
    token_logprobs,
)
from trace_assets.envs.base import Environment, Message, Task, target_hook

log = logging.getLogger(__name__)


@dataclass
class WarmStartReport:
    n_demos: int
    n_tokens: int
    n_target_tokens: int
    epochs: int
    steps: int
    train_time_s: float
    bf16: bool
    micro_batch_size: int = 0
    """The micro-batch used (``"auto"`` resolved)."""
    losses: list[float] = field(default_factory=list)
    demo_families: dict[str, int] = field(default_factory=dict)


def auto_micro_batch_size(bf16: bool) -> int:
    """4 demos per pass in bf16 autocast, 2 in fp32, where activations take twice the memory (see
    ``WarmStartSettings.micro_batch_size`` for what each measured)."""
    return 4 if bf16 else 2


def demonstrations(env: Environment, tasks: Sequence[Task], *, confirm_rate: float, seed: int) -> list[list[Message]]:
    """One expert conversation per task; a ``1 - confirm_rate`` share skips confirmations.

    The expert is the environment's own: ``env.demonstrate(task, confirm=...)`` where it has one
    (tau2's gold replay), else its ``expert`` target hook. Every demo is kept. A demo made without
    confirmation that fails the target reward is expected (the reward counts a write only after
    the user confirmed it): it is only counted. A confirmed demo that fails is an expert bug and
    is warned about, one line per task. One summary line gives the counts."""
    expert = getattr(env, "demonstrate", None) or target_hook(env, "expert")
    rng = random.Random(seed)
    demos = []
    unconfirmed = unconfirmed_failed = confirmed_failed = 0
    for task in tasks:
        confirm = rng.random() < confirm_rate
        messages, result = expert(task, confirm=confirm)
        unconfirmed += not confirm
        if not result.success and not confirm:
            unconfirmed_failed += 1
        elif not result.success:
            confirmed_failed += 1
            log.warning("expert demo for %s failed although it asked for confirmation (reward %.2f); kept anyway",
                        task.task_id, result.reward)
        demos.append(messages)
    log.info("expert demos: %d; %d made without confirmation on purpose (confirm_rate %.2f), %d of which fail the "
             "target reward as expected; %d failed although confirmed", len(demos), unconfirmed, confirm_rate,
             unconfirmed_failed, confirmed_failed)
    return demos


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict],
                    start: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of what the assistant wrote in
    ``messages[start:]`` (earlier ones, e.g. a decision point's expert prefix, are context).

    Each span starts after ``<|im_start|>assistant\\n`` and ends after ``<|im_end|>``, so the
    model also learns when to stop.
    """
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)
    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < start:
            continue
        begin = len(render(messages[:i], True))
        end = len(render(messages[: i + 1], False).rstrip("\n"))
        spans.append((begin, end))
    return text, spans


def tokenize_demo(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict], max_length: int,
                  start: int = 0) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 target mask (1 on what the assistant wrote in ``messages[start:]``),
    truncated to ``max_length``."""
    text, spans = assistant_spans(tokenizer, messages, tools, start)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    return enc["input_ids"][:max_length], mask[:max_length]


def accumulate_batch_gradients(
    peft_model: torch.nn.Module, batch: Sequence[tuple[list[int], list[int]]], *, pad: int, micro_batch_size: int,
    use_bf16: bool,
) -> float:
    """Backpropagate one optimizer batch's loss; return that loss (the caller steps the optimizer).

    The loss is the mean negative log-likelihood over the batch's assistant tokens (``mask`` 1),
    computed on the selected positions only (``token_logprobs`` applies the LM head there, never
    to the full vocabulary at every position). Micro-batches bound the activation memory: each
    one's summed loss is divided by the whole batch's target count, so the accumulated gradient
    is the one a single pass would give, up to float rounding, with or without gradient
    checkpointing (:func:`~trace_assets.agent.lora.enable_gradient_checkpointing`).
    """
    n_targets = sum(sum(m) for _, m in batch)
    total_loss = 0.0
    for m in range(0, len(batch), micro_batch_size):
        micro = batch[m : m + micro_batch_size]
        width = max(len(ids) for ids, _ in micro)
        ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in micro])
        att = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in micro])
        tgt = torch.tensor([mk + [0] * (width - len(mk)) for _, mk in micro])
        with autocast(use_bf16):
            loss = -token_logprobs(peft_model, ids, att, tgt).sum() / n_targets
        loss.backward()
        total_loss += float(loss.detach())
    return total_loss


def train_warmstart(
    model_source: str,
    env: Environment,
    tasks: Sequence[Task],
    out_dir: Path,
    *,
    epochs: int = 2,
    lr: float = 2e-4,
    lora_r: int = 16,
    lora_alpha: int = 32,
    batch_size: int = 8,
    micro_batch_size: int | str = 4,
    confirm_rate: float = 1.0,
    max_length: int = 1536,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
) -> WarmStartReport:
    """SFT ``model_source`` on expert demos of ``tasks``; save the merged agent to ``out_dir``.

    ``micro_batch_size="auto"`` is :func:`auto_micro_batch_size` of the dtype training runs in."""
    from trace_assets.agent.model import load_model

    torch.manual_seed(seed)
    model, tokenizer = load_model(model_source)
    tools = env.tool_schemas()
    demos = demonstrations(env, tasks, confirm_rate=confirm_rate, seed=seed)
    examples = [tokenize_demo(tokenizer, demo, tools, max_length) for demo in demos]
    peft_model = add_lora(model, lora_config(r=lora_r, alpha=lora_alpha))
    if gradient_checkpointing:
        enable_gradient_checkpointing(peft_model)
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    use_bf16 = bf16_supported()
    if micro_batch_size == "auto":
        micro_batch_size = auto_micro_batch_size(use_bf16)
    pad = tokenizer.pad_token_id
    rng = random.Random(seed)
    steps_per_epoch = (len(examples) + batch_size - 1) // batch_size
    total = steps_per_epoch * epochs
    report = WarmStartReport(
        n_demos=len(examples), n_tokens=sum(len(ids) for ids, _ in examples),
        n_target_tokens=sum(sum(m) for _, m in examples), epochs=epochs, steps=total,
        train_time_s=0.0, bf16=use_bf16, micro_batch_size=micro_batch_size,
        demo_families={f: sum(t.family == f for t in tasks) for f in sorted({t.family for t in tasks})},
    )
    start = time.perf_counter()
    step = 0
    for _ in range(epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for b in range(0, len(order), batch_size):
            batch = [examples[i] for i in order[b : b + batch_size]]
            optimizer.zero_grad(set_to_none=True)
            total_loss = accumulate_batch_gradients(peft_model, batch, pad=pad, micro_batch_size=micro_batch_size,
                                                    use_bf16=use_bf16)
            torch.nn.utils.clip_grad_norm_(peft_model.parameters(), 1.0)
            optimizer.step()
            step += 1
            report.losses.append(round(total_loss, 4))
            if progress:
                progress(step, total, total_loss)
    report.train_time_s = round(time.perf_counter() - start, 1)
    peft_model.eval()
    merge_and_save(peft_model, tokenizer, out_dir)
    return report


def cached_agents(root: Path, source: str) -> list[Path]:
    """Warm-started agents of ``source`` (``"demo"``, a model id or folder) cached under ``root``
    (the ``base_agent`` asset's ``<models>/base_agent/<key>`` folders), newest first; only folders
    whose weights still match their manifest's checksum."""
    import json

    from trace_assets.paths import folder_checksum

    found = []
    for manifest in root.glob("*/trace_manifest.json") if root.is_dir() else []:
        try:
            value = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if value.get("source") == source and value.get("checksum") == folder_checksum(manifest.parent):
            found.append(manifest.parent)
    return sorted(found, key=lambda folder: (folder / "trace_manifest.json").stat().st_mtime, reverse=True)


def report_dict(report: WarmStartReport) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(report)
