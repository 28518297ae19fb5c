"""The ``tracking`` section: experiment tracking (MLflow) of an RL or SFT run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config.section import Section

__all__ = ["TrackingConfig"]


class TrackingConfig(Section):
    """Experiment tracking (MLflow)."""

    enabled: bool = True
    """Track the run (params, metrics, artifacts)."""
    backend: Literal["mlflow", "none"] = "mlflow"
    """Tracking backend."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None = $MLFLOW_TRACKING_URI, else a local store under ./mlruns."""
    experiment: str = "agentrl"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; None = generated."""
    log_every: int = Field(default=1, ge=1)
    """Log metrics every N steps."""
    num_sample_trajectories: int = Field(default=4, ge=0)
    """Sample episodes logged at step 1 and every total_steps // 5 steps (a table and traces)."""
