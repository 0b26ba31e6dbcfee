"""TRACE: capability-targeted agentic training as a declarative Dagster pipeline."""
