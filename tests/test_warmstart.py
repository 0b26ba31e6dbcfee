"""The warm-start's memory levers change neither its loss nor its gradients.

Reference: the textbook computation, a full forward with HF's own causal-LM loss (full-vocabulary
logits at every position, labels -100 outside assistant tokens, mean over the batch's assistant
tokens). ``accumulate_batch_gradients`` must match it with micro-batches of 3 (the shared-prefix KV
path), of 1, and of 1 or 2 under gradient checkpointing. Tolerance: fp32, 1e-5 relative on the
loss, 1e-4 relative (of the largest entry) on every LoRA gradient.
"""

from __future__ import annotations

from itertools import groupby

import pytest
import torch

from trace_assets.agent.lora import add_lora, enable_gradient_checkpointing, lora_config
from trace_assets.agent.model import load_model
from trace_assets.agent.warmstart import accumulate_batch_gradients, demonstrations, tokenize_demo
from trace_assets.envs import get_environment
from trace_assets.envs.splits import make_splits


@pytest.fixture(scope="module")
def setup(tiny_model_path):
    env = get_environment("retail")
    tasks = make_splits(env, demo_per_family=1, train_per_family=0, test_per_family=0, seed=0)["demo"][:3]
    model, tokenizer = load_model(str(tiny_model_path))
    torch.manual_seed(0)
    peft_model = add_lora(model, lora_config(r=4, alpha=8))
    with torch.no_grad():  # a trained-looking adapter: B = 0 would make every gradient of A vanish
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    demos = demonstrations(env, tasks, confirm_rate=0.5, seed=0)
    batch = [tokenize_demo(tokenizer, d, env.tool_schemas(), 1400) for d in demos]  # short: seconds, not minutes
    return peft_model, batch, tokenizer.pad_token_id


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _reference(model, batch, pad):
    model.zero_grad(set_to_none=True)
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch])
    att = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch])
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
    loss.backward()
    return float(loss.detach()), _grads(model)


@pytest.mark.parametrize("micro,checkpointed", [(3, False), (1, False), (1, True), (2, True)])
def test_loss_and_gradients_match_the_full_logits_reference(setup, micro, checkpointed):
    model, batch, pad = setup
    assert len({tuple(ids[:64]) for ids, _ in batch}) == 1  # a shared prefix: micro 3 takes the KV path
    model.train()
    ref_loss, ref_grads = _reference(model, batch, pad)
    if checkpointed:  # micro 2: the shared-prefix KV path under checkpointing's replays
        enable_gradient_checkpointing(model)
    try:
        model.zero_grad(set_to_none=True)
        loss = accumulate_batch_gradients(model, batch, pad=pad, micro_batch_size=micro, use_bf16=False)
        grads = _grads(model)
    finally:
        model.gradient_checkpointing_disable()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max())
        assert scale > 0, name
        assert float((grads[name] - ref).abs().max()) <= 1e-4 * scale, name


def _summary(caplog) -> str:
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("expert demos:")]
    return line


def test_unconfirmed_demos_that_fail_are_counted_not_warned(caplog):
    """Demos made without confirmation on purpose fail the target reward (a write counts only
    after a confirmation): one summary line counts them, and no warning is raised for them."""
    import logging

    env = get_environment("retail")
    tasks = make_splits(env, demo_per_family=1, train_per_family=0, test_per_family=0, seed=0)["demo"]
    with caplog.at_level(logging.INFO, logger="trace_assets.agent.warmstart"):
        demonstrations(env, tasks, confirm_rate=0.0, seed=0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    line = _summary(caplog)
    assert f"expert demos: {len(tasks)}; {len(tasks)} made without confirmation" in line
    assert "; 0 failed although confirmed" in line
    failing = int(line.split("), ")[1].split(" of which")[0])
    assert 0 < failing <= len(tasks)  # write families fail unconfirmed; read-only ones do not

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trace_assets.agent.warmstart"):
        demonstrations(env, tasks, confirm_rate=1.0, seed=0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the confirmed expert succeeds
    assert "; 0 made without confirmation" in _summary(caplog)


def test_a_confirmed_demo_that_fails_is_warned(caplog):
    import logging

    from trace_assets.envs.base import EpisodeResult

    env = get_environment("retail")
    tasks = make_splits(env, demo_per_family=1, train_per_family=0, test_per_family=0, seed=0)["demo"][:2]

    class Broken:
        def demonstrate(self, task, confirm):
            return [], EpisodeResult(reward=0.0, success=False, info={})

    with caplog.at_level(logging.INFO, logger="trace_assets.agent.warmstart"):
        demos = demonstrations(Broken(), tasks, confirm_rate=1.0, seed=0)
    assert len(demos) == 2  # kept anyway
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("failed although it asked for confirmation" in w for w in warnings)
    assert "; 2 failed although confirmed" in _summary(caplog)


def test_auto_micro_batch_follows_the_training_dtype_and_bad_values_name_the_setting(tmp_path):
    from trace_assets.agent.warmstart import auto_micro_batch_size
    from trace_assets.settings import load_settings

    assert (auto_micro_batch_size(True), auto_micro_batch_size(False)) == (4, 2)
    assert load_settings("demo").warmstart.micro_batch_size == "auto"
    config = tmp_path / "trace.toml"
    config.write_text("[warmstart]\nmicro_batch_size = 1\n")
    assert load_settings("demo", config).warmstart.micro_batch_size == 1
    for bad in ("0", '"big"', "true"):
        config.write_text(f"[warmstart]\nmicro_batch_size = {bad}\n")
        with pytest.raises(ValueError, match="warmstart.micro_batch_size must be"):
            load_settings("demo", config)


@pytest.mark.parametrize("start", [0, 2, 3])
def test_the_mask_covers_every_assistant_message_from_start_and_nothing_else(tiny_model_path, start):
    """Each assistant message at index >= ``start`` is a target, whole, up to its end-of-turn;
    earlier ones, and everything the user, tools and system wrote, are context."""
    from trace_assets.agent.model import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(str(tiny_model_path)))
    env = get_environment("retail")
    task = make_splits(env, demo_per_family=1, train_per_family=0, test_per_family=0, seed=0)["demo"][0]
    [messages] = demonstrations(env, [task], confirm_rate=1.0, seed=0)
    wanted = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= start]
    assert len(wanted) >= 3  # a multi-turn demo, or the test proves nothing

    ids, mask = tokenize_demo(tokenizer, messages, env.tool_schemas(), 100_000, start=start)
    runs = [[tok for tok, _ in run] for target, run in groupby(zip(ids, mask), key=lambda x: x[1]) if target]
    assert len(runs) == len(wanted)
    for run, i in zip(runs, wanted):
        text = tokenizer.decode(run)
        assert text.endswith("<|im_end|>"), text
        assert not text.startswith("<|im_start|>"), text
        if messages[i].get("content"):
            assert messages[i]["content"].strip() in text
