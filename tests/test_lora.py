"""token_logprobs: the shared-prefix path (broadcast or packed) equals the plain path, and the
shape buckets change nothing but float rounding, values and gradients."""

from __future__ import annotations

import torch

import pytest

from trace_assets.agent import lora
from trace_assets.agent.lora import add_lora, lora_config, shared_prefix_len, token_logprobs
from trace_assets.agent.model import load_model


def _peft(tiny_model_path):
    model, _ = load_model(str(tiny_model_path))
    peft_model = add_lora(model, lora_config())
    torch.manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # non-zero B so the adapter matters
            torch.nn.init.normal_(param, std=0.05)
    return peft_model


def _batch(prefix_len=48, suffix_len=20, rows=3):
    torch.manual_seed(0)
    prefix = torch.randint(5, 2000, (1, prefix_len)).expand(rows, -1)
    ids = torch.cat([prefix, torch.randint(5, 2000, (rows, suffix_len))], dim=1)
    att = torch.ones_like(ids)
    att[1, -4:] = 0
    att[2, -11:] = 0
    tgt = torch.zeros_like(ids)
    tgt[:, prefix_len + 2:] = 1
    return ids, att, tgt * att


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _views(monkeypatch) -> list[int]:
    """Count the prefix views token_logprobs builds (one per layer when the prefix path runs)."""
    made: list[int] = []

    class Counted(lora._PrefixView):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lora, "_PrefixView", Counted)
    return made


def test_shared_prefix_matches_plain_path(tiny_model_path, monkeypatch):
    model = _peft(tiny_model_path)
    ids, att, tgt = _batch(prefix_len=150)
    assert shared_prefix_len(ids, att) == 150  # runs as a 128-token prefix (a shape bucket)
    views = _views(monkeypatch)
    plain = token_logprobs(model, ids, att, tgt, min_shared_prefix=10_000)
    plain.sum().backward()
    g_plain = _grads(model)
    model.zero_grad()
    assert not views
    shared = token_logprobs(model, ids, att, tgt, min_shared_prefix=16)
    shared.sum().backward()
    g_shared = _grads(model)
    assert views, "the shared-prefix path did not run"
    assert plain.shape == shared.shape == (int(tgt[:, 1:].sum()),)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert g_plain.keys() == g_shared.keys() and g_plain
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_packed_suffixes_match_the_plain_path(tiny_model_path, checkpointed):
    """``pack``: rows of very different lengths after a shared prefix run as one block-diagonal
    sequence; the values and gradients are the plain path's (fp32, float rounding only), whatever
    the widths, also under gradient checkpointing (the prefix caches replay)."""
    from trace_assets.agent.lora import enable_gradient_checkpointing

    model = _peft(tiny_model_path)
    if checkpointed:
        enable_gradient_checkpointing(model)
    model.train()
    ids, att, tgt = _batch(prefix_len=150, suffix_len=90, rows=4)
    att[1, -70:] = 0  # rows of 240, 170, 229 and 240 tokens
    tgt = tgt * att
    tgt[0, 20:30] = 1  # targets inside the shared prefix count too
    runs = {}
    for pack in (False, True):
        model.zero_grad()
        values = token_logprobs(model, ids, att, tgt, min_shared_prefix=10_000 if not pack else 16, pack=pack)
        values.sum().backward()
        runs[pack] = values.detach(), _grads(model)
    (plain, g_plain), (packed, g_packed) = runs[False], runs[True]
    assert plain.shape == packed.shape == (int(tgt[:, 1:].sum()),)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    assert g_plain.keys() == g_packed.keys() and g_plain
    for name in g_plain:
        torch.testing.assert_close(g_packed[name], g_plain[name], atol=1e-4, rtol=1e-3)


def test_auto_packing_packs_where_the_estimate_says_it_is_cheaper(tiny_model_path, monkeypatch):
    """``pack="auto"``: short ragged rows after a long prompt are packed (the padding is most of
    the padded batch), long rows are not (the packed attention's square dominates), and rows of one
    length never are (packing removes no padding then). Either way the values are the plain path's."""
    model = _peft(tiny_model_path)
    config = model.get_base_model().config
    assert lora.pack_pays([60, 30, 10, 5], 512, 640, config)
    assert not lora.pack_pays([1500, 1300, 1100, 900, 700], 1024, 2560, config)
    assert not lora.pack_pays([128] * 4, 512, 640, config)
    packed: list[int] = []
    real = lora._packed_hidden
    monkeypatch.setattr(lora, "_packed_hidden", lambda *a, **k: (packed.append(1), real(*a, **k))[1])
    for short_rows, expect_packed in ((3, True), (0, False)):  # rows of 356 tokens, or of 261
        ids, att, tgt = _batch(prefix_len=256, suffix_len=100, rows=4)
        att[:] = 1
        att[4 - short_rows:, -95:] = 0
        tgt = tgt * att
        packed.clear()
        auto = token_logprobs(model, ids, att, tgt, pack="auto")
        assert bool(packed) == expect_packed
        torch.testing.assert_close(auto, token_logprobs(model, ids, att, tgt, min_shared_prefix=10_000),
                                   atol=1e-5, rtol=1e-5)


def test_no_shared_prefix_and_single_row(tiny_model_path):
    model = _peft(tiny_model_path)
    ids, att, tgt = _batch(prefix_len=0, suffix_len=30)
    assert shared_prefix_len(ids, att) < 16
    assert token_logprobs(model, ids, att, tgt).shape == (int(tgt[:, 1:].sum()),)
    one = token_logprobs(model, ids[:1], att[:1], tgt[:1])
    assert torch.isfinite(one).all()


@pytest.mark.parametrize("bf16", [False, True])
def test_shape_buckets_leave_log_probs_and_gradients_as_they_were(tiny_model_path, monkeypatch, bf16):
    """Widths padded to SHAPE_BUCKET (and a prefix cut to one) against the unpadded computation
    (bucket 1), on ragged rows with a shared prefix, as GRPO's micro-batches are."""
    from trace_assets.agent.lora import autocast

    model = _peft(tiny_model_path)
    ids, att, tgt = _batch(prefix_len=150, suffix_len=37)
    assert ids.shape[1] % lora.SHAPE_BUCKET

    def run():
        model.zero_grad()
        with autocast(bf16):
            values = token_logprobs(model, ids, att, tgt, min_shared_prefix=16)
        values.float().sum().backward()
        return values.detach().float(), _grads(model)

    bucketed, g_bucketed = run()
    monkeypatch.setattr(lora, "SHAPE_BUCKET", 1)
    exact, g_exact = run()
    # fp32 measured 2e-6 nats and 1e-6 of a gradient's scale; bf16 (other blocking, other rounding)
    # 0.015 nats and 1 % of the scale, against log-probs spread over 1.5 nats
    nats, grad = (0.03, 0.03) if bf16 else (1e-5, 1e-5)
    assert bucketed.shape == exact.shape == (int(tgt[:, 1:].sum()),)
    torch.testing.assert_close(bucketed, exact, atol=nats, rtol=0)
    assert g_exact.keys() == g_bucketed.keys() and g_exact
    for name in g_exact:
        scale = g_exact[name].abs().max()
        assert (g_bucketed[name] - g_exact[name]).abs().max() <= grad * scale, name


def _lora_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_a_seeded_lora_init_depends_on_the_seed_only(tiny_model_path):
    """Same seed, same adapter, whatever torch's global RNG holds; another seed, another adapter;
    B = 0, so a fresh adapter changes nothing; the global RNG is left as it was."""
    torch.manual_seed(123)
    first = _lora_weights(add_lora(load_model(str(tiny_model_path))[0], lora_config(), seed=5))
    torch.manual_seed(999)
    torch.rand(17)
    model = load_model(str(tiny_model_path))[0]
    state = torch.get_rng_state()
    again = _lora_weights(add_lora(model, lora_config(), seed=5))
    assert torch.equal(torch.get_rng_state(), state)
    other = _lora_weights(add_lora(load_model(str(tiny_model_path))[0], lora_config(), seed=6))
    assert first.keys() == again.keys() == other.keys() and first
    a_keys = [k for k in first if "lora_A" in k]
    assert a_keys and all(torch.equal(first[k], again[k]) for k in first)
    assert all(not torch.equal(first[k], other[k]) for k in a_keys)
    assert all(torch.count_nonzero(v) == 0 for k, v in first.items() if "lora_B" in k)
    # each layer gets its own draw, and the scale of PEFT's default (Kaiming uniform, a = sqrt(5))
    assert not torch.equal(first[a_keys[0]], first[a_keys[1]])
    bound = 1 / first[a_keys[0]].shape[1] ** 0.5
    assert first[a_keys[0]].abs().max() <= bound and first[a_keys[0]].abs().max() > bound / 2


def test_grpo_initializes_its_adapter_from_the_training_seed(tiny_model_path, tmp_path):
    from dataclasses import replace

    from trace_assets.agent.model import load_model as load
    from trace_assets.envs import get_environment
    from trace_assets.settings import TINY as TINY_SETTINGS
    from trace_assets.train.grpo import LORA_INIT, GRPOTrainer

    TINY = TINY_SETTINGS.train.grpo

    env = get_environment("retail")
    model, tokenizer = load(str(tiny_model_path))
    torch.manual_seed(1)
    one = _lora_weights(GRPOTrainer(model, tokenizer, env, replace(TINY, seed=3), tmp_path / "a").model)
    model, tokenizer = load(str(tiny_model_path))
    torch.manual_seed(2)
    two = _lora_weights(GRPOTrainer(model, tokenizer, env, replace(TINY, seed=3), tmp_path / "b").model)
    model, tokenizer = load(str(tiny_model_path))
    three = _lora_weights(GRPOTrainer(model, tokenizer, env, replace(TINY, seed=4), tmp_path / "c").model)
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert any(not torch.equal(one[k], three[k]) for k in one)
    assert TINY.identity()["lora_init"] == LORA_INIT
