"""Applying routed adapters: hard switching, merging, soft composition, and routed rollouts.

:class:`AdapterBank` holds every capability adapter on ONE base model as an unmerged PEFT model
(``PeftModel.from_pretrained`` for the first adapter, ``load_adapter`` for the rest). Contracts:

* ``use(name)`` activates one adapter for the ``with`` block (``set_adapter``), ``use(None)`` runs the
  base (``disable_adapter``); the previously active adapter is restored on exit. Unmerged LoRA
  computes ``W x + B A x * scaling`` on the fly: mathematically the merged ``W' = W + scaling B A``,
  and the base weights ``W`` are never written.
* ``merged(name)`` really merges (``merge_adapter``) for the block, e.g. for a faster forward, then
  unmerges. Unmerging subtracts the delta again, and ``(W + d) - d`` is not bit-exact in floating
  point, so the touched base weights are snapshotted (a clone of each LoRA-wrapped layer's base
  weight) before merging and copied back after unmerging whenever they differ. After the block the
  base weights are bit-identical to before (on the fp32 tiny model the plain unmerge is NOT exact,
  so the restore does real work). ``last_unmerge_exact`` records whether the plain unmerge was
  already exact. The snapshot costs one copy of the wrapped linear layers' weights while merged.
* ``composed(weights)`` builds ``W' = W + sum_c alpha_c * scaling_c * B_c A_c`` as a temporary adapter
  with PEFT ``add_weighted_adapter(..., combination_type="cat")``: ``A = cat(alpha_c scaling_c A_c)``,
  ``B = cat(B_c)``, rank ``sum r_c`` and scaling 1, so ``B A`` is exactly the weighted sum of the
  scaled deltas (no SVD truncation, unlike "svd"/"linear"). It is activated for the block and deleted
  on exit. A single weight of 1 is just ``use(name)``.

Soft composition (:func:`soft_weights`): keep the smallest set of labels (by descending probability)
whose cumulative probability reaches ``top_p``. The base label takes part in that selection (it is a
real option the router can prefer), but it has no delta to add: it is dropped from the merge, and the
kept adapters' alphas are renormalised to sum to 1 among themselves. If nothing but the base is kept
(the base alone reaches ``top_p``), the result is ``{}``, meaning "run the base".

:func:`route_and_run` groups tasks by what runs them (an adapter, a composition, or the base), runs
each group as ONE ``run_rollouts`` call with that adapter active and a FRESH backend from the
factory (a backend's prefix KV cache does not notice adapter switches), and returns the rollouts in
task order.
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from trace_assets.route.router import BASE_NAME, Decision

BackendFactory = Callable[[Any, Any], Any]
"""``(model, tokenizer) -> GenerationBackend``."""


def soft_weights(probs: Mapping[str | None, float], top_p: float) -> dict[str, float]:
    """Adapter weights (alpha) for soft composition; see the module docstring. ``{}`` means base.

    Ties in probability keep the dict order of ``probs``. ``top_p`` is clipped to (0, 1].
    """
    top_p = min(max(float(top_p), 1e-12), 1.0)
    ranked = sorted(enumerate(probs.items()), key=lambda item: (-item[1][1], item[0]))
    kept: list[tuple[str | None, float]] = []
    cumulative = 0.0
    for _, (name, p) in ranked:
        kept.append((name, float(p)))
        cumulative += float(p)
        if cumulative >= top_p - 1e-12:
            break
    adapters = [(name, p) for name, p in kept if name is not None]
    total = sum(p for _, p in adapters)
    if not adapters or total <= 0:
        return {}
    return {name: p / total for name, p in adapters}


def _lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


class AdapterBank:
    """Every capability adapter on one frozen base model, unmerged. See the module docstring.

    ``base_model`` is a plain (not yet PEFT-wrapped) causal LM; it is wrapped in place.
    ``adapters`` maps names to PEFT adapter folders (e.g. ``MlflowRegistry.resolve(cap, alias)[1]``).
    """

    def __init__(self, base_model: Any, adapters: Mapping[str, str | Path]) -> None:
        from peft import PeftModel

        if not adapters:
            raise ValueError("an AdapterBank needs at least one adapter")
        items = list(adapters.items())
        first_name, first_path = items[0]
        # from_pretrained injects LoRA layers into base_model in place; its weights stay untouched.
        self.model = PeftModel.from_pretrained(base_model, str(first_path), adapter_name=first_name, is_trainable=False)
        for name, path in items[1:]:
            self.model.load_adapter(str(path), adapter_name=name, is_trainable=False)
        self.model.eval()
        self.names: list[str] = [name for name, _ in items]
        self.last_unmerge_exact: bool | None = None

    @property
    def active(self) -> str:
        return self.model.active_adapter

    def _set(self, name: str) -> None:
        self.model.set_adapter(name, inference_mode=True)  # inference_mode: never re-enable grads

    @contextmanager
    def use(self, name: str | None) -> Iterator[Any]:
        """Run the block with adapter ``name`` active, or the base when ``None``. Yields the model."""
        if name is None:
            with self.model.disable_adapter():
                yield self.model
            return
        if name not in self.names:
            raise KeyError(f"unknown adapter {name!r}; the bank holds {self.names}")
        previous = self.active
        self._set(name)
        try:
            yield self.model
        finally:
            self._set(previous)

    def base_weight_snapshot(self, name: str | None = None) -> dict[str, torch.Tensor]:
        """Clones of the base weights of every LoRA-wrapped layer (only those ``name`` touches)."""
        snapshot = {}
        for layer_name, module in _lora_layers(self.model):
            if name is None or name in module.lora_A or name in getattr(module, "lora_embedding_A", {}):
                snapshot[layer_name] = module.get_base_layer().weight.detach().clone()
        return snapshot

    @contextmanager
    def merged(self, name: str) -> Iterator[Any]:
        """Adapter ``name`` truly merged into the base weights for the block; bit-exact restore after."""
        snapshot = self.base_weight_snapshot(name)
        with self.use(name):
            self.model.base_model.merge_adapter(adapter_names=[name])
            try:
                yield self.model
            finally:
                self.model.base_model.unmerge_adapter()
                exact = True
                modules = dict(_lora_layers(self.model))
                with torch.no_grad():
                    for layer_name, saved in snapshot.items():
                        weight = modules[layer_name].get_base_layer().weight
                        if not torch.equal(weight, saved):
                            exact = False
                            weight.copy_(saved)
                self.last_unmerge_exact = exact

    @contextmanager
    def composed(self, weights: Mapping[str, float]) -> Iterator[Any]:
        """``W + sum alpha_c scaling_c B_c A_c`` active for the block (``{}`` = base). See the docstring."""
        weights = {k: float(v) for k, v in weights.items() if v != 0}
        unknown = [k for k in weights if k not in self.names]
        if unknown:
            raise KeyError(f"unknown adapters {unknown}; the bank holds {self.names}")
        if not weights:
            with self.use(None) as model:
                yield model
            return
        if len(weights) == 1 and abs(next(iter(weights.values())) - 1.0) < 1e-12:
            with self.use(next(iter(weights))) as model:
                yield model
            return
        tmp = f"composed_{uuid.uuid4().hex[:10]}"
        previous = self.active
        self.model.add_weighted_adapter(list(weights), list(weights.values()), tmp, combination_type="cat")
        # add_weighted_adapter sets lora_alpha = r, i.e. scaling 1 -- unless the source configs use
        # rsLoRA (alpha / sqrt(r)). The alphas and source scalings already sit in A: force 1.
        for _, module in _lora_layers(self.model):
            if tmp in module.scaling:
                module.scaling[tmp] = 1.0
        try:
            self._set(tmp)
            yield self.model
        finally:
            self._set(previous)
            self.model.delete_adapter(tmp)


# ---------------------------------------------------------------- routed rollouts


@dataclass
class RouteGroup:
    """Tasks that run under the same adapter setting."""

    adapter: str | None
    """The single adapter to activate; ``None`` = base (or a composition, see ``weights``)."""
    weights: dict[str, float] | None = None
    """Soft composition weights when more than one adapter is mixed."""
    indices: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        if self.weights:
            return "+".join(f"{k}:{v:.4f}" for k, v in sorted(self.weights.items()))
        return BASE_NAME if self.adapter is None else self.adapter


def plan_groups(decisions: Sequence[Decision], *, soft_top_p: float | None = None) -> list[RouteGroup]:
    """Group task indices by what runs them, in order of first appearance.

    Hard routing (``soft_top_p=None``) groups by ``decision.choice``. Soft routing groups by the
    :func:`soft_weights` of ``decision.probs`` (rounded to 6 decimals); a composition that keeps a
    single adapter (or none) becomes a plain adapter (or base) group.
    """
    groups: dict[Any, RouteGroup] = {}
    for i, decision in enumerate(decisions):
        if soft_top_p is None:
            adapter, weights = decision.choice, None
        else:
            w = soft_weights(decision.probs, soft_top_p)
            if len(w) <= 1:
                adapter, weights = (next(iter(w)) if w else None), None
            else:
                adapter, weights = None, {k: round(v, 6) for k, v in w.items()}
        key = ("w", tuple(sorted(weights.items()))) if weights else ("a", adapter)
        groups.setdefault(key, RouteGroup(adapter=adapter, weights=weights)).indices.append(i)
    return list(groups.values())


def route_and_run(
    tasks: Sequence[Any],
    decisions: Sequence[Decision],
    env: Any,
    bank: AdapterBank,
    tokenizer: Any,
    config: Any,
    backend_factory: BackendFactory,
    *,
    soft_top_p: float | None = None,
) -> list[Any]:
    """Run every task under its routed adapter; one ``run_rollouts`` batch per group; task order kept.

    ``config`` is a :class:`~trace_assets.agent.rollout.RolloutConfig`. Each rollout's
    ``result.info`` is left as the environment wrote it; the caller knows the route from
    ``decisions`` (or :func:`plan_groups`).
    """
    from trace_assets.agent.rollout import run_rollouts

    if len(tasks) != len(decisions):
        raise ValueError(f"{len(tasks)} tasks but {len(decisions)} decisions")
    results: list[Any] = [None] * len(tasks)
    for group in plan_groups(decisions, soft_top_p=soft_top_p):
        ctx = bank.composed(group.weights) if group.weights else bank.use(group.adapter)
        with ctx as model:
            backend = backend_factory(model, tokenizer)  # fresh: no KV prefix cached under another adapter
            rollouts = run_rollouts(env, [tasks[i] for i in group.indices], backend, tokenizer, config)
        for i, rollout in zip(group.indices, rollouts):
            results[i] = rollout
    return results
