"""GRPO: the math against hand-computed numbers, masking, real iterations with the tiny model,
resume after a crash, the NaN stop, error reporting and the hint swap."""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import replace

import pytest
import torch

from trace_assets.agent.backends import Generation
from trace_assets.agent.chat import render
from trace_assets.agent.model import load_model
from trace_assets.envs import get_environment
from trace_assets.synthesize import SyntheticEnv, template_spec
from trace_assets.synthesize.env import without_hint
from trace_assets.train import grpo
from trace_assets.settings import DEMO_GRPO
from trace_assets.settings import TINY as TINY_SETTINGS
from trace_assets.train.grpo import (
    GRPOConfig,
    GRPOTrainer,
    NonFiniteLossError,
    OffPolicyError,
    RolloutError,
    clip_fraction,
    clipped_surrogate_loss,
    group_advantages,
    hint_swap_loss,
)

TARGET = get_environment("retail")
TINY = TINY_SETTINGS.train.grpo


# ---------------------------------------------------------------- math


def test_group_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 3.0, 0.0]])
    adv = group_advantages(rewards, eps=0.0)
    assert adv[0].tolist() == [1.0, -1.0, -1.0, 1.0]  # mean 0.5, population std 0.5
    assert torch.isnan(adv[1]).all()  # 0 / 0: equal rewards need the eps ...
    assert torch.equal(group_advantages(rewards, eps=1e-4)[1], torch.zeros(4, dtype=torch.float64))
    # mean 0.75, std sqrt((3 * 0.5625 + 5.0625) / 4) = sqrt(1.6875)
    std = math.sqrt(1.6875)
    assert adv[2].tolist() == pytest.approx([-0.75 / std, -0.75 / std, 2.25 / std, -0.75 / std])
    # eps adds to the std: [0, 1] has std 0.5, so eps = 0.5 halves the advantages
    assert group_advantages(torch.tensor([[0.0, 1.0]]), eps=0.5).tolist() == [[-0.5, 0.5]]
    assert group_advantages(torch.tensor([[0.0, 1.0]]), eps=1e-4)[0, 1].item() == pytest.approx(0.5 / 0.5001)


def _hand_example():
    # ratio 1.5 (A=+1, clipped at 1.2), 0.5 (A=+1), 0.5 (A=-1, clipped at 0.8), 1.0 (A=+2); one masked token.
    logprobs = torch.tensor([math.log(1.5), math.log(0.5), math.log(0.5), 0.0, 7.0], requires_grad=True)
    old = torch.zeros(5)
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, 5.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    return logprobs, old, adv, mask


def test_clipped_surrogate_loss_hand_computed():
    logprobs, old, adv, mask = _hand_example()
    loss = clipped_surrogate_loss(logprobs, old, adv, mask, epsilon=0.2)
    # per token -min(rA, clip(r)A): -1.2, -0.5, +0.8, -2.0 -> mean over 4 tokens
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 - 2.0) / 4)
    loss.backward()
    # clipped tokens get no gradient; unclipped ones get -A * ratio / N
    assert logprobs.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, -2.0 / 4, 0.0])
    assert clip_fraction(logprobs.detach(), old, adv, mask, epsilon=0.2).item() == pytest.approx(0.5)
    # a global normalizer (all tokens of the iteration) rescales
    total = clipped_surrogate_loss(logprobs, old, adv, mask, epsilon=0.2, normalizer=8)
    assert total.item() == pytest.approx(-2.9 / 8)


def test_kl_term_hand_computed():
    lp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    # k3: exp(ref - lp) - (ref - lp) - 1 = 0.5 + ln 2 - 1; the advantage is 0
    loss = clipped_surrogate_loss(lp, lp, torch.zeros(1), torch.ones(1), ref_logprobs=ref, beta=0.1)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    off = clipped_surrogate_loss(lp, lp, torch.zeros(1), torch.ones(1), ref_logprobs=ref, beta=0.0)
    assert off.item() == 0.0


def test_masked_tokens_contribute_nothing_to_loss_or_gradient():
    torch.manual_seed(0)
    base = torch.randn(3, 7) - 2
    old = base + 0.1 * torch.randn(3, 7)
    adv = torch.randn(3, 1).expand(3, 7)
    mask = (torch.rand(3, 7) > 0.4).int()
    mask[0, 0] = 0
    mask[1, 1] = 1

    def loss_and_grad(logprobs, old_logprobs):
        x = logprobs.clone().requires_grad_(True)
        loss = clipped_surrogate_loss(x, old_logprobs, adv, mask, ref_logprobs=x.detach() - 0.3, beta=0.05)
        loss.backward()
        return loss.detach(), x.grad

    loss_a, grad_a = loss_and_grad(base, old)
    perturbed, perturbed_old = base.clone(), old.clone()
    masked = mask == 0
    perturbed[masked] = torch.tensor([float("nan"), float("inf"), -float("inf"), 50.0]).repeat(21)[: int(masked.sum())]
    perturbed_old[masked] = -1e9
    loss_b, grad_b = loss_and_grad(perturbed, perturbed_old)
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(grad_a, grad_b)
    assert torch.all(grad_a[masked] == 0) and torch.any(grad_a[~masked] != 0)


# ---------------------------------------------------------------- trainer fixtures


def _env(hint_share: float = 0.25) -> SyntheticEnv:
    spec = template_spec({"name": "confirm_before_writing", "description": "Ask before writes."}, TARGET)
    spec["difficulty"]["hint_share"] = hint_share
    return SyntheticEnv(spec, TARGET)


class ScriptedBackend:
    """Every prompt of a round gets the same text with log-prob -0.5 per token (no model needed)."""

    name = "scripted"

    def __init__(self, tokenizer, texts=("I can help with that. What is your email?",)):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, 0

    def generate(self, prompts, params):
        text = self.texts[min(self.calls, len(self.texts) - 1)] + "<|im_end|>"
        self.calls += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [Generation(list(ids), self.tokenizer.decode(ids), [-0.5] * len(ids), "stop") for _ in prompts]


def _alternating_reward():
    counter = itertools.count()
    return lambda rollout: float(next(counter) % 2)  # 0, 1, 0, 1: every group has a spread


def _split_state(model):
    lora, base = {}, {}
    for name, tensor in model.state_dict().items():
        (lora if "lora_" in name else base)[name] = tensor.detach().clone()
    return lora, base


def _scripted(tokenizer):
    return lambda model, tok: ScriptedBackend(tokenizer)


SCRIPTED = replace(TINY, onpolicy_max_abs=0.0)
"""A scripted backend is off-policy by construction (its text is not sampled from the model): the
on-policy guard is off for it (and tested on its own below)."""


# ---------------------------------------------------------------- real iterations and resume


class Crash(Exception):
    pass


def test_real_iterations_train_only_the_adapter_and_resume_after_a_crash(tiny_model_path, tmp_path):
    config = replace(TINY, iterations=2)
    model, tokenizer = load_model(str(tiny_model_path))
    base_before = {k: v.clone() for k, v in model.state_dict().items()}

    def crash_after_first(metrics):
        if metrics.iteration == 1:
            raise Crash("killed")

    trainer = GRPOTrainer(model, tokenizer, _env(), config, tmp_path, reward_fn=_alternating_reward(),
                          progress=crash_after_first)
    lora_init, _ = _split_state(trainer.model)
    with pytest.raises(Crash):
        trainer.train()
    first = trainer.history[0]
    assert first.iteration == 1 and first.optimizer_steps == 1 and first.trained_sequences == 4
    assert math.isfinite(first.loss) and first.grad_norm > 0 and first.gen_time_s > 0 and first.opt_time_s > 0
    # what the step's cost follows: every trained sequence's prompt as well as its generated tokens
    assert first.sequence_tokens > first.loss_tokens + first.trained_sequences and first.micro_batches >= 1
    # the real sampler is the trained policy: the on-policy gap is numerics only (fp32 sampling against
    # the trainer's bf16 autocast where the CPU has it: ~0.025 nats here), far below the guard's bound
    assert first.onpolicy_mean_abs is not None and first.onpolicy_mean_abs < 0.1 and 0 <= first.onpolicy_kl < 0.01
    lora_after, base_after = _split_state(trainer.model)
    assert any(not torch.equal(lora_init[k], lora_after[k]) for k in lora_init)  # the adapter moved
    # the base is bit-exactly untouched (PEFT names it base_layer inside LoRA-wrapped modules)
    assert len(base_after) == len(base_before)
    for name, tensor in base_after.items():
        plain = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
        assert torch.equal(tensor, base_before[plain]), name
    checkpoint = tmp_path / "checkpoints" / "iter-0001"
    assert (checkpoint / "state.json").is_file() and (checkpoint / "optimizer.pt").is_file()
    (tmp_path / "checkpoints" / ".tmp-iter-0002-deadbeef").mkdir()  # a write killed half-way

    # a fresh process: new model, same folder -> continues at iteration 2 from the saved weights
    model2, _ = load_model(str(tiny_model_path))
    seen = []
    resumed = GRPOTrainer(model2, tokenizer, _env(), config, tmp_path, reward_fn=_alternating_reward(),
                          progress=seen.append)
    assert resumed.resume() == 1
    lora_loaded, _ = _split_state(resumed.model)
    assert all(torch.equal(lora_loaded[k], lora_after[k]) for k in lora_after)
    assert not (tmp_path / "checkpoints" / ".tmp-iter-0002-deadbeef").exists()
    state = resumed.optimizer.state_dict()["state"]
    assert state and all(int(s["step"]) == 1 for s in state.values())
    result = resumed.train()
    assert [m.iteration for m in seen] == [2]
    assert [m.iteration for m in result.history] == [1, 2] and result.resumed_from == 1
    assert result.history[0].sequence_tokens == first.sequence_tokens  # the checkpoint's history keeps it
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert (tmp_path / "summary.json").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter-0001", "iter-0002"]


# ---------------------------------------------------------------- robustness


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_model_path, tokenizer, tmp_path, monkeypatch):
    model, _ = load_model(str(tiny_model_path))
    trainer = GRPOTrainer(model, tokenizer, _env(hint_share=0.0), replace(SCRIPTED, iterations=3), tmp_path,
                          reward_fn=_alternating_reward(), backend_factory=_scripted(tokenizer))
    real_loss = grpo.clipped_surrogate_loss

    def nan_in_iteration_2(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if trainer.iteration == 1 else loss

    monkeypatch.setattr(grpo, "clipped_surrogate_loss", nan_in_iteration_2)
    with pytest.raises(NonFiniteLossError) as caught:
        trainer.train()
    err = caught.value
    assert err.iteration == 2 and err.task_id and "synthetic_confirm_before_writing/" in str(err)
    assert "iteration 2" in str(err) and err.checkpoint == tmp_path / "checkpoints" / "iter-0001"
    assert trainer.latest_checkpoint() == err.checkpoint
    # nothing of the failed iteration reached the weights: they equal the checkpoint's
    from safetensors.torch import load_file

    import pickle

    assert str(pickle.loads(pickle.dumps(err))) == str(err)
    saved = load_file(str(err.checkpoint / "adapter" / "adapter_model.safetensors"))
    current = {k.replace(".default", ""): v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    assert saved and all(torch.equal(saved[k], current[k]) for k in saved)


def test_environment_and_reward_errors_name_the_iteration_and_task(tiny_model_path, tokenizer, tmp_path):
    model, _ = load_model(str(tiny_model_path))
    env = _env()
    broken = env.sample_tasks(2)[1]
    real_start = env.start

    def start(task):
        if task.task_id == broken.task_id:
            raise KeyError("order table missing")
        return real_start(task)

    env.start = start
    trainer = GRPOTrainer(model, tokenizer, env, SCRIPTED, tmp_path / "env", backend_factory=_scripted(tokenizer))
    with pytest.raises(RolloutError, match="iteration 1, task " + broken.task_id) as caught:
        trainer.train()
    assert "order table missing" in str(caught.value) and caught.value.checkpoint is None

    def bad_reward(rollout):
        raise ZeroDivisionError("rubric weights sum to 0")

    model, _ = load_model(str(tiny_model_path))
    trainer = GRPOTrainer(model, tokenizer, _env(), SCRIPTED, tmp_path / "reward", reward_fn=bad_reward,
                          backend_factory=_scripted(tokenizer))
    with pytest.raises(RolloutError, match="reward function failed: ZeroDivisionError"):
        trainer.train()


def test_one_step_has_ratio_one_and_several_steps_use_the_rollout_logprobs(tiny_model_path, tokenizer, tmp_path):
    model, _ = load_model(str(tiny_model_path))
    one = GRPOTrainer(model, tokenizer, _env(hint_share=0.0), replace(SCRIPTED, iterations=1), tmp_path / "one",
                      reward_fn=_alternating_reward(), backend_factory=_scripted(tokenizer))
    _, samples = one.collect(1)
    stats = one.optimize(samples, 1)
    # old = current (detached): ratio exactly 1, so loss = -sum_i A_i n_i / N; the scripted turns all have
    # the same length n and the advantages of a group sum to 0, so the loss is 0 while the gradient is not
    assert not any(s.rollout_old for s in samples)
    n = [sum(s.loss_mask[1:]) for s in samples]
    expected = -sum(s.advantage * k for s, k in zip(samples, n)) / sum(n)
    assert stats["loss"] == pytest.approx(expected, abs=1e-6) and stats["clip_fraction"] == 0.0
    assert stats["grad_norm"] > 0 and stats["steps"] == 1 and stats["loss_tokens"] == sum(n)

    model, _ = load_model(str(tiny_model_path))
    two = GRPOTrainer(model, tokenizer, _env(hint_share=0.0), replace(SCRIPTED, iterations=1, steps_per_iteration=2),
                      tmp_path / "two", reward_fn=_alternating_reward(), backend_factory=_scripted(tokenizer))
    _, samples = two.collect(1)
    stats = two.optimize(samples, 1)
    # old = the scripted sampling log-prob -0.5, far above the random model's: ratios < 0.8 are clipped
    # where A < 0, so about half of the tokens are
    assert all(s.rollout_old for s in samples) and stats["steps"] == 2
    assert 0.3 < stats["clip_fraction"] <= 0.5 + 1e-6  # float32 mean


def test_tied_groups_are_replaced_by_fresh_tasks_and_leave_the_batch(tiny_model_path, tokenizer, tmp_path):
    """Dynamic sampling: a group whose rewards all tie trains nothing, so with ``resample_rounds`` it
    is replaced by a group on a fresh task of the re-sampling seeds (round after round while the
    replacement ties too); the batch keeps G groups, and the metrics are the iteration's own draw."""
    env = _env(hint_share=0.0)
    # iteration 1's first group ties, and so does the first round's replacement; the second round's does not
    tie = {env.sample_tasks(1)[0].task_id, env.sample_tasks(1, offset=grpo.RESAMPLE_OFFSET)[0].task_id}
    second = env.sample_tasks(1, offset=grpo.RESAMPLE_OFFSET + 2)[0].task_id  # round 2: G = 2 seeds on
    spread = itertools.count()

    def reward(rollout):
        return 0.0 if rollout.task.task_id in tie else float(next(spread) % 2)

    config = replace(SCRIPTED, iterations=1, groups=2, samples_per_group=2, resample_rounds=2)
    model, _ = load_model(str(tiny_model_path))
    trainer = GRPOTrainer(model, tokenizer, env, config, tmp_path / "resampled", reward_fn=reward,
                          backend_factory=_scripted(tokenizer))
    rollouts, samples = trainer.collect(1)
    assert len(rollouts) == len(samples) == 8  # 2 x 2 drawn, then one group per round
    kept = [s for s in samples if s.kept]
    assert len(kept) == 4 and {s.task_id for s in kept} == {env.sample_tasks(2)[1].task_id, second}
    assert not any(s.task_id in tie for s in kept)
    assert trainer.optimize(samples, 1)["trained_sequences"] == 4

    spread = itertools.count()
    model, _ = load_model(str(tiny_model_path))
    trainer = GRPOTrainer(model, tokenizer, env, config, tmp_path / "metrics", reward_fn=reward,
                          backend_factory=_scripted(tokenizer))
    metrics = trainer.step()
    assert (metrics.resampled_groups, metrics.informative_groups, metrics.zero_std_groups) == (2, 2, 1)
    assert metrics.trained_sequences == 4 and metrics.mean_reward == 0.25  # the draw: 0, 0 | 0, 1
    assert "2 groups re-sampled" in metrics.line()
    result = grpo.GRPOResult(adapter_dir=tmp_path, history=trainer.history, config=config, resumed_from=0,
                             output_dir=tmp_path)
    assert result.rollouts_played == 8  # what the equal-rollout baseline's budget counts

    spread = itertools.count()
    model, _ = load_model(str(tiny_model_path))
    plain = GRPOTrainer(model, tokenizer, env, replace(config, resample_rounds=0), tmp_path / "plain",
                        reward_fn=reward, backend_factory=_scripted(tokenizer))
    rollouts, samples = plain.collect(1)
    assert len(rollouts) == 4 and all(s.kept for s in samples)
    assert plain.optimize(samples, 1)["trained_sequences"] == 2  # the tied group is skipped, as sampled


def test_a_recipe_field_added_later_keeps_stored_adapters_current():
    """``resample_rounds = 0`` is how every stored adapter was trained: at that value it stays out of
    the identity (no retraining); set, it is part of it."""
    other = {"resample_rounds": 2, "warmup_iterations": 2, "expert_guidance": True}
    assert set(other) == set(GRPOConfig.LATER_FIELDS)
    for name in GRPOConfig.LATER_FIELDS:
        assert name not in GRPOConfig().identity()
        assert GRPOConfig(**{name: other[name]}).identity()[name] == other[name]
        with pytest.raises(ValueError, match=name):
            GRPOConfig(**{name: -1})


def test_warmup_ramps_the_learning_rate_of_the_first_iterations(tiny_model_path, tokenizer, tmp_path):
    """``warmup_iterations = 2``: iterations 1, 2, 3 step at 1/3, 2/3 and the full rate; a trainer
    resumed at iteration 2 steps at iteration 2's rate, not at its optimizer's stored one."""
    config = replace(SCRIPTED, learning_rate=3e-3, warmup_iterations=2, iterations=3)
    assert [config.learning_rate_at(i) for i in (1, 2, 3, 4)] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])
    assert GRPOConfig(learning_rate=1e-3).learning_rate_at(1) == 1e-3
    model, _ = load_model(str(tiny_model_path))
    trainer = GRPOTrainer(model, tokenizer, _env(hint_share=0.0), config, tmp_path / "warm",
                          reward_fn=_alternating_reward(), backend_factory=_scripted(tokenizer))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.step()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    # Adam's first step moves each entry by at most the rate (|m / (sqrt(v) + eps)| <= 1), the largest by about it
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert 0.8e-3 < moved <= 1e-3 * (1 + 1e-4)
    model, _ = load_model(str(tiny_model_path))
    resumed = GRPOTrainer(model, tokenizer, _env(hint_share=0.0), config, tmp_path / "warm",
                          reward_fn=_alternating_reward(), backend_factory=_scripted(tokenizer))
    assert resumed.resume() == 1
    resumed.step()
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)


# ---------------------------------------------------------------- hints and masks


def test_hinted_episodes_are_trained_with_the_plain_system_prompt(tiny_model_path, tokenizer, tmp_path):
    model, _ = load_model(str(tiny_model_path))
    env = _env(hint_share=1.0)
    trainer = GRPOTrainer(model, tokenizer, env, replace(SCRIPTED, max_steps=2, swap_hints=True), tmp_path,
                          backend_factory=_scripted(tokenizer))
    rollouts, samples = trainer.collect(1)
    assert len(rollouts) == len(samples) == 4
    plain = env.system_prompt()
    for rollout, sample in zip(rollouts, samples):
        assert "Hint: " in tokenizer.decode(rollout.token_ids)
        text = tokenizer.decode(sample.token_ids)
        assert "Hint: " not in text and plain in text and sample.hinted and sample.rollout_old
        # the first prompt: the user's opening and the expert prefix up to the decision point
        n_prompt = len(env.start(rollout.task).initial_messages())
        opening = [{"role": "system", "content": plain}] + rollout.messages[1:n_prompt]
        prefix = tokenizer.encode(render(tokenizer, opening, env.tool_schemas(), add_generation_prompt=True),
                                  add_special_tokens=False)
        assert sample.token_ids[: len(prefix)] == prefix
        # everything after the first prompt is the sampled conversation, untouched (trimmed at the end)
        assert sample.token_ids[len(prefix):] == rollout.token_ids[rollout.prompt_len:][: len(sample.token_ids) - len(prefix)]
        # only generated tokens are in the loss; their old log-probs are the (hinted) sampling ones
        generated = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
        assert len(rollout.assistant_texts) == 2 and rollout.loss_end is None
        assert tokenizer.decode(generated) == "".join(rollout.assistant_texts)
        assert [lp for lp, m in zip(sample.old_logprobs, sample.loss_mask) if m] == [-0.5] * len(generated)
        assert sample.loss_mask[-1] == 1  # trimmed after the last generated token
    no_swap = GRPOTrainer(load_model(str(tiny_model_path))[0], tokenizer, env, replace(SCRIPTED, swap_hints=False),
                          tmp_path / "b", backend_factory=_scripted(tokenizer))
    _, kept = no_swap.collect(1)
    assert all("Hint: " in tokenizer.decode(s.token_ids) and not s.rollout_old for s in kept)


def test_held_out_evaluation_plays_hinted_tasks_without_their_hint(tokenizer):
    # The hint is a training aid: the held-out (and train-side validation) evaluation measures the
    # agent without it, on the very tasks that training would have hinted.
    from types import SimpleNamespace

    from trace_assets.train.heldout import EvalConfig, evaluate_policy

    env = _env(hint_share=1.0)
    config = EvalConfig(n_tasks=4, max_steps=2)
    assert all(t.meta["hinted"] for t in env.sample_tasks(config.n_tasks, offset=config.seed_offset))

    class Recording(ScriptedBackend):
        prompts: list[str] = []

        def generate(self, prompts, params):
            self.prompts.extend(self.tokenizer.decode(p) for p in prompts)
            return super().generate(prompts, params)

    report = evaluate_policy(SimpleNamespace(eval=lambda: None), tokenizer, env, config, policy="base",
                             backend_factory=lambda model, tok: Recording(tokenizer))
    assert report.n == 4 and len(Recording.prompts) >= 4
    assert all(env.system_prompt() in p and "Hint: " not in p for p in Recording.prompts)


def test_train_through_first_reply_leaves_the_turns_after_the_decision_out_of_the_loss(tiny_model_path, tokenizer,
                                                                                        tmp_path):
    # A read, then the reply that decides, then a write and a closing reply: the episode runs on
    # and is scored whole, but only the read and the reply are trained.
    turns = ('<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W0000000"}}\n</tool_call>',
             "I will cancel it. Do you confirm?",
             '<tool_call>\n{"name": "cancel_pending_order", "arguments": {"order_id": "#W0000000"}}\n</tool_call>',
             "Done.")
    env = _env(hint_share=0.0)
    through = copy.deepcopy(env.spec)
    through["end"]["train_through"] = "first_reply"
    for spec, trained in ((through, turns[:2]), (env.spec, turns)):
        trainer = GRPOTrainer(load_model(str(tiny_model_path))[0], tokenizer, SyntheticEnv(spec, TARGET),
                              replace(SCRIPTED, max_steps=4), tmp_path / str(len(trained)),
                              backend_factory=lambda model, tok: ScriptedBackend(tokenizer, turns))
        rollouts, samples = trainer.collect(1)
        for rollout, sample in zip(rollouts, samples):
            assert rollout.steps == 4 and rollout.assistant_texts == [t + "<|im_end|>" for t in turns]
            in_loss = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
            assert tokenizer.decode(in_loss) == "".join(t + "<|im_end|>" for t in trained)
            if trained != turns:  # the turns left out are still marked generated
                assert sum(rollout.env_mask) > len(in_loss)


def test_expert_guidance_trains_the_experts_play_of_each_groups_task(tiny_model_path, tokenizer, tmp_path):
    """``expert_guidance``: each group gains the expert's play of its task (plain prompt, scored by
    the environment or by the trainer's ``reward_fn``, normalized with the group's K rewards). Only what the expert wrote after the
    episode's start is trained; its tokens stay out of the on-policy guard (their 0.0 "sampler"
    log-probs would trip it: the real sampler runs with the guard on here) and out of the metrics."""
    env = _env(hint_share=1.0)
    config = replace(TINY, iterations=1, groups=2, samples_per_group=2, expert_guidance=True, resample_rounds=0)
    assert config.group_size == 3 and "expert_guidance" in config.identity()
    trainer = GRPOTrainer(load_model(str(tiny_model_path))[0], tokenizer, env, config, tmp_path / "guided")
    rollouts, samples = trainer.collect(1)
    assert len(rollouts) == 4 and [s.demo for s in samples] == [False, False, True] * 2
    for group in (samples[:3], samples[3:]):
        demo, played = group[2], group[:2]
        assert demo.task_id == played[0].task_id and demo.reward == 1.0 and demo.success and not demo.rollout_old
        rewards = torch.tensor([[s.reward for s in group]], dtype=torch.float64)
        assert [s.advantage for s in group] == pytest.approx(group_advantages(rewards).view(-1).tolist())
        first = demo.loss_mask.index(1)
        context, trained = tokenizer.decode(demo.token_ids[:first]), tokenizer.decode(
            [t for t, m in zip(demo.token_ids, demo.loss_mask) if m])
        assert "Hint: " not in context and env.system_prompt() in context  # the plain prompt
        assert "find_user_id" in context and "find_user_id" not in trained  # the expert prefix is context
        assert trained.endswith("<|im_end|>") and ("confirm" in trained.lower() or "<tool_call>" in trained)
        task = without_hint(next(r.task for r in rollouts if r.task.task_id == demo.task_id))
        messages, _ = trainer.expert(task)
        replies = [m for m in messages[len(env.start(task).initial_messages()):] if m["role"] == "assistant"]
        runs = sum(1 for target, _ in itertools.groupby(demo.loss_mask) if target)
        assert len(replies) >= 2 and runs == len(replies)  # every reply of the expert's play, not only its first
    metrics = GRPOTrainer(load_model(str(tiny_model_path))[0], tokenizer, env, config, tmp_path / "step").step()
    assert metrics.demo_reward == 1.0 and metrics.onpolicy_mean_abs is not None and metrics.onpolicy_mean_abs < 0.25
    assert metrics.success_rate < 1.0  # the random tiny model's own draw, without the expert's
    # A reshaped reward (the experiment's binary-reward ablation) scores the expert's play too.
    halved = GRPOTrainer(load_model(str(tiny_model_path))[0], tokenizer, env, config, tmp_path / "x",
                         reward_fn=lambda rollout: 0.5 * float(rollout.result.success))
    demos = [s for s in halved.collect(1)[1] if s.demo]
    assert len(demos) == 2 and all(d.reward == 0.5 and d.success for d in demos)


def test_config_round_trips_and_profiles_state_their_differences():
    assert GRPOConfig.from_dict(TINY.to_dict()) == TINY
    paper = GRPOConfig()
    assert paper.learning_rate == 1e-5 and paper.iterations == 40 and paper.temperature == 1.0
    demo = DEMO_GRPO
    assert (demo.learning_rate, demo.iterations, demo.groups, demo.samples_per_group, demo.steps_per_iteration,
            demo.micro_batch_size, demo.max_steps, demo.temperature) == (1e-4, 4, 4, 4, 1, 4, 12, 0.7)
    assert demo.lora_r == 16 and demo.beta == 0.0 and demo.epsilon == 0.2
    with pytest.raises(ValueError):
        GRPOConfig(groups=0)
    assert GRPOConfig().pack_suffixes is False and GRPOConfig(pack_suffixes="auto").pack_suffixes == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="pack_suffixes"):
            GRPOConfig(pack_suffixes=bad)


def test_the_experiment_trains_the_recipe_its_learning_curve_measured():
    """``make experiment`` trains with GUIDED_GRPO, and GUIDED_GRPO is the recipe whose held-out
    learning curve the README cites (the same identity; execution fields may differ)."""
    import json
    from pathlib import Path

    from trace_assets.settings import GUIDED_GRPO, PROFILES

    stored = Path(__file__).resolve().parent.parent / "docs/transfer/heldout_v12_guidedfix_wu3_e48_fp32.json"
    measured = GRPOConfig.from_dict(json.loads(stored.read_text())["grpo"])
    assert replace(measured, seed=GUIDED_GRPO.seed).identity() == GUIDED_GRPO.identity()
    assert PROFILES["experiment"].train.grpo == GUIDED_GRPO and GUIDED_GRPO.expert_guidance


def test_micro_batches_bound_sequences_and_padded_tokens():
    from trace_assets.train.grpo import micro_batches

    # sorted longest first, as optimize() does: 4000 alone (2 x 4000 > 6144), then 3000 + 1000
    # (2 x 3000 = 6000), then 900 + 100
    assert micro_batches([4000, 3000, 1000, 900, 100], 4, 6144) == [[0], [1, 2], [3, 4]]
    assert micro_batches([10] * 9, 4, 10**6) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert micro_batches([9000, 10], 4, 6144) == [[0], [1]]  # longer than the budget: alone, not dropped
    assert micro_batches([], 4, 6144) == []
    for lengths in ([5, 5, 5], [700, 600, 500, 400, 300, 200, 100]):
        chunks = micro_batches(lengths, 3, 1500)
        assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
        assert all(len(c) * max(lengths[i] for i in c) <= 1500 or len(c) == 1 for c in chunks)


def test_micro_batches_count_a_shared_prefix_once():
    from trace_assets.train.grpo import common_prefix_len, micro_batches

    # four samples of one task share a 2,000-token prompt and differ in 100-token answers: one pass
    # costs 2,000 + 4 x 100 = 2,400 tokens of activations, not 4 x 2,100 = 8,400
    assert micro_batches([2100] * 4, 4, 6144, shared=[0, 2000, 2000, 2000]) == [[0, 1, 2, 3]]
    assert micro_batches([2100] * 4, 4, 6144) == [[0, 1], [2, 3]]
    # the chunk's prefix is the smallest shared length inside it: with another task's sample (100
    # shared tokens), three cost 100 + 3 x 2,000 = 6,100 and a fourth would not fit
    assert micro_batches([2100, 2100, 2100, 2100], 4, 6144, shared=[0, 2000, 100, 2000]) == [[0, 1, 2], [3]]
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix_len([], [1]) == 0


@pytest.mark.parametrize("bf16", [False, True])
def test_prefix_micro_batches_leave_the_gradient_unchanged(tiny_model_path, tokenizer, tmp_path, bf16):
    """Grouping a task's samples (their decision-point prompt runs once), packing what follows it
    and gradient checkpointing (over that shared prompt too) are savings, not new estimators: on real samples of a
    decision-point environment, the first step's gradient equals the length-sorted layout's
    (fp32: relative error < 1e-5; bf16 autocast: cosine > 0.999)."""
    from trace_assets.agent.lora import bf16_supported

    if bf16 and not bf16_supported():
        pytest.skip("no native bf16 here")
    config = replace(TINY, iterations=1, groups=2, samples_per_group=4, micro_batch_size=4, bf16=bf16, max_new_tokens=16)
    layouts = {"sorted": {"prefix_micro_batches": False, "pack_suffixes": False},
               "grouped": {"prefix_micro_batches": True, "pack_suffixes": False},
               "grouped+checkpointed": {"prefix_micro_batches": True, "pack_suffixes": False, "gradient_checkpointing": True},
               "grouped+packed": {"prefix_micro_batches": True, "pack_suffixes": True},
               "grouped+packed+checkpointed": {"prefix_micro_batches": True, "pack_suffixes": True,
                                               "gradient_checkpointing": True},
               "grouped+auto": {"prefix_micro_batches": True, "pack_suffixes": "auto"}}
    grads, samples = {}, None
    for name, layout in layouts.items():
        torch.manual_seed(0)
        model, _ = load_model(str(tiny_model_path))
        trainer = GRPOTrainer(model, tokenizer, _env(hint_share=0.0), replace(config, **layout),
                              tmp_path / name, reward_fn=_alternating_reward())
        if samples is None:
            _, samples = trainer.collect(1)
        captured = []
        trainer.optimizer.step = lambda: captured.append(torch.cat([p.grad.flatten() for p in trainer.params]))
        trainer.optimize(samples, 1)
        grads[name] = captured[0].double()
    prompts = {s.task_id: len(s.token_ids) - sum(s.loss_mask) for s in samples}
    assert len(prompts) == 2 and min(prompts.values()) > 200  # long shared prompts: the case that matters
    b = grads["sorted"]
    assert b.norm() > 0
    lengths = {len(s.token_ids) for s in samples}
    assert max(lengths) - min(lengths) > 8  # ragged: packing has padding to drop
    for name in [n for n in layouts if n != "sorted"]:
        a = grads[name]
        if bf16:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999, name
        else:
            assert (a - b).norm() / b.norm() < 1e-5, name


def test_execution_settings_never_retrain_recipe_settings_do():
    """A memory knob (micro-batch size/tokens) tuned for a smaller machine must not make trained
    adapters stale; a recipe change (learning rate) must."""
    import dataclasses

    from dagster import AssetKey

    from trace_assets.definitions import build_definitions

    def versions(**overrides):
        train = TINY_SETTINGS.train
        settings = dataclasses.replace(TINY_SETTINGS, train=dataclasses.replace(train, grpo=dataclasses.replace(train.grpo, **overrides)))
        graph = build_definitions(settings).resolve_asset_graph()
        return {k: graph.get(AssetKey(k)).code_version for k in ("lora_adapter", "grpo_baseline")}

    base = versions()
    assert versions(micro_batch_tokens=1024, micro_batch_size=1, checkpoint_every=3, gradient_checkpointing=True) == base
    changed = versions(learning_rate=5e-4)
    assert all(changed[k] != base[k] for k in base)
    assert set(GRPOConfig.EXECUTION_FIELDS) <= {f.name for f in dataclasses.fields(GRPOConfig)}


def test_task_pool_visits_every_task_once_per_epoch_in_a_seeded_shuffled_order():
    from trace_assets.envs import get_environment
    from trace_assets.envs.splits import TaskPoolEnv, make_splits

    retail = get_environment("retail")
    train = make_splits(retail, demo_per_family=0, train_per_family=4, test_per_family=0, seed=0)["train"]
    pool = TaskPoolEnv(retail, train, seed=0)
    n = len(train)
    epoch0 = pool.sample_tasks(n, offset=0)
    epoch1 = pool.sample_tasks(n, offset=n)
    ids = [t.task_id for t in train]
    assert sorted(t.task_id for t in epoch0) == sorted(ids) == sorted(t.task_id for t in epoch1)
    assert [t.task_id for t in epoch0] != ids and epoch0 != epoch1  # shuffled, anew each epoch
    # an iteration of G = 4 draws several families, not the one the pool happens to list first
    assert len({t.family for t in pool.sample_tasks(4, offset=0)}) > 1
    assert pool.sample_tasks(5, offset=3) == epoch0[3:8]  # positions of one stream, whatever the call
    assert TaskPoolEnv(retail, train, seed=0).sample_tasks(n) == epoch0
    assert TaskPoolEnv(retail, train, seed=1).sample_tasks(n) != epoch0


# ---------------------------------------------------------------- hint estimator and on-policy guard


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_hint_swap_loss_is_bounded_at_extreme_ratios_for_both_signs(sign):
    """The gradient weight on log pi is min(rho, cap) * A: never above cap, whatever rho and A's sign;
    the PPO clip's weight for a negative advantage grows with rho without bound."""
    old = torch.tensor([-20.0, -5.0, -0.1, -0.1, -1.0])
    lp = torch.tensor([-0.01, -0.5, -8.0, -30.0, -1.0], requires_grad=True)  # rho from e^20 down to e^-30
    adv = torch.full((5,), 2.0 * sign)
    mask = torch.ones(5)
    hint_swap_loss(lp, old, adv, mask, cap=1.0, normalizer=1.0).backward()
    rho = torch.exp(lp.detach() - old)
    assert torch.allclose(lp.grad, -torch.clamp(rho, max=1.0) * adv)
    assert (lp.grad.abs() <= 2.0 + 1e-6).all()  # |A| * cap
    assert lp.grad[0].abs() == pytest.approx(2.0) and lp.grad[3].abs() < 1e-12
    ppo = lp.detach().clone().requires_grad_(True)
    clipped_surrogate_loss(ppo, old, adv, mask, epsilon=0.2, normalizer=1.0).backward()
    if sign < 0:  # what the swap used to do: a weight of rho ~ e^20 on the first token
        assert ppo.grad[0].abs() > 1e6
    capped = lp.detach().clone().requires_grad_(True)
    hint_swap_loss(capped, old, adv, mask, cap=0.5, normalizer=1.0).backward()
    assert (capped.grad.abs() <= 1.0 + 1e-6).all()
    masked = lp.detach().clone().requires_grad_(True)
    hint_swap_loss(masked, old, adv, torch.tensor([0.0, 1, 1, 1, 1]), normalizer=1.0).backward()
    assert masked.grad[0] == 0


class _TemperatureMismatch:
    """Samples with the real model but reports log-probs at another temperature (a sampler bug)."""

    name = "mismatch"

    def __init__(self, model, tokenizer):
        from trace_assets.agent.backends import TransformersBackend

        self.inner = TransformersBackend(model, tokenizer)

    def generate(self, prompts, params):
        return self.inner.generate(prompts, replace(params, temperature=params.temperature * 3))


def test_onpolicy_guard_stops_an_iteration_whose_sampler_is_not_the_policy(tiny_model_path, tokenizer, tmp_path):
    model, _ = load_model(str(tiny_model_path))
    before = None
    trainer = GRPOTrainer(model, tokenizer, _env(hint_share=0.0), replace(TINY, iterations=1), tmp_path,
                          reward_fn=_alternating_reward(), backend_factory=_TemperatureMismatch)
    before, _ = _split_state(trainer.model)
    with pytest.raises(OffPolicyError) as caught:
        trainer.train()
    err = caught.value
    assert err.iteration == 1 and "onpolicy_max_abs = 0.25" in str(err) and "nats" in str(err)
    measured = float(str(err).split("differ from the trainer's by ")[1].split(" ")[0])
    assert measured > 0.25
    after, _ = _split_state(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # stopped before the optimizer step
    # the same run with the guard off trains
    model2, _ = load_model(str(tiny_model_path))
    off = GRPOTrainer(model2, tokenizer, _env(hint_share=0.0), replace(TINY, iterations=1, onpolicy_max_abs=0.0),
                      tmp_path / "off", reward_fn=_alternating_reward(), backend_factory=_TemperatureMismatch)
    metrics = off.train().history[0]
    assert metrics.optimizer_steps == 1 and metrics.onpolicy_mean_abs == pytest.approx(measured, rel=1e-3)
