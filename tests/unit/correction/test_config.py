"""CorrectionConfig validation, dict round-trips and presets."""

from __future__ import annotations

import json
import pickle

import pytest

import correction
from correction import PRESETS, CorrectionConfig, ISLevel, LossType, RejectionRule, RSOption

REQUIRED_PRESETS = {
    "disabled",
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "bypass_ppo_clip",
    "bypass_pg_is",
    "icepop",
}


def test_required_presets_exist_and_are_typed() -> None:
    assert set(PRESETS) >= REQUIRED_PRESETS
    for name, cfg in PRESETS.items():
        assert isinstance(cfg, CorrectionConfig), name
        assert correction.preset(name) is cfg


def test_preset_contents() -> None:
    assert not correction.preset("disabled").enabled
    assert correction.preset("decoupled_token_is").is_level is ISLevel.TOKEN
    assert correction.preset("decoupled_seq_is").is_level is ISLevel.SEQUENCE
    icepop = correction.preset("icepop")
    assert icepop.rs_rules == (RejectionRule(RSOption.TOKEN_K1, 2.0, 0.5),)
    geo = correction.preset("decoupled_geo_rs")
    assert geo.rs_rules[0].option is RSOption.SEQ_MEAN_K1
    assert geo.rs_rules[0].lower == pytest.approx(0.999)
    bypass = correction.preset("bypass_ppo_clip")
    assert bypass.bypass and bypass.loss_type is LossType.PPO_CLIP and bypass.is_level is None
    assert not bypass.needs_old_log_probs
    pg = correction.preset("bypass_pg_is")
    assert pg.loss_type is LossType.REINFORCE and pg.is_level is ISLevel.SEQUENCE


def test_unknown_preset_lists_all_and_closest() -> None:
    with pytest.raises(ValueError, match=r"Did you mean 'icepop'.*decoupled_token_is"):
        correction.preset("icepo")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip_is_json_able(name: str) -> None:
    cfg = PRESETS[name]
    data = json.loads(json.dumps(cfg.to_dict()))
    assert CorrectionConfig.from_dict(data) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_strings_convert_to_enums() -> None:
    cfg = CorrectionConfig(
        bypass=True,
        loss_type="reinforce",  # type: ignore[arg-type]  # strings are accepted and converted
        is_level="geometric",  # type: ignore[arg-type]
        rs_rules=(RejectionRule("seq_max_k3", 0.5),),
    )
    assert cfg.loss_type is LossType.REINFORCE and cfg.is_level is ISLevel.GEOMETRIC
    assert cfg.to_dict()["is_level"] == "geometric"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"is_level": "tok"}, "CorrectionConfig.is_level='tok'"),
        ({"is_threshold": 0}, "CorrectionConfig.is_threshold"),
        ({"is_threshold": float("inf")}, "CorrectionConfig.is_threshold"),
        ({"loss_type": "ppo"}, "CorrectionConfig.loss_type='ppo'"),
        ({"loss_type": "reinforce"}, "applies only in bypass mode"),
        ({"bypass": True, "is_level": "token"}, "count it twice"),
        ({"bypass": "yes"}, "CorrectionConfig.bypass"),
        ({"rs_rules": ("token_k1",)}, "CorrectionConfig.rs_rules"),
        (
            {"rs_rules": (RejectionRule("token_k1", 2), RejectionRule("token_k1", 3))},
            "two rules for token_k1",
        ),
    ],
)
def test_validation_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CorrectionConfig(**kwargs)


def test_from_dict_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rollout_is'\]"):
        CorrectionConfig.from_dict({"rollout_is": "token"})
    with pytest.raises(ValueError, match=r"rs_rules\[0\].*did you mean 'token_k\d'"):
        CorrectionConfig.from_dict({"rs_rules": [{"option": "token_k", "upper": 2.0}]})
    with pytest.raises(ValueError, match="must be a list"):
        CorrectionConfig.from_dict({"rs_rules": {"option": "token_k1", "upper": 2.0}})
    cfg = CorrectionConfig.from_dict({"is_level": "token", "rs_rules": None})
    assert cfg.rs_rules == ()


def test_config_is_frozen() -> None:
    cfg = CorrectionConfig()
    with pytest.raises(AttributeError):
        cfg.bypass = True  # type: ignore[misc]  # the point of the test
