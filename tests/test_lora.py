"""The shared-prefix path of token_logprobs equals the plain path, values and gradients."""

from __future__ import annotations

import torch

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


def test_shared_prefix_matches_plain_path(tiny_model_path):
    model = _peft(tiny_model_path)
    ids, att, tgt = _batch()
    assert shared_prefix_len(ids, att) == 48
    plain = token_logprobs(model, ids, att, tgt, min_shared_prefix=10_000)
    plain.sum().backward()
    g_plain = _grads(model)
    model.zero_grad()
    shared = token_logprobs(model, ids, att, tgt, min_shared_prefix=16)
    shared.sum().backward()
    g_shared = _grads(model)
    assert plain.shape == shared.shape == (int(tgt[:, 1:].sum()),)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert g_plain.keys() == g_shared.keys() and g_plain
    for name in g_plain:
        torch.testing.assert_close(g_shared[name], g_plain[name], atol=1e-4, rtol=1e-3)


def test_no_shared_prefix_and_single_row(tiny_model_path):
    model = _peft(tiny_model_path)
    ids, att, tgt = _batch(prefix_len=0, suffix_len=30)
    assert shared_prefix_len(ids, att) < 16
    assert token_logprobs(model, ids, att, tgt).shape == (int(tgt[:, 1:].sum()),)
    one = token_logprobs(model, ids[:1], att[:1], tgt[:1])
    assert torch.isfinite(one).all()
