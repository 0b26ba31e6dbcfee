"""``MlflowRegistry``: MLflow as the adapter registry (our resource around ``MlflowClient``).

dagster-mlflow is not used. Defaults: tracking and registry URI ``sqlite:///<data>/mlflow/mlflow.db``,
artifacts under ``<data>/mlflow/artifacts`` (``TRACE_DATA_DIR``); both configurable. Serve the UI with::

    mlflow ui --backend-store-uri sqlite:///$PWD/data/mlflow/mlflow.db \\
              --default-artifact-root $PWD/data/mlflow/artifacts --port 5000

Contracts:

* One MLflow run per capability training, in experiment ``experiment`` (default ``"trace"``), tagged
  with the lineage (:data:`LINEAGE_TAGS`): capability, C* data version, EnvSpec hash, base model,
  Dagster run id.
* The adapter folder is logged under the run's ``adapter`` artifact path and registered as a
  version of ``trace-lora-<capability>`` with
  ``create_model_version(name, source=<run artifact uri>/adapter, run_id=...)``
  (``mlflow.register_model`` fails on a plain folder). The version carries the lineage tags; the
  aliases (default ``champion``) move to it. MLflow reserves the alias ``latest`` (setting it
  raises); it needs no setting: ``resolve(capability, "latest")`` is the newest version.
* ``resolve(capability, alias)`` returns ``(version, local adapter folder)``; for the default
  local store that is the artifact folder itself (nothing is copied).
* Metrics per iteration use the iteration as the MLflow step.
* Each ``synthetic_env`` materialization gets its own run (``log_environment``, tag
  ``trace.kind = synthetic_env``): the isolation matrix as a table, a heatmap PNG and JSON, the
  calibration rounds, the calibrated EnvSpec, and the blocking check's verdicts as metrics.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import unquote, urlparse

from dagster import ConfigurableResource
from pydantic import Field

from trace_assets import paths

EXPERIMENT = "trace"
ADAPTER_ARTIFACT = "adapter"
DEFAULT_ALIASES = ("champion",)
LATEST = "latest"
"""MLflow reserves this alias: it always means the newest version, and ``resolve`` honours it."""
ITERATION_METRICS = ("mean_reward", "success_rate", "loss", "clip_fraction", "grad_norm", "onpolicy_mean_abs", "onpolicy_kl",
                     "gen_time_s", "opt_time_s", "iter_time_s")
LINEAGE_TAGS = {
    "capability": "trace.capability",
    "c_star_version": "trace.c_star_version",
    "envspec_hash": "trace.envspec_hash",
    "base_model": "trace.base_model",
    "dagster_run_id": "dagster.run_id",
}
"""Lineage keys accepted by :meth:`MlflowRegistry.start_run` / ``register_adapter`` -> tag names."""


def model_name(capability: str) -> str:
    return f"trace-lora-{capability}"


@dataclass(frozen=True)
class RegisteredAdapter:
    name: str
    version: int
    run_id: str
    source: str
    aliases: tuple[str, ...]


def lineage_tags(lineage: Mapping[str, Any]) -> dict[str, str]:
    """Lineage keys (see :data:`LINEAGE_TAGS`) as MLflow tags; unknown keys are kept as ``trace.<key>``."""
    return {LINEAGE_TAGS.get(k, f"trace.{k}"): str(v) for k, v in lineage.items() if v is not None}


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _uri_to_path(uri: str) -> Path | None:
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path))
    return None


class MlflowRegistry(ConfigurableResource):
    """MLflow tracking + model registry for the LoRA adapters (see the module docstring)."""

    tracking_uri: str = Field(default="", description="Empty: sqlite:///<data>/mlflow/mlflow.db.")
    artifact_root: str = Field(default="", description="Empty: <data>/mlflow/artifacts.")
    experiment: str = Field(default=EXPERIMENT, description="MLflow experiment of the training runs.")

    # ---- plumbing -------------------------------------------------------------------------

    def uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        return f"sqlite:///{paths.sub('mlflow') / 'mlflow.db'}"

    def artifact_location(self) -> str:
        if "://" in self.artifact_root:
            return self.artifact_root
        root = Path(self.artifact_root) if self.artifact_root else paths.sub("mlflow", "artifacts")
        root.mkdir(parents=True, exist_ok=True)
        return root.resolve().as_uri()

    def client(self) -> Any:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri(), registry_uri=self.uri())

    def experiment_id(self) -> str:
        client = self.client()
        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(self.experiment, artifact_location=self.artifact_location())
        except Exception:  # created concurrently by another process
            found = client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    # ---- runs -----------------------------------------------------------------------------

    def start_run(self, capability: str, *, lineage: Mapping[str, Any] | None = None,
                  run_name: str | None = None, tags: Mapping[str, Any] | None = None) -> str:
        """Create a run for ``capability``'s training; returns its run id."""
        all_tags = {**lineage_tags({**(lineage or {}), "capability": capability}),
                    **{k: str(v) for k, v in (tags or {}).items()}}
        run = self.client().create_run(self.experiment_id(), run_name=run_name or f"grpo-{capability}", tags=all_tags)
        return run.info.run_id

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Nested dicts become dotted keys; lists are joined with commas."""
        from mlflow.entities import Param

        flat: dict[str, str] = {}
        _flatten("", params, flat)
        items = [Param(k, v[:6000]) for k, v in sorted(flat.items())]
        client = self.client()
        for start in range(0, len(items), 100):  # log_batch takes at most 100 params
            client.log_batch(run_id, params=items[start : start + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], *, step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items() if v is not None]
        if items:
            self.client().log_batch(run_id, metrics=items)

    def log_iteration(self, run_id: str, metrics: Any) -> None:
        """One training iteration (``IterationMetrics`` or a dict with ``iteration``); step = iteration."""
        data = metrics.to_dict() if hasattr(metrics, "to_dict") else dict(metrics)
        keys = [k for k in data if k != "iteration" and isinstance(data[k], (int, float))]
        self.log_metrics(run_id, {k: data[k] for k in keys}, step=int(data["iteration"]))

    def log_history(self, run_id: str, history: Iterable[Any]) -> None:
        for metrics in history:
            self.log_iteration(run_id, metrics)

    def log_adapter(self, run_id: str, folder: str | Path) -> str:
        """Log the adapter folder under ``adapter``; returns its artifact URI (the version source)."""
        client = self.client()
        client.log_artifacts(run_id, str(folder), ADAPTER_ARTIFACT)
        return f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{ADAPTER_ARTIFACT}"

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client().log_text(run_id, text, artifact_file)

    def log_training_curve(self, run_id: str, history: Sequence[Any], artifact_file: str = "training_curve.png") -> None:
        """A PNG of reward, success rate and loss per iteration."""
        self.client().log_image(run_id, training_curve_png(history), artifact_file=artifact_file)

    def log_summary_table(self, run_id: str, history: Sequence[Any], artifact_file: str = "training.md") -> None:
        self.log_text(run_id, markdown_table(history), artifact_file)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client().set_terminated(run_id, status=status)

    # ---- registry -------------------------------------------------------------------------

    def register_adapter(self, run_id: str, capability: str, source: str, *,
                         lineage: Mapping[str, Any] | None = None,
                         aliases: Sequence[str] = DEFAULT_ALIASES,
                         description: str | None = None) -> RegisteredAdapter:
        """A new version of ``trace-lora-<capability>`` from ``source``; moves ``aliases`` to it."""
        from mlflow.exceptions import MlflowException

        client, name = self.client(), model_name(capability)
        try:
            client.create_registered_model(name, description=f"LoRA adapters for capability {capability}")
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise
        tags = lineage_tags({**(lineage or {}), "capability": capability})
        version = client.create_model_version(name, source=source, run_id=run_id, tags=tags, description=description)
        for alias in aliases:
            if alias.lower() == LATEST:  # reserved by MLflow; implicit anyway
                continue
            client.set_registered_model_alias(name, alias, version.version)
        return RegisteredAdapter(name=name, version=int(version.version), run_id=run_id, source=source,
                                 aliases=tuple(aliases))

    def set_alias(self, capability: str, alias: str, version: int) -> None:
        self.client().set_registered_model_alias(model_name(capability), alias, str(version))

    def resolve(self, capability: str, alias: str = "champion") -> tuple[int, Path]:
        """``(version, local adapter folder)`` of ``trace-lora-<capability>@alias``.

        Local (file) stores return the stored folder itself; remote ones are downloaded once into
        ``<data>/mlflow/cache/<name>/<version>``.
        """
        client, name = self.client(), model_name(capability)
        if alias.lower() == LATEST:
            found = client.search_model_versions(f"name = '{name}'")
            if not found:
                raise LookupError(f"no version of {name} is registered")
            version = max(found, key=lambda v: int(v.version))
        else:
            version = client.get_model_version_by_alias(name, alias)
        local = _uri_to_path(version.source)
        if local is not None and local.is_dir():
            return int(version.version), local
        import mlflow.artifacts

        target = paths.sub("mlflow", "cache", name, str(version.version))
        if not any(target.iterdir()):
            mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(target),
                                                tracking_uri=self.uri())
        inner = target / ADAPTER_ARTIFACT
        return int(version.version), inner if inner.is_dir() else target

    def capabilities(self) -> list[str]:
        """Every capability with a registered ``trace-lora-<capability>`` model, sorted."""
        prefix = model_name("")
        return sorted(m.name[len(prefix):] for m in self.client().search_registered_models()
                      if m.name.startswith(prefix))

    def version_tags(self, capability: str, alias: str = "champion") -> dict[str, str]:
        return dict(self.client().get_model_version_by_alias(model_name(capability), alias).tags)

    def log_report(self, markdown: str, pngs: Mapping[str, bytes], metrics: Mapping[str, float]) -> str:
        """One MLflow run (``trace-report``) holding the evaluation report, its plots and metrics."""
        client = self.client()
        run = client.create_run(self.experiment_id(), run_name="trace-report", tags={"trace.kind": "report"})
        run_id = run.info.run_id
        for key, value in metrics.items():
            client.log_metric(run_id, key, float(value))
        client.log_text(run_id, markdown, "report.md")
        for name, png in pngs.items():
            self.log_png(run_id, png, f"{name}.png")
        client.set_terminated(run_id, "FINISHED")
        return run_id

    def log_png(self, run_id: str, png: bytes, artifact_file: str) -> None:
        """A PNG (bytes) as an image artifact of ``run_id``."""
        from PIL import Image

        self.client().log_image(run_id, Image.open(io.BytesIO(png)).convert("RGB"), artifact_file=artifact_file)

    def log_environment(self, capability: str, *, spec: Mapping[str, Any], isolation: Mapping[str, Any],
                        calibration: Mapping[str, Any], isolation_table: str, isolation_png: bytes,
                        lineage: Mapping[str, Any] | None = None) -> str:
        """One run per ``synthetic_env`` materialization (run name ``synthetic-env-<capability>``,
        tag ``trace.kind = synthetic_env`` and the lineage tags); returns its run id.

        Artifacts: ``isolation_matrix.md`` (the table), ``isolation_heatmap.png``, ``isolation.json``
        (every row), ``calibration.json`` (every round) and ``envspec.json`` (the calibrated spec).
        Metrics at step 0: ``isolation_passed``, ``calibration_passed``, ``check_passed`` (the
        blocking check: both), and per agent of the matrix ``isolation.success.<agent>`` and
        ``isolation.mean_reward.<agent>``."""
        import json

        tags = {**lineage_tags({**(lineage or {}), "capability": capability}), "trace.kind": "synthetic_env"}
        client = self.client()
        run_id = client.create_run(self.experiment_id(), run_name=f"synthetic-env-{capability}", tags=tags).info.run_id
        try:
            passed = {"isolation_passed": bool(isolation["passed"]), "calibration_passed": bool(calibration["passed"])}
            metrics = {**{k: float(v) for k, v in passed.items()}, "check_passed": float(all(passed.values()))}
            for row in isolation["rows"]:
                metrics[f"isolation.success.{row['agent']}"] = row["success"]
                metrics[f"isolation.mean_reward.{row['agent']}"] = row["mean_reward"]
            self.log_metrics(run_id, metrics, step=0)
            self.log_params(run_id, {"isolation_method": isolation.get("method", ""), "calibration_reason":
                                     calibration.get("reason", ""), "isolation_reason": isolation.get("reason", "")})
            client.log_text(run_id, isolation_table + "\n", "isolation_matrix.md")
            self.log_png(run_id, isolation_png, "isolation_heatmap.png")
            client.log_dict(run_id, dict(isolation), "isolation.json")
            client.log_dict(run_id, json.loads(json.dumps(calibration, default=str)), "calibration.json")
            client.log_dict(run_id, dict(spec), "envspec.json")
        except BaseException:
            self.end_run(run_id, "FAILED")
            raise
        self.end_run(run_id)
        return run_id

    # ---- the whole thing ------------------------------------------------------------------

    def log_training(self, capability: str, *, adapter_dir: str | Path, params: Mapping[str, Any],
                     history: Sequence[Any], lineage: Mapping[str, Any] | None = None,
                     aliases: Sequence[str] = DEFAULT_ALIASES,
                     metrics: Mapping[str, float] | None = None) -> RegisteredAdapter:
        """Run + params + per-iteration metrics + curve + table + adapter + registered version.

        The version is registered in every case (lineage); ``aliases`` are moved to it only as
        given: the promotion gate passes ``()`` for an adapter it does not promote. ``metrics`` are
        run-level figures (held-out success, fidelity), logged at step 0."""
        run_id = self.start_run(capability, lineage=lineage)
        try:
            self.log_params(run_id, params)
            self.log_history(run_id, history)
            if metrics:
                self.log_metrics(run_id, metrics, step=0)
            if history:
                self.log_training_curve(run_id, history)
            self.log_summary_table(run_id, history)
            source = self.log_adapter(run_id, adapter_dir)
            registered = self.register_adapter(run_id, capability, source, lineage=lineage, aliases=aliases)
        except BaseException:
            self.end_run(run_id, "FAILED")
            raise
        self.end_run(run_id)
        return registered


# ---------------------------------------------------------------- artifacts


def _rows(history: Sequence[Any]) -> list[dict[str, Any]]:
    return [m.to_dict() if hasattr(m, "to_dict") else dict(m) for m in history]


def markdown_table(history: Sequence[Any]) -> str:
    """A markdown table of the per-iteration metrics."""
    cols = ["iteration", *ITERATION_METRICS]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in _rows(history):
        cells = [f"{row.get(c, float('nan')):.4g}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                 for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def training_curve_png(history: Sequence[Any]) -> Any:
    """The training curve as a PIL image (mean reward and success rate; loss on a second axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    rows = _rows(history)
    its = [r["iteration"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(its, [r["mean_reward"] for r in rows], marker="o", label="mean reward")
    ax.plot(its, [r["success_rate"] for r in rows], marker="s", label="success rate")
    ax.set_xlabel("iteration")
    ax.set_ylim(-0.05, max(1.05, max((r["mean_reward"] for r in rows), default=1) + 0.05))
    loss_ax = ax.twinx()
    loss_ax.plot(its, [r["loss"] for r in rows], color="grey", linestyle="--", label="loss")
    loss_ax.set_ylabel("loss")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    buf.seek(0)
    return Image.open(buf).convert("RGB")
