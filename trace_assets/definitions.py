"""The Dagster code location: ``defs`` is what ``dagster dev`` and ``make demo`` load.

``build_definitions(settings)`` is the factory; tests call it with the ``tiny`` profile.
"""

from __future__ import annotations

from dagster import AssetSelection, Definitions, FilesystemIOManager, define_asset_job, failure_hook, success_hook

from resources.llm import AnalystResource, SynthesizerResource
from resources.mlflow_registry import MlflowRegistry
from resources.models import ModelResource
from resources.store import TraceStore
from trace_assets import paths
from trace_assets.assets.experiment import (
    EXPERIMENT_JOB,
    EXPERIMENT_PER_CAPABILITY_SEED,
    EXPERIMENT_PER_SEED,
    EXPERIMENT_SELECTION,
    EXPERIMENT_TRAINING_JOB,
    GROUP as EXPERIMENT_GROUP,
    build_experiment_assets,
)
from trace_assets.assets.foundation import build_foundation_assets
from trace_assets.assets.identify import build_identify_assets
from trace_assets.assets.synthesize import build_synthesize_assets
from trace_assets.assets.route import build_route_assets
from trace_assets.assets.train import build_train_assets
from trace_assets.settings import Settings, load_settings

MAIN_JOB = "trace_main"


def build_definitions(settings: Settings | None = None) -> Definitions:
    settings = settings or load_settings()
    everything = [
        *build_foundation_assets(settings), *build_identify_assets(settings),
        *build_synthesize_assets(settings), *build_train_assets(settings), *build_route_assets(settings),
        *build_experiment_assets(settings),
    ]
    assets = [a for a in everything if not _is_check(a)]
    checks = [a for a in everything if _is_check(a)]
    experiment = AssetSelection.groups(EXPERIMENT_GROUP)
    release = {_release_after_success, _release_after_failure}
    main_job = define_asset_job(MAIN_JOB, selection=AssetSelection.all() - experiment, description="The whole TRACE loop.",
                                hooks=release)
    # A Dagster asset job holds one partitioning: per seed (+ the report), and per (capability, seed).
    # `make experiment` runs both, and what they need, through the wave runner (EXPERIMENT_SELECTION).
    experiment_job = define_asset_job(
        EXPERIMENT_JOB, selection=AssetSelection.assets(*EXPERIMENT_PER_SEED), hooks=release,
        description="make experiment, per seed: the baselines, the evaluation of every system, and the report.")
    training_job = define_asset_job(
        EXPERIMENT_TRAINING_JOB, selection=AssetSelection.assets(*EXPERIMENT_PER_CAPABILITY_SEED), hooks=release,
        description="make experiment, per (capability, seed): the calibrated environment and the adapter.")
    from sensors import build_operate_definitions  # the landing sensor, nightly schedule, automation

    operate = build_operate_definitions(settings)
    return Definitions(
        assets=assets, asset_checks=checks, jobs=[main_job, experiment_job, training_job, *operate["jobs"]], resources=build_resources(settings),
        sensors=operate["sensors"], schedules=operate["schedules"],
    )


# Steps that load no model and allocate little: a full ``gc.collect`` (~0.5 s in a process holding
# Dagster and torch) after each would only cost time. Their asset checks are named ``<asset>_<check>``.
_LIGHT_STEPS = ("task_splits", "trajectory_splits", "capability_dictionary", "label_matrix", "capability_stats",
                "selected_capabilities", "capability_spec")


def _release(context) -> None:
    from trace_assets.agent.model import release_memory

    name = context.op.name
    if not any(name == light or name.startswith(light + "_") for light in _LIGHT_STEPS):
        release_memory()


@success_hook
def _release_after_success(context) -> None:
    """A step's freed memory goes back to the OS before the next step of an in-process run."""
    _release(context)


@failure_hook
def _release_after_failure(context) -> None:
    _release(context)


def build_resources(settings: Settings) -> dict:
    """The resources every asset uses, configured from ``settings``."""
    return {
        "models": ModelResource(
            base_model=settings.base_model, generation_batch_size=settings.rollout.batch_size,
            generation_backend=settings.generation.backend, vllm_enforce_eager=settings.generation.vllm_enforce_eager,
            vllm_kv_cache_gb=settings.generation.vllm_kv_cache_gb, vllm_dtype=settings.generation.vllm_dtype,
            # The engine holds the longest context any step asks for (tau2_airline's prompt is ~3.7k).
            vllm_max_model_len=max(4096, settings.rollout.max_context_tokens, settings.train.grpo.max_context_tokens),
        ),
        "store": TraceStore(),
        "analyst": AnalystResource(
            kind=settings.analyst.kind, base_url=settings.analyst.base_url, model=settings.analyst.model,
            temperature=settings.analyst.temperature, max_retries=settings.analyst.max_retries,
        ),
        "synthesizer": SynthesizerResource(
            kind=settings.synthesis.kind, base_url=settings.synthesis.base_url, model=settings.synthesis.model,
            max_retries=settings.synthesis.max_retries,
        ),
        "mlflow": MlflowRegistry(),
        "io_manager": FilesystemIOManager(base_dir=str(paths.sub("dagster", "io"))),
    }


def _is_check(obj) -> bool:
    from dagster import AssetChecksDefinition

    return isinstance(obj, AssetChecksDefinition)


defs = build_definitions()
