"""Resident memory of a vLLM engine before and after ``VLLMEngine.close``, and of the engine that
replaces it in another dtype (what an evaluation's float32 fallback does since
``ModelResource`` holds one dtype's engines at a time).

RSS is read from ``/proc/self/statm`` after ``gc.collect`` and ``malloc_trim(0)``. The ratio printed
last is the closed engine's residue against the live engine, measured in the same run.

    .venv/bin/python benchmarks/engine_release.py [--kv-gb 2.0] [--eager]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_gb() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-gb", type=float, default=2.0)
    ap.add_argument("--eager", action="store_true", help="skip torch.compile (the tests' engines)")
    args = ap.parse_args()

    from trace_assets.agent.model import ensure_demo_model
    from trace_assets.agent.vllm_backend import VLLMEngine, VLLMOptions

    path = str(ensure_demo_model())
    probe = [[1, 2, 3, 4, 5] * 50]
    rows = [("start, no engine", rss_gb())]
    options = VLLMOptions(enable_lora=False, dtype="bfloat16", enforce_eager=args.eager, kv_cache_gb=args.kv_gb)
    engine = VLLMEngine.shared(path, options)
    engine.score(probe)
    rows.append(("bf16 engine, after one score", rss_gb()))
    VLLMEngine.close_other_dtypes(path, "float32")
    del engine
    rows.append(("after close", rss_gb()))
    engine = VLLMEngine.shared(path, VLLMOptions(**{**options.__dict__, "dtype": "float32"}))
    engine.score(probe)
    rows.append(("float32 engine started after it", rss_gb()))
    for name, value in rows:
        print(f"{name:36s} {value:6.2f} GB")
    live, closed = rows[1][1], rows[2][1]
    print(f"closed / live: {closed / live:.2f} (the engine's own share freed: {(live - closed) / (live - rows[0][1]):.0%})")


if __name__ == "__main__":
    main()
