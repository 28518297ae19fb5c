"""Typed configuration: defaults, overrides, error messages, flatten/YAML, kinds, the docs."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agentrl import config as config_mod
from agentrl.config import (
    ConfigError,
    CorrectionSection,
    ExperimentConfig,
    SFTConfig,
    VariantSection,
    apply_overrides,
    config_markdown,
    load_any_config,
    load_config,
    load_sft_config,
    parse_override,
)
from agentrl.config.annotation import strip_optional

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _all_models(root: type[BaseModel]) -> list[tuple[str, type[BaseModel]]]:
    """Every section model reachable from ``root`` with its dotted path (list items as ``[]``)."""
    out = [("", root)]
    for name, field in root.model_fields.items():
        ann = strip_optional(field.annotation)
        if typing.get_origin(ann) is list:
            name, ann = f"{name}[]", typing.get_args(ann)[0]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += [(f"{name}.{p}".rstrip("."), m) for p, m in _all_models(ann)]
    return out


def _is_section(ann: object) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


# ---- defaults ---------------------------------------------------------------------------


def test_defaults_validate_and_are_cpu_friendly() -> None:
    cfg = load_config(None)
    assert cfg.kind == "rl"
    assert cfg.inference.backend == "embedded"
    assert cfg.distributed.backend == "local"
    assert cfg.trainer.device in ("auto", "cpu")
    assert cfg.model.dtype in ("auto", "float32")
    assert cfg.inference.top_p == 1.0 and cfg.inference.top_k == -1
    assert cfg.distributed.num_trainer_gpus == 0 and cfg.distributed.num_gpus_per_server == 0


@pytest.mark.parametrize("schema", [ExperimentConfig, SFTConfig])
def test_every_field_has_a_one_line_description(schema: type[BaseModel]) -> None:
    missing = []
    for path, model in _all_models(schema):
        for name, field in model.model_fields.items():
            desc = field.description or ""
            if not desc.strip() or "\n" in desc.strip():
                missing.append(f"{path}.{name}".lstrip("."))
    assert missing == []


def test_all_sections_of_design_exist() -> None:
    assert list(ExperimentConfig.model_fields) == [
        "kind",
        "imports",
        "base_dir",
        "model",
        "data",
        "agent",
        "environment",
        "tools",
        "reward",
        "inference",
        "rollout",
        "algorithm",
        "trainer",
        "checkpoint",
        "tracking",
        "distributed",
        "teacher",
    ]


def test_every_section_forbids_extra_keys() -> None:
    """Except a variant choice (`algorithm.advantage`, `algorithm.loss`), whose extra keys are the
    chosen variant's knobs, validated against its signature by the resolution pass."""
    for schema in (ExperimentConfig, SFTConfig):
        for path, model in _all_models(schema):
            expected = "allow" if issubclass(model, VariantSection) else "forbid"
            assert model.model_config.get("extra") == expected, path or schema.__name__


def test_old_flat_algorithm_keys_fail_with_a_migration_message() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.clip_ratio_high=0.3"])
    text = str(err.value)
    assert (
        "'algorithm.adv_estimator' moved: write `algorithm.advantage: {name: <estimator>}`" in text
    )
    assert "'algorithm.clip_ratio_high' moved" in text


def test_variant_shorthand_and_knob_overrides() -> None:
    cfg = load_config(None, ["algorithm.advantage=gae", "algorithm.advantage.lam=0.9"])
    assert cfg.algorithm.advantage.name == "gae" and cfg.algorithm.advantage.knobs() == {"lam": 0.9}
    assert cfg.flatten()["algorithm.advantage.lam"] == "0.9"


def test_a_loaded_file_sets_base_dir_to_its_folder(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "imports: [my_tools.py]\n"))
    assert cfg.base_dir == str(tmp_path.resolve()) and cfg.imports == ["my_tools.py"]
    assert load_config(None).base_dir is None


# ---- overrides ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "keys", "value"),
    [
        ("trainer.max_staleness=2", ["trainer", "max_staleness"], 2),
        ("trainer.lr=1e-6", ["trainer", "lr"], 1e-6),
        ("trainer.lr=3.0E+2", ["trainer", "lr"], 300.0),
        ("tracking.enabled=false", ["tracking", "enabled"], False),
        ("tracking.enabled=True", ["tracking", "enabled"], True),
        ("data.train_files=[a.jsonl,b.jsonl]", ["data", "train_files"], ["a.jsonl", "b.jsonl"]),
        ("model.path=null", ["model", "path"], None),
        ("algorithm.correction.preset=icepop", ["algorithm", "correction", "preset"], "icepop"),
        ("tracking.run_name=1.2.3", ["tracking", "run_name"], "1.2.3"),
        ("agent.system_prompt=a=b", ["agent", "system_prompt"], "a=b"),
        ("model.path=", ["model", "path"], ""),
    ],
)
def test_parse_override_uses_yaml_scalar_rules(text: str, keys: list[str], value: object) -> None:
    got_keys, got_value = parse_override(text)
    assert got_keys == keys
    assert got_value == value
    assert type(got_value) is type(value)


@pytest.mark.parametrize("bad", ["trainer.lr", "=3", "trainer..lr=3", "a.b=[1,"])
def test_malformed_overrides_are_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match="override"):
        parse_override(bad)


def test_overrides_apply_over_the_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "trainer:\n  max_staleness: 4\n  lr: 1.0e-3\n")
    cfg = load_config(
        p,
        [
            "trainer.max_staleness=2",
            "data.train_files=[a.jsonl,b.jsonl]",
            "tracking.enabled=false",
            "algorithm.correction.preset=icepop",
            "trainer.betas=[0.9,0.95]",
            "reward.sources.mydata=my_pkg.rewards:score",
        ],
    )
    assert cfg.trainer.max_staleness == 2
    assert cfg.trainer.lr == 1e-3
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.tracking.enabled is False
    assert cfg.algorithm.correction.preset == "icepop"
    assert cfg.trainer.betas == (0.9, 0.95)
    assert cfg.reward.sources["mydata"] == "my_pkg.rewards:score"
    assert cfg.reward.sources["calculator"] == "calculator"  # other keys kept


def test_apply_overrides_does_not_mutate_input() -> None:
    data = {"trainer": {"lr": 1.0}}
    out = apply_overrides(data, ["trainer.lr=2.0"])
    assert data == {"trainer": {"lr": 1.0}} and out == {"trainer": {"lr": 2.0}}


def test_override_through_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match=re.escape("'trainer.lr' is a value")):
        apply_overrides({"trainer": {"lr": 1.0}}, ["trainer.lr.x=2"])


def test_yaml_file_floats_in_exponent_form_are_floats(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "trainer:\n  lr: 1e-6\n  critic_lr: 5E-5\n"))
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.critic_lr == 5e-5


# ---- errors -------------------------------------------------------------------------------


def test_unknown_key_names_path_and_closest_key() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["trainer.max_stalenes=2"])
    assert "unknown key 'trainer.max_stalenes'; did you mean 'trainer.max_staleness'?" in str(
        exc.value
    )


def test_unknown_nested_key_in_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "algorithm:\n  correction:\n    is_treshold: 3.0\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert str(p) in msg
    assert (
        "unknown key 'algorithm.correction.is_treshold'; "
        "did you mean 'algorithm.correction.is_threshold'?"
    ) in msg


def test_unknown_section_suggests_section() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'traner'; did you mean 'trainer'\?"):
        load_config(None, ["traner.lr=1"])


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"valid keys in 'model': path, dtype, trust_remote_code"):
        load_config(None, ["model.zzzzzz=1"])


def test_type_error_names_path_and_expected_type() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["trainer.max_staleness=two"])
    assert "'trainer.max_staleness': expected int, got 'two'" in str(exc.value)


def test_list_item_error_names_index() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(
            None,
            ["algorithm.correction.rs_rules=[{option: token_k1, upper: 2}, {option: tokn_k3}]"],
        )
    msg = str(exc.value)
    assert "'algorithm.correction.rs_rules[1].option'" in msg and "did you mean 'token_k3'" in msg
    assert "'algorithm.correction.rs_rules[1].upper'" in msg  # missing required field


def test_literal_error_suggests_closest_value() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'icepop'\?"):
        load_config(None, ["algorithm.correction.preset=icepopp"])


def test_constraint_error_is_explained() -> None:
    with pytest.raises(ConfigError, match=r"'data.batch_size': expected int, got 0 \(.*greater"):
        load_config(None, ["data.batch_size=0"])


def test_all_errors_reported_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["trainer.lrr=1", "data.n_samples=x", "model.dtype=fp16"])
    msg = str(exc.value)
    assert "trainer.lrr" in msg and "data.n_samples" in msg and "model.dtype" in msg


def test_cross_section_checks() -> None:
    with pytest.raises(ConfigError, match=re.escape("inference.urls is empty")):
        load_config(None, ["inference.backend=external"])
    with pytest.raises(ConfigError, match=re.escape("multiple of trainer.mini_batch_size")):
        load_config(None, ["data.batch_size=6", "trainer.mini_batch_size=4"])


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "trainer: [1,\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))
    empty = load_config(_write(tmp_path, ""))
    assert empty.base_dir == str(tmp_path.resolve())
    assert empty.model_copy(update={"base_dir": None}) == load_config(None)


def test_assignment_is_validated() -> None:
    cfg = load_config(None)
    with pytest.raises(ValueError):
        cfg.trainer.max_staleness = "x"  # type: ignore[assignment]


# ---- kinds --------------------------------------------------------------------------------


def test_kind_dispatch(tmp_path: Path) -> None:
    rl = _write(tmp_path, "kind: rl\ntrainer: {max_staleness: 0}\n", "rl.yaml")
    sft = _write(tmp_path, "kind: sft\ntrainer: {epochs: 2}\ndata: {max_seq_len: 64}\n", "s.yaml")
    assert isinstance(load_any_config(rl), ExperimentConfig)
    sft_cfg = load_any_config(sft)
    assert isinstance(sft_cfg, SFTConfig)
    assert sft_cfg.trainer.epochs == 2 and sft_cfg.data.max_seq_len == 64
    assert load_sft_config(sft) == sft_cfg
    with pytest.raises(ConfigError, match="load_sft_config"):
        load_config(sft)
    with pytest.raises(ConfigError, match="load it with load_config"):
        load_sft_config(rl)
    with pytest.raises(ConfigError, match=r"valid kinds: rl, sft; did you mean 'sft'\?"):
        load_any_config(_write(tmp_path, "kind: sfts\n", "bad.yaml"))


def test_sft_rejects_rl_only_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("unknown key 'trainer.max_staleness'")):
        load_sft_config(None, ["trainer.max_staleness=1"])
    with pytest.raises(ConfigError, match=re.escape("unknown key 'algorithm'")):
        load_sft_config(None, ["algorithm.gamma=1"])


def test_load_sft_config_defaults_kind() -> None:
    assert load_sft_config(None).kind == "sft"


# ---- flatten / yaml -----------------------------------------------------------------------


def test_flatten_gives_dotted_string_params() -> None:
    cfg = load_config(None, ["algorithm.correction.preset=icepop", "data.train_files=[a,b]"])
    flat = cfg.flatten()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in flat.items())
    assert flat["trainer.max_staleness"] == "1"
    assert flat["algorithm.correction.preset"] == "icepop"
    assert flat["algorithm.kl_ctrl.type"] == "fixed"
    assert flat["tracking.enabled"] == "true"
    assert flat["model.path"] == "null"
    assert flat["data.train_files"] == '["a", "b"]'
    assert flat["trainer.betas"] == "[0.9, 0.999]"
    assert flat["reward.sources.calculator"] == "calculator"
    assert "algorithm.correction.rs_rules" not in flat  # the preset decides it
    plain = load_config(None, ["algorithm.correction.is_level=token"]).flatten()
    assert plain["algorithm.correction.rs_rules"] == "[]"
    assert plain["algorithm.correction.is_level"] == "token"


def test_yaml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "trainer.max_staleness=3",
            "algorithm.correction.rs_rules=[{option: seq_mean_k1, upper: 1.001, lower: 0.999}]",
        ],
    )
    again = load_config(_write(tmp_path, cfg.to_yaml()))
    assert again.model_copy(update={"base_dir": None}) == cfg
    sft = load_sft_config(None, ["trainer.lr=0.5"])
    assert load_any_config(_write(tmp_path, sft.to_yaml(), "sft.yaml")) == sft


def test_checkpoint_shared_dir_resolution() -> None:
    cfg = load_config(None)
    resolved = cfg.checkpoint.resolved_shared_dir()
    if Path("/dev/shm").is_dir():
        assert str(resolved).startswith("/dev/shm")
    assert load_config(None, ["checkpoint.shared_dir=/x/y"]).checkpoint.resolved_shared_dir() == (
        Path("/x/y")
    )


# ---- correction mirror --------------------------------------------------------------------


def test_correction_explicit_fields_track_what_was_set() -> None:
    sec = CorrectionSection.model_validate({"preset": "icepop", "is_threshold": 5.0})
    assert sec.explicit_fields() == {"is_threshold": 5.0}


def test_preset_round_trip_does_not_freeze_defaults(tmp_path: Path) -> None:
    # dumping every mirror field next to a preset would override the preset on reload
    cfg = load_config(
        None,
        [
            "algorithm.correction.preset=decoupled_seq_is_rs",
            "algorithm.correction.is_threshold=4.0",
        ],
    )
    dumped = cfg.model_dump(mode="json")["algorithm"]["correction"]
    assert dumped == {"preset": "decoupled_seq_is_rs", "is_threshold": 4.0}
    again = load_config(_write(tmp_path, cfg.to_yaml()))
    assert again.algorithm.correction.explicit_fields() == {"is_threshold": 4.0}
    assert again.algorithm.correction.to_correction_config() == (
        cfg.algorithm.correction.to_correction_config()
    )
    no_preset = load_config(None, ["algorithm.correction.is_level=token"])
    assert "is_threshold" in no_preset.model_dump()["algorithm"]["correction"]


def _correction():
    """The correction package (imports torch), imported only by the tests that compare with it."""
    import correction

    return correction


def test_correction_mirror_has_same_field_names_as_dataclass() -> None:
    correction = _correction()
    dc_fields = {f.name for f in dataclasses.fields(correction.CorrectionConfig)}
    mirror = set(CorrectionSection.model_fields) - {"preset"}
    assert mirror == dc_fields
    rule_fields = {f.name for f in dataclasses.fields(correction.RejectionRule)}
    assert set(config_mod.RejectionRuleConfig.model_fields) == rule_fields


def test_preset_names_match_correction_presets() -> None:
    correction = _correction()
    assert set(typing.get_args(config_mod.CorrectionPresetName)) == set(correction.PRESETS)


def test_rs_option_names_match_correction() -> None:
    correction = _correction()
    assert set(typing.get_args(config_mod.RSOptionName)) == {o.value for o in correction.RSOption}


def test_to_correction_config_defaults_and_presets() -> None:
    correction = _correction()
    # no preset: the mirror's defaults are the dataclass's defaults
    assert CorrectionSection().to_correction_config() == correction.CorrectionConfig()
    for name in correction.PRESETS:
        got = CorrectionSection.model_validate({"preset": name}).to_correction_config()
        assert got == correction.preset(name), name


def test_to_correction_config_explicit_fields_override_preset() -> None:
    correction = _correction()
    cfg = load_config(
        None,
        [
            "algorithm.correction.preset=decoupled_token_is",
            "algorithm.correction.is_threshold=5.0",
            "algorithm.correction.rs_rules=[{option: token_k1, upper: 2.0}]",
        ],
    )
    got = cfg.algorithm.correction.to_correction_config()
    base = correction.preset("decoupled_token_is")
    assert got.is_threshold == 5.0
    assert got.is_level == base.is_level and got.bypass == base.bypass
    assert len(got.rs_rules) == 1
    assert got.rs_rules[0] == correction.RejectionRule("token_k1", 2.0)
    explicit = load_config(
        None,
        [
            "algorithm.correction.is_level=sequence",
            "algorithm.correction.bypass=true",
            "algorithm.correction.loss_type=reinforce",
        ],
    )
    dc = explicit.algorithm.correction.to_correction_config()
    assert dc.bypass is True
    assert dc.is_level == correction.ISLevel.SEQUENCE
    assert dc.loss_type == correction.LossType.REINFORCE


def test_to_correction_config_reports_inconsistent_fields() -> None:
    cfg = load_config(
        None, ["algorithm.correction.bypass=true", "algorithm.correction.is_level=token"]
    )
    with pytest.raises(ConfigError, match=r"^algorithm\.correction: .*is_level"):
        cfg.algorithm.correction.to_correction_config()


# ---- imports, CLI and docs ----------------------------------------------------------------


def test_config_module_imports_no_heavy_packages() -> None:
    code = (
        "import sys, agentrl.config as c; c.load_config('configs/quickstart.yaml').flatten(); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'ray', 'vllm', 'mlflow', 'tensordict', 'transformers')); print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cli_prints_resolved_yaml_and_errors() -> None:
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl.config",
            "configs/quickstart.yaml",
            "trainer.max_staleness=5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "max_staleness: 5" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "agentrl.config", "trainer.max_stalenes=5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "did you mean 'trainer.max_staleness'" in bad.stderr


def test_docs_configuration_md_is_up_to_date() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == config_markdown(), (
        "docs/configuration.md is stale: run "
        "`python -m agentrl.config --markdown > docs/configuration.md`"
    )


def test_docs_mention_every_key() -> None:
    md = config_markdown()
    for schema in (ExperimentConfig, SFTConfig):
        for path, model in _all_models(schema):
            leaves = [
                name
                for name, field in model.model_fields.items()
                if not _is_section(strip_optional(field.annotation))
            ]
            if path and leaves:
                assert f"### `{path}`" in md, path
            for name in leaves:
                assert f"| `{name}` |" in md, f"{path}.{name}"


# ---- properties ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False))
def test_float_overrides_parse_as_written(x: float) -> None:
    # repr() gives forms like 1e-06 and 1e+20 that PyYAML's YAML 1.1 rules would keep as strings
    assert load_config(None, [f"trainer.lr={x!r}"]).trainer.lr == x


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=10**6), st.booleans())
def test_int_and_bool_overrides(n: int, flag: bool) -> None:
    cfg = load_config(None, [f"trainer.max_staleness={n}", f"tracking.enabled={str(flag).lower()}"])
    assert cfg.trainer.max_staleness == n and cfg.tracking.enabled is flag
    assert cfg.flatten()["trainer.max_staleness"] == str(n)


def test_config_pickles() -> None:
    import pickle

    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg
    assert (
        again.algorithm.correction.explicit_fields() == cfg.algorithm.correction.explicit_fields()
    )


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["teacher.backend=vllm", "inference.temperature=0.7"],
            "prompt_logprobs are temperature-1",
        ),
    ],
)
def test_teacher_combinations_that_cannot_work_are_refused(overrides, words) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["teacher.path=some/teacher", *overrides])
    load_config(
        None, ["teacher.path=some/teacher"]
    )  # alone it validates (the path is checked later)
