"""Say so when the off-policy correction throws most of the batch away.

Why it exists: a rejection bound tuned for one gap masks almost everything under another (the
staleness ablation's geometric RS masked 80 % of its sequences, and one seed collapsed), and the
run looked healthy: loss and reward were logged as usual. :class:`MaskingWatch` is a training-loop
reporter that reads each step's ``rollout_corr/masked_frac_token`` / ``masked_frac_seq`` (what
every correction mask together removed, :mod:`agentrl.training.offpolicy`) and logs a warning
that names the preset, the mechanism that masked most and the knob to turn.

Guarantees: it warns on the first step that masks more than ``threshold`` of the tokens or of the
sequences, then at most once per ``every`` steps while that goes on (each warning counts the
steps since the last one); it never changes the run.
"""

from __future__ import annotations

import logging
from typing import Any

from agentrl.tracking import Reporter

__all__ = ["WARN_EVERY", "WARN_THRESHOLD", "MaskingWatch"]

logger = logging.getLogger(__name__)

WARN_THRESHOLD = 0.5
"""A step that masks more than this share of its tokens or sequences is "most of its samples"."""
WARN_EVERY = 10
"""Steps between two warnings while the masking goes on."""


def _rules_text(rules: Any) -> str:
    parts = []
    for r in rules:
        bound = f"in [{r.lower:g}, {r.upper:g}]" if r.lower is not None else f"<= {r.upper:g}"
        parts.append(f"{r.option.value} {bound}")
    return ", ".join(parts)


def knob_advice(correction_cfg: Any, metrics: dict[str, float]) -> str:
    """Which mechanism masked most this step and the knob that loosens it (``correction_cfg``:
    the run's ``correction.CorrectionConfig``)."""
    c = correction_cfg
    options = [
        (
            "rs_masked_frac_token",
            bool(c.rs_rules),
            f"loosen algorithm.correction.rs_rules (now {_rules_text(c.rs_rules)})",
        ),
        (
            "m2po_masked_frac_token",
            c.m2po_threshold is not None,
            f"raise algorithm.correction.m2po_threshold (now {c.m2po_threshold})",
        ),
        (
            "stale_rs_masked_frac_token",
            c.stale_rs_multiplier is not None,
            f"raise algorithm.correction.stale_rs_multiplier (now {c.stale_rs_multiplier})",
        ),
        (
            "opsm_masked_frac_token",
            c.opsm_threshold is not None,
            f"raise algorithm.correction.opsm_threshold (now {c.opsm_threshold})",
        ),
    ]
    active = [(metrics.get(f"rollout_corr/{key}", 0.0), text) for key, on, text in options if on]
    if not active:
        return "check algorithm.correction"
    return max(active, key=lambda a: a[0])[1]


class MaskingWatch(Reporter):
    """Warns (``logging.WARNING``) when a step's correction masks most of its samples."""

    def __init__(
        self,
        correction_section: Any,
        *,
        threshold: float = WARN_THRESHOLD,
        every: int = WARN_EVERY,
        log: logging.Logger | None = None,
    ) -> None:
        self.preset = correction_section.preset
        self.config = correction_section.to_correction_config()
        self.threshold = threshold
        self.every = max(1, every)
        self.log = log or logger
        self._last_warned: int | None = None
        self._over_since = 0
        self.warnings = 0

    def on_step(self, step: int, version: int, metrics: dict[str, float], trajs: list[Any]) -> None:
        """Check one step's masked fractions; warn when due."""
        tok = metrics.get("rollout_corr/masked_frac_token", 0.0)
        seq = metrics.get("rollout_corr/masked_frac_seq", 0.0)
        if max(tok, seq) <= self.threshold:
            return
        self._over_since += 1
        if self._last_warned is not None and step - self._last_warned < self.every:
            return
        self.log.warning(self.message(step, tok, seq, metrics))
        self._last_warned, self._over_since = step, 0
        self.warnings += 1

    def message(self, step: int, tok: float, seq: float, metrics: dict[str, float]) -> str:
        """The warning's text."""
        name = f"preset {self.preset!r}" if self.preset else "the configured fields"
        since = (
            f"; {self._over_since} steps since the last warning masked more than "
            f"{self.threshold:.0%}"
            if self._last_warned is not None
            else ""
        )
        skipped = (
            " Every sequence was masked, so this step's update was skipped."
            if metrics.get("actor/skipped_all_masked", 0.0) >= 1.0
            else ""
        )
        return (
            f"step {step}: the off-policy correction ({name} of algorithm.correction) masked "
            f"{tok:.0%} of the response tokens and {seq:.0%} of the sequences{since}.{skipped} "
            f"Most of the batch is not learned from: {knob_advice(self.config, metrics)}, or "
            "lower trainer.max_staleness (off-policy gap: rollout_corr/k3_kl "
            f"{metrics.get('rollout_corr/k3_kl', float('nan')):.3g}). This warning repeats at "
            f"most every {self.every} steps."
        )
