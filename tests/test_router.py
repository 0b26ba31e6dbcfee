"""The label-logit router (tiny model, constructed logits) and the routing report."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trace_assets.route.report import (
    attribution,
    confusion_matrix,
    oracle_choice,
    oracle_rewards,
    paired_comparison,
    plot_success_by_system,
    plot_success_vs_rollouts,
    routed_rewards,
    routing_accuracy,
    success_table,
)
from trace_assets.route.router import (
    ANSWER_PREFIX,
    LABELS,
    Decision,
    LogitRouter,
    RouterCandidate,
    build_router_prompt,
    choose_example,
    example_text,
    label_token_ids,
    router_chat_text,
)

CANDIDATES = [
    RouterCandidate("cancel_pending", "Cancels pending orders after confirming with the user.",
                    "User: please cancel order #W123\nAssistant calls cancel_pending_order({\"order_id\": \"#W123\"})"),
    RouterCandidate("return_items", "Returns delivered items to the original payment method.",
                    "User: I want to return my lamp\nAssistant calls return_delivered_order_items({...})"),
    RouterCandidate("modify_address", "Changes the shipping address of pending orders.", ""),
]
PROMPTS = [
    "Hi, I'd like to cancel my order, it has not shipped yet.",
    "My lamp arrived broken, can I send it back?",
    "Hello",
]


@pytest.fixture(scope="module")
def tiny(tiny_model_path) -> tuple[Any, Any]:
    from trace_assets.agent.model import load_model

    return load_model(str(tiny_model_path))


class _BiasedHead(torch.nn.Module):
    """The LM head plus a fixed bias on some token ids: logits whose winner we know."""

    def __init__(self, head: torch.nn.Module, bias: dict[int, float]) -> None:
        super().__init__()
        self.head = head
        self.bias = bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        for token, value in self.bias.items():
            logits[..., token] += value
        return logits


class _biased:
    def __init__(self, model: Any, bias: dict[int, float]) -> None:
        self.model, self.bias = model, bias

    def __enter__(self) -> Any:
        self.saved = self.model.lm_head
        self.model.lm_head = _BiasedHead(self.saved, self.bias)
        return self.model

    def __exit__(self, *exc: Any) -> None:
        self.model.lm_head = self.saved


# ---------------------------------------------------------------- labels and prompt


def test_each_label_is_one_token_after_the_answer_prefix(tokenizer):
    ids = label_token_ids(tokenizer, len(LABELS))
    assert len(set(ids)) == len(LABELS)
    for label, tid in zip(LABELS, ids):
        assert tokenizer.convert_ids_to_tokens(tid) == "Ġ" + label
    # In the real prompt too: the chat text's tokens are a prefix and the label adds one token.
    text = router_chat_text(tokenizer, PROMPTS[0], CANDIDATES)
    assert text.endswith(ANSWER_PREFIX)
    base = tokenizer.encode(text, add_special_tokens=False)
    for label, tid in zip(LABELS[:4], ids):
        assert tokenizer.encode(text + " " + label, add_special_tokens=False) == base + [tid]


def test_a_label_that_is_not_one_token_raises(tokenizer):
    with pytest.raises(ValueError, match="'Q7zx'"):
        label_token_ids(tokenizer, 2, labels=("A", "Q7zx"))
    with pytest.raises(ValueError):
        label_token_ids(tokenizer, 30)


def test_prompt_lists_each_candidate_then_the_base(tokenizer):
    text = build_router_prompt(PROMPTS[1], CANDIDATES)
    assert text.index(PROMPTS[1]) < text.index("A. Specialist 'cancel_pending'") < text.index("B. Specialist")
    assert text.index("C. Specialist 'modify_address'") < text.index("D. The general assistant")
    assert "(A, B, C, D)" in text
    chat = router_chat_text(tokenizer, PROMPTS[1], CANDIDATES)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\nAnswer:")


def test_example_text_is_compact():
    from trace_assets.envs.retail.env import RetailEnv
    from trace_assets.envs.retail.expert import demonstrate

    env = RetailEnv()
    task = env.make_task(env.families()[0], 3)
    messages, result = demonstrate(env, task)
    assert result.success
    text = example_text(messages, max_chars=600)
    assert len(text) <= 600 and text.startswith("User: ")
    assert "Assistant calls " in text and "# " not in text.splitlines()[0]
    assert len(choose_example([messages, messages[:3]], max_chars=600)) <= len(text)


# ---------------------------------------------------------------- routing


def test_router_picks_the_label_with_the_largest_logit(tiny):
    model, tok = tiny
    ids = label_token_ids(tok, len(CANDIDATES) + 1)
    router = LogitRouter(model, tok, CANDIDATES, batch_size=2)
    with _biased(model, {ids[1]: 50.0}):
        decisions = router.route(PROMPTS)
    assert [d.choice for d in decisions] == ["return_items"] * 3
    assert [d.label for d in decisions] == ["B"] * 3
    for d in decisions:
        assert set(d.probs) == {"cancel_pending", "return_items", "modify_address", None}
        assert sum(d.probs.values()) == pytest.approx(1.0)
        assert d.probs["return_items"] > 0.99
    with _biased(model, {ids[3]: 50.0}):  # the last label is the base
        decisions = router.route(PROMPTS[:1])
    assert decisions[0].choice is None and decisions[0].label == "D" and decisions[0].choice_name == "base"
    assert decisions[0].to_dict()["probs"]["base"] > 0.99


def test_scores_are_the_label_logits_of_one_unpadded_forward(tiny):
    model, tok = tiny
    router = LogitRouter(model, tok, CANDIDATES, batch_size=8)
    batched = router.scores(PROMPTS)  # different lengths: left padding in one batch
    for prompt, row in zip(PROMPTS, batched):
        ids = tok.encode(router.prompt(prompt), add_special_tokens=False)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        expected = logits[router.token_ids].tolist()
        assert list(row) == ["cancel_pending", "return_items", "modify_address", None]
        assert list(row.values()) == pytest.approx(expected, abs=1e-4)


def test_router_on_a_peft_model_is_the_frozen_base(tiny, tmp_path):
    import copy

    from peft import get_peft_model

    from trace_assets.agent.lora import lora_config

    model, tok = tiny
    plain = LogitRouter(model, tok, CANDIDATES).scores(PROMPTS[:2])
    peft_model = get_peft_model(copy.deepcopy(model), lora_config(r=4, alpha=8))
    torch.manual_seed(1)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    routed = LogitRouter(peft_model, tok, CANDIDATES).scores(PROMPTS[:2])
    for a, b in zip(plain, routed):
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    with torch.inference_mode():  # the adapter does change the model when enabled
        ids = torch.tensor([tok.encode(PROMPTS[0])])
        assert not torch.allclose(peft_model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_contextual_calibration_cancels_a_constant_label_prior(tiny):
    model, tok = tiny
    ids = label_token_ids(tok, len(CANDIDATES) + 1)
    # One content-free prompt: a constant bias then cancels exactly (averaging several is approximate).
    calibrated = LogitRouter(model, tok, CANDIDATES, calibrate=True, content_free=("N/A",))
    clean = calibrated.route(PROMPTS[:2])
    prior = LogitRouter(model, tok, CANDIDATES, calibrate=True, content_free=("N/A",))
    with _biased(model, {ids[0]: 8.0}):
        tilted = prior.route(PROMPTS[:2])
        raw = LogitRouter(model, tok, CANDIDATES).route(PROMPTS[:2])
    assert all(d.choice == "cancel_pending" for d in raw)
    for a, b in zip(clean, tilted):
        assert a.choice == b.choice
        for key in a.probs:
            assert a.probs[key] == pytest.approx(b.probs[key], abs=1e-4)
    default = LogitRouter(model, tok, CANDIDATES, calibrate=True)  # the three paper prompts, averaged
    assert len(default.content_free_probs()) == 4
    assert sum(default.route(PROMPTS[:1])[0].probs.values()) == pytest.approx(1.0)


# ---------------------------------------------------------------- the report


def test_accuracy_confusion_oracle_attribution():
    decisions = [Decision("a", {"a": 1.0}, "A"), Decision(None, {None: 1.0}, "C"), Decision("b", {"b": 1.0}, "B")]
    assert routing_accuracy(decisions, ["a", "base", "a"]) == pytest.approx(2 / 3)
    cm = confusion_matrix(decisions, ["a", None, "a"])
    assert cm.columns == ["target", "a", "b", "base"]
    assert cm.filter(cm["target"] == "a").row(0) == ("a", 1, 1, 0)
    assert cm.filter(cm["target"] == "base").row(0) == ("base", 0, 0, 1)

    rewards = {None: [1.0, 0.0, 0.5, 0.0], "a": [1.0, 1.0, 0.2, 0.7], "b": [0.0, 1.0, 0.9, 0.7]}
    assert oracle_choice(rewards) == [None, "a", "b", "a"]  # tie with base -> base; a/b tie -> first
    assert oracle_rewards(rewards) == [1.0, 1.0, 0.9, 0.7]
    assert routed_rewards(decisions + ["b"], rewards) == [1.0, 0.0, 0.9, 0.7]
    attr = attribution(rewards[None], {"a": rewards["a"], "b": rewards["b"]}, task_ids=["t0", "t1", "t2", "t3"])
    assert attr == {"a": {"fixed": ["t1"], "broke": []}, "b": {"fixed": ["t1"], "broke": ["t0"]}}


def test_paired_comparison_is_an_exact_sign_test_on_discordant_tasks():
    # wins on tasks 0, 1; loss on task 3; task 2 both succeed, task 4 both fail
    result = paired_comparison([1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.5, 1.0, 1.0, 0.0])
    assert (result["wins"], result["losses"]) == (2, 1)
    assert result["delta"] == pytest.approx(1 / 5)
    assert result["p_value"] == pytest.approx(1.0)  # 2 x P(X <= 1 | n=3) = 2 x 4/8, capped at 1
    six_nil = paired_comparison([1.0] * 6 + [0.0] * 4, [0.0] * 10)
    assert six_nil["p_value"] == pytest.approx(2 / 64)  # 2 x 0.5^6
    assert paired_comparison([1.0, 0.0], [1.0, 0.0])["p_value"] == 1.0  # nothing discordant
    assert paired_comparison([0.0] * 10, [1.0] * 10)["p_value"] == pytest.approx(2 / 1024)  # symmetric
    with pytest.raises(ValueError, match="same tasks"):
        paired_comparison([1.0], [1.0, 0.0])


def test_success_table_and_plots():
    table = success_table({"base": [1.0, 0.0], "a": [1.0, 1.0]}, rollouts_spent={"a": 64})
    assert table.to_dicts() == [
        {"system": "base", "n": 2, "success_rate": 0.5, "mean_reward": 0.5, "rollouts_spent": None},
        {"system": "a", "n": 2, "success_rate": 1.0, "mean_reward": 1.0, "rollouts_spent": 64},
    ]
    for png in (plot_success_by_system(table),
                plot_success_vs_rollouts({"TRACE": [(64, 0.6), (128, 0.7)], "GRPO": [(128, 0.5)]})):
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
