"""agentrl evaluation: held-out statistics (mean_at_N, best_at_k, maj_at_k, pass_at_k) and the eval runner.

``agentrl.evaluation.stats`` is pure (numpy only); ``agentrl.evaluation.report`` runs tasks
through an AgentLoopManager-like ``generate`` and builds an :class:`EvalReport`. Importing this
package imports no server, tokenizer or tracker. Formulas: docs/tracking.md.
"""

from agentrl.evaluation.report import (
    EpisodeGenerator,
    EvalReport,
    TaskResult,
    answer_of,
    evaluate,
    is_correct,
    log_report,
    report_from_trajectories,
)
from agentrl.evaluation.stats import (
    ValSample,
    bootstrap_metric,
    default_ks,
    flatten_statistics,
    group_statistics,
    majority_value,
    pass_at_k,
    subset_sizes,
    validation_statistics,
)

__all__ = [
    "EpisodeGenerator",
    "EvalReport",
    "TaskResult",
    "ValSample",
    "answer_of",
    "bootstrap_metric",
    "default_ks",
    "evaluate",
    "flatten_statistics",
    "group_statistics",
    "is_correct",
    "log_report",
    "majority_value",
    "pass_at_k",
    "report_from_trajectories",
    "subset_sizes",
    "validation_statistics",
]
