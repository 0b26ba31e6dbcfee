"""benchmarks/learning_curve.py runs end to end on the tiny model: one GRPO iteration, evaluated
before and after, JSON and PNG written; --select evaluates on train-side validation seeds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from trace_assets.train.heldout import HELD_OUT_OFFSET, TRAIN_VALIDATION_OFFSET

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "learning_curve.py"


def _module():
    spec = importlib.util.spec_from_file_location("learning_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra,offset", [([], HELD_OUT_OFFSET), (["--select", "--no-calibrate"], TRAIN_VALIDATION_OFFSET)])
def test_one_iteration_on_tiny_writes_json_and_png(tmp_path, monkeypatch, tiny_model_path, extra, offset):
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "curve"
    result = _module().main([
        "--agent", str(tiny_model_path), "--profile", "tiny", "--capability", "confirm_before_writing",
        "--iterations", "1", "--groups", "1", "--samples", "2", "--max-steps", "1", "--max-new-tokens", "4",
        "--eval-tasks", "2", "--eval-every", "1", "--seeds", "0", "--backend", "transformers", "--out", str(out), *extra])
    data = json.loads((tmp_path / "curve.json").read_text())
    assert data["eval"]["seed_offset"] == offset and data["mode"] == result["mode"]
    [seed] = data["seeds"]
    assert [p["iteration"] for p in seed["points"]] == [0, 1]
    before, after = seed["points"]
    assert before["rollouts"] == 0 and after["rollouts"] == 2 and after["generated_tokens"] > 0
    assert after["sequence_tokens"] > after["generated_tokens"] and after["train_wall_s"] > 0
    assert len(seed["history"]) == 1 and data["grpo"]["learning_rate"] > 0
    assert data["summary"]["success_gain_per_seed"] == {"0": after["success"] - before["success"]}
    assert ("calibration" in data["environment"]) == ("--no-calibrate" not in extra)
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "curve.envspec.json").read_text())["capability"]["name"] == "confirm_before_writing"
