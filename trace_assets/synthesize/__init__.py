"""TRACE Step 2 (Synthesize): a validated, capability-targeted synthetic environment per capability.

Modules: ``spec`` (the EnvSpec JSON document: schema, fidelity, hash), ``rubric`` (weighted checks with
partial credit), ``env`` (``SyntheticEnv`` / ``SyntheticEpisode``: the spec interpreted on the target's
machinery), ``template`` (offline default synthesizer), ``llm_synth`` (LLM synthesizer with bounded
repair), ``validate`` (fidelity, gold-solvability, calibration, isolation against ablated experts),
``build`` (synthesize, check, calibrate and isolate, as the ``synthetic_env`` asset does), ``prefix``
(user environments' decision points: logged trajectories replayed up to their first LACKING step).

A spec is data, never code: nothing in it is evaluated or executed. A stored environment is an
EnvSpec or, for a target without an expert, a logged-prefix document (``prefix.logged_spec``);
:func:`environment_of` reads either.
"""

from trace_assets.synthesize.env import SyntheticEnv, SyntheticEpisode
from trace_assets.synthesize.llm_synth import SynthesisError, llm_spec
from trace_assets.synthesize.prefix import LoggedPrefixEnv, PrefixError, is_logged, logged_prefixes, logged_spec
from trace_assets.synthesize.spec import SpecError, envspec_schema, fidelity, load_spec, schema_errors, spec_hash, validate_spec
from trace_assets.synthesize.template import template_spec
from trace_assets.synthesize.validate import (
    CALIBRATION_OFFSET,
    CalibrationReport,
    calibrate,
    calibration_rollout_seed,
    check_spec,
    gold_solvable,
    isolation_heatmap,
    isolation_markdown,
    isolation_matrix,
)



def environment_of(spec: dict, target) -> "SyntheticEnv | LoggedPrefixEnv":
    """The environment a stored spec describes: a ``LoggedPrefixEnv`` for a logged-prefix document,
    else the EnvSpec's ``SyntheticEnv``. Every reader of ``synthetic_env``'s spec goes through it."""
    return LoggedPrefixEnv.from_spec(spec, target) if is_logged(spec) else SyntheticEnv(spec, target)


def example_conversations(env: "SyntheticEnv | LoggedPrefixEnv", tasks: list) -> list[list[dict]]:
    """One conversation per task of ``env`` that shows its capability at work: the target expert's,
    played through the environment, or, for a logged environment (no expert), the logged prefix."""
    if isinstance(env, LoggedPrefixEnv):
        return [env.start(task).initial_messages() for task in tasks]
    from trace_assets.envs.base import target_hook

    expert = target_hook(env.target, "expert")
    return [expert(task, via=env)[0] for task in tasks]


__all__ = [
    "CALIBRATION_OFFSET", "CalibrationReport", "LoggedPrefixEnv", "PrefixError", "SpecError", "SynthesisError",
    "SyntheticEnv", "SyntheticEpisode", "calibrate", "environment_of", "example_conversations", "is_logged", "logged_spec", "calibration_rollout_seed", "check_spec", "envspec_schema", "fidelity",
    "gold_solvable", "isolation_heatmap", "isolation_markdown", "isolation_matrix", "llm_spec", "load_spec", "logged_prefixes",
    "schema_errors", "spec_hash", "template_spec", "validate_spec",
]
