"""Off-policy correction math for asynchronous RL (torch only).

See ``docs/correction.md`` for the formulas. This package imports nothing but torch (and numpy).
"""

from correction._agg import LOSS_AGG_MODES, LossAggMode, agg_loss

__all__ = ["LOSS_AGG_MODES", "LossAggMode", "agg_loss"]
