"""The fields and presets of the newer off-policy variants (M2PO, OPSM, staleness RS, loglinear)."""

from __future__ import annotations

import pytest

import correction
from correction import CorrectionConfig, ProximalMethod

NEW_PRESETS = (
    "decoupled_m2po",
    "decoupled_loglinear",
    "decoupled_token_is_opsm",
    "bypass_ppo_clip_opsm",
    "decoupled_token_is_stale_rs",
)


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_presets_round_trip_and_say_what_they_need(name: str) -> None:
    cfg = correction.preset(name)
    assert CorrectionConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.enabled
    if name == "decoupled_loglinear":
        assert cfg.proximal is ProximalMethod.LOGLINEAR
        assert not cfg.needs_old_log_probs and not cfg.needs_train_log_probs
    else:
        assert cfg.masks_before_update and cfg.needs_train_log_probs
        assert cfg.needs_old_log_probs == (not cfg.bypass)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("m2po_threshold", 0.0, "m2po_threshold must be null or a finite number > 0"),
        ("opsm_threshold", -1.0, "opsm_threshold must be null or a finite number >= 0"),
        ("stale_rs_multiplier", float("nan"), "stale_rs_multiplier must be null or a finite"),
        ("stale_rs_floor", None, "stale_rs_floor must be a finite number >= 0"),
        ("proximal", "exact", "proximal='exact' is not a proximal method"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CorrectionConfig.from_dict({field: value})


@pytest.mark.parametrize(
    "extra",
    [
        {"m2po_threshold": 0.04},
        {"opsm_threshold": 0.1},
        {"stale_rs_multiplier": 2.0},
        {"is_batch_normalize": True},
        {"rs_rules": [{"option": "token_k1", "upper": 2.0}]},
    ],
)
def test_loglinear_refuses_what_needs_pi_old_before_the_update(extra: dict) -> None:
    with pytest.raises(ValueError, match=r"proximal='loglinear' forms π_old inside the update"):
        CorrectionConfig.from_dict({"is_level": "token", "proximal": "loglinear", **extra})
    with pytest.raises(ValueError, match="decoupled-mode option"):
        CorrectionConfig(bypass=True, proximal="loglinear")
