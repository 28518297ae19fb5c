"""The fused C kernel (``correction/_native.c``): equal to the torch path across the option matrix,
exp accuracy, fallbacks (non-finite input, non-0/1 mask, disabled, no compiler) and the build cache.

Tests that need the kernel are skipped only when it cannot be built here (no C compiler); the
fallback tests run regardless.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import correction._engine as engine
from correction import _native
from correction._common import metrics_to_floats
from correction._engine import PassResult, correction_pass
from correction.types import ISLevel, RejectionRule, RSOption

from . import reference


def _kernel_or_skip() -> _native.NativeKernel:
    """The kernel as built by default (also when the suite runs with AGENTRL_CORRECTION_NATIVE=0)."""
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(_native.ENV_VAR, raising=False)
            found = _native.kernel()
    except RuntimeError as exc:  # AGENTRL_CORRECTION_NATIVE=1 in the environment
        pytest.skip(f"native kernel unavailable: {exc}")
    if found is None:
        pytest.skip(f"native kernel unavailable: {_native._STATE.get('error')}")
    return found


@pytest.fixture
def kernel() -> _native.NativeKernel:
    return _kernel_or_skip()


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty build state and cache dir for this test; the process's state is restored after."""
    saved = dict(_native._STATE)
    _native._STATE.clear()
    monkeypatch.setenv("AGENTRL_CACHE_DIR", str(tmp_path))
    yield tmp_path
    _native._STATE.clear()
    _native._STATE.update(saved)


def _run(native: bool, monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> PassResult:
    monkeypatch.setenv(_native.ENV_VAR, "1" if native else "0")
    try:
        return correction_pass(**kwargs)  # type: ignore[arg-type]  # test helper
    finally:
        monkeypatch.delenv(_native.ENV_VAR)


def _batch(
    batch: int, length: int, scale: float = 0.3, seed: int = 0, outliers: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 (train, rollout, mask) with ragged padding, one empty row, optional ±50 outliers."""
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=gen) * 3.0
    train = rollout + torch.randn(batch, length, generator=gen) * scale
    if outliers:
        hit = torch.rand(batch, length, generator=gen) < outliers
        sign = torch.where(torch.rand(batch, length, generator=gen) < 0.5, -1.0, 1.0)
        train = torch.where(hit, rollout + 50.0 * sign, train)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    if batch > 2:
        lengths[1] = 0
        lengths[0] = length
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float32)
    return train, rollout, mask


_EXP_OF_SUM = ("chi2_seq", "training_ppl", "rollout_ppl", "ppl_ratio")


def _assert_same(
    got: PassResult, want: PassResult, lr: torch.Tensor, mask: torch.Tensor, level: object
) -> None:
    """Native vs torch path: keep exactly, weights within 1e-6, metrics within 1e-6 relative/abs,
    except where a float32 row sum is exponentiated (sequence-level IS, χ²_seq, perplexities):
    there both paths carry the sum's float32 rounding, ~ε·Σ|ℓ| (the torch path sums in float32,
    the kernel in float64 from float32 partials), so the tolerance grows by that much."""
    amp = 2.5e-7 * float((lr.abs() * mask).sum(dim=-1).max()) if lr.numel() else 0.0
    seq_level = level in (ISLevel.SEQUENCE, ISLevel.GEOMETRIC, "sequence", "geometric")
    for name in ("weights", "keep"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype == torch.float32
            if name == "keep":
                assert torch.equal(a, b)
            else:
                rtol = 1e-6 + (amp if seq_level else 0.0)
                torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6)
    got_m, want_m = metrics_to_floats(got.metrics), metrics_to_floats(want.metrics)
    assert got_m.keys() == want_m.keys()
    for key, value in want_m.items():
        exp_of_sum = key in _EXP_OF_SUM or (seq_level and key.startswith("is_"))
        rel = 1e-6 + (amp if exp_of_sum else 0.0)
        if key == "is_weight_std":
            # E[w²] − E[w]² cancels: compare variances at the float32 resolution of E[w²] (the
            # torch path sums w² in float32, the kernel in float64)
            var_tol = 1e-6 * max(1.0, want_m["is_weight_mean"] ** 2)
            assert got_m[key] ** 2 == pytest.approx(value**2, rel=max(rel, 1e-5), abs=var_tol), key
            continue
        if key == "chi2_token":  # 2Σ(ρ−1) + Σ(ρ−1)²: float32 sums in the torch path, same issue
            rel = max(rel, 2e-5)
        assert got_m[key] == pytest.approx(value, rel=rel, abs=1e-6), key


TOKEN_RULES = [
    RejectionRule(RSOption.TOKEN_K1, 2.0),
    RejectionRule(RSOption.TOKEN_K1, 3.0, lower=0.8),
    RejectionRule(RSOption.TOKEN_K2, 0.02),
    RejectionRule(RSOption.TOKEN_K3, 0.01),
]
SEQ_RULES = [RejectionRule(o, 2.0 if o.is_k1 else 0.02) for o in RSOption if not o.is_token]
RULE_SETS: list[tuple[RejectionRule, ...] | None] = [
    None,
    (),
    *((r,) for r in TOKEN_RULES),
    (TOKEN_RULES[0], TOKEN_RULES[2], TOKEN_RULES[3]),
    tuple(SEQ_RULES),
    (TOKEN_RULES[0], RejectionRule(RSOption.SEQ_MEAN_K3, 0.01)),
    (TOKEN_RULES[1], TOKEN_RULES[3], *SEQ_RULES),
]


@pytest.mark.parametrize("level", [None, *ISLevel])
@pytest.mark.parametrize("rules", RULE_SETS, ids=lambda r: "none" if r is None else str(len(r)))
@pytest.mark.parametrize("form", ["formed", "given", "given+diag"])
def test_native_equals_torch_path(
    kernel: _native.NativeKernel,
    monkeypatch: pytest.MonkeyPatch,
    level: ISLevel | None,
    rules: tuple[RejectionRule, ...] | None,
    form: str,
) -> None:
    train, rollout, mask = _batch(9, 53, seed=3, outliers=0.02)
    kwargs: dict[str, object] = {"is_level": level, "threshold": 1.7, "rules": rules}
    if form == "formed":
        kwargs.update(log_ratio=None, train_log_probs=train, rollout_log_probs=rollout)
    else:
        kwargs["log_ratio"] = train - rollout
        if form == "given+diag":
            kwargs["rollout_log_probs"] = rollout
    _assert_same(
        _run(True, monkeypatch, response_mask=mask, **kwargs),
        _run(False, monkeypatch, response_mask=mask, **kwargs),
        train - rollout,
        mask,
        level,
    )


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 8), (40, 1000), (300, 1024)])
@pytest.mark.parametrize("threshold", [0.5, 2.0, 1e9])
def test_native_equals_torch_path_across_sizes(
    kernel: _native.NativeKernel,
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, int],
    threshold: float,
) -> None:
    """Rows shorter/longer than one vector, B·T below and above one torch block (2^18)."""
    train, rollout, mask = _batch(*shape, scale=0.5, seed=shape[1], outliers=0.01)
    kwargs: dict[str, object] = {
        "log_ratio": None,
        "response_mask": mask,
        "is_level": ISLevel.TOKEN,
        "threshold": threshold,
        "batch_normalize": True,
        "rules": (TOKEN_RULES[0], TOKEN_RULES[3], RejectionRule(RSOption.SEQ_MEAN_K3, 0.05)),
        "train_log_probs": train,
        "rollout_log_probs": rollout,
    }
    _assert_same(
        _run(True, monkeypatch, **kwargs),
        _run(False, monkeypatch, **kwargs),
        train - rollout,
        mask,
        ISLevel.TOKEN,
    )


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 6),
    length=st.integers(0, 45),
    scale=st.sampled_from([0.0, 0.05, 1.0, 30.0]),
    seed=st.integers(0, 10_000),
    level=st.sampled_from([None, *ISLevel]),
    rules=st.sampled_from(RULE_SETS),
    formed=st.booleans(),
)
def test_property_native_equals_torch_path(
    batch: int,
    length: int,
    scale: float,
    seed: int,
    level: ISLevel | None,
    rules: tuple[RejectionRule, ...] | None,
    formed: bool,
) -> None:
    _kernel_or_skip()
    train, rollout, mask = _batch(batch, length, scale=scale, seed=seed)
    kwargs: dict[str, object] = {
        "response_mask": mask,
        "is_level": level,
        "threshold": 2.0,
        "rules": rules,
        "rollout_log_probs": rollout,
    }
    if formed:
        kwargs.update(log_ratio=None, train_log_probs=train)
    else:
        kwargs["log_ratio"] = train - rollout
    with pytest.MonkeyPatch.context() as mp:
        _assert_same(
            _run(True, mp, **kwargs), _run(False, mp, **kwargs), train - rollout, mask, level
        )


def test_native_matches_hand_computed_reference(
    kernel: _native.NativeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float64 Python-loop reference (tests/unit/correction/reference.py) through the kernel."""
    train, rollout, mask = _batch(6, 23, scale=0.4, seed=11)
    lr = train - rollout
    for level in ISLevel:
        got = _run(True, monkeypatch, log_ratio=lr, response_mask=mask, is_level=level)
        want = reference.is_weights(lr.double(), mask.double(), level.value, 2.0)
        assert got.weights is not None
        torch.testing.assert_close(got.weights.double(), want, rtol=3e-7, atol=1e-7)
    for rule in TOKEN_RULES + SEQ_RULES:
        got = _run(True, monkeypatch, log_ratio=lr, response_mask=mask, rules=(rule,))
        want = reference.rs_keep(lr.double(), mask, rule.option.value, rule.upper, rule.lower)
        assert got.keep is not None
        torch.testing.assert_close(got.keep.double(), want, rtol=0, atol=0)
    got = _run(
        True,
        monkeypatch,
        log_ratio=None,
        response_mask=mask,
        train_log_probs=train,
        rollout_log_probs=rollout,
    )
    metrics = metrics_to_floats(got.metrics)
    for key, value in reference.diagnostics(train.double(), rollout.double(), mask).items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_exp_relative_error_bound(kernel: _native.NativeKernel) -> None:
    """exp(−x) over [−20, 20] within 2e-7 relative of float64 exp (exhaustively over every float
    in the range it measured 8.4e-8, i.e. < 1 ulp); here a dense grid plus random points."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.linspace(-20.0, 20.0, 2_000_001),
            torch.rand(1_000_000, generator=gen) * 40.0 - 20.0,
            torch.randn(500_000, generator=gen) * 1e-3,
            torch.tensor(
                [0.0, -0.0, 20.0, -20.0, 1e-30, -1e-30, math.log(2.0), 0.5 * math.log(2.0)]
            ),
        ]
    )
    got = kernel.exp_neg(x).double()
    want = torch.exp(-x.double())
    assert float(((got - want) / want).abs().max()) <= 2e-7
    assert float(kernel.exp_neg(torch.zeros(3)).sub(1.0).abs().max()) == 0.0  # exactly 1 at ℓ = 0
    clamped = kernel.exp_neg(torch.tensor([60.0, -60.0])).double()
    torch.testing.assert_close(
        clamped, torch.exp(torch.tensor([-20.0, 20.0]).double()), rtol=2e-7, atol=0
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["log_ratio", "train_log_probs", "rollout_log_probs"])
def test_nonfinite_response_token_raises_the_torch_message(
    kernel: _native.NativeKernel, monkeypatch: pytest.MonkeyPatch, bad: float, where: str
) -> None:
    train, rollout, mask = _batch(4, 9, seed=5)
    tensors = {"train_log_probs": train, "rollout_log_probs": rollout, "log_ratio": train - rollout}
    tensors[where][2, 3] = bad
    mask[2, :5] = 1.0
    kwargs: dict[str, object] = {"response_mask": mask, "is_level": ISLevel.TOKEN}
    kwargs |= {"rollout_log_probs": tensors["rollout_log_probs"]}
    if where == "log_ratio":
        kwargs["log_ratio"] = tensors["log_ratio"]
    else:
        kwargs |= {"log_ratio": None, "train_log_probs": tensors["train_log_probs"]}
    messages = []
    for native in (True, False):
        with pytest.raises(ValueError, match=rf"{where} has a non-finite value .*\[2, 3\]") as info:
            _run(native, monkeypatch, **kwargs)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_padding_and_fractional_mask_fall_back_to_torch(
    kernel: _native.NativeKernel, monkeypatch: pytest.MonkeyPatch, bad: float
) -> None:
    train, rollout, mask = _batch(5, 12, seed=7)
    mask[3, 6:] = 0.0
    # train/rollout are changed in place below, after the clean run.
    inputs = {"log_ratio": None, "response_mask": mask, "is_level": ISLevel.TOKEN}
    inputs |= {"train_log_probs": train, "rollout_log_probs": rollout}
    clean = _run(False, monkeypatch, **inputs)
    calls: list[int] = []
    original = engine._torch_blocks

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]  # pass-through

    monkeypatch.setattr(engine, "_torch_blocks", spy)
    train[3, 8] = bad
    rollout[3, 9] = bad
    got = _run(True, monkeypatch, **inputs)
    assert calls == [1]
    _assert_same(got, clean, torch.zeros(0), mask, ISLevel.TOKEN)
    half = mask.clone()
    half[0, 0] = 0.5  # not 0/1: the kernel declines, the torch path multiplies as before
    kwargs: dict[str, object] = {"log_ratio": train - rollout, "is_level": ISLevel.TOKEN}
    kwargs["log_ratio"] = torch.where(mask > 0, train - rollout, 0.0)
    got = _run(True, monkeypatch, response_mask=half, **kwargs)
    assert calls == [1, 1]
    want = _run(False, monkeypatch, response_mask=half, **kwargs)
    _assert_same(got, want, torch.zeros(0), half, ISLevel.TOKEN)


def test_only_cpu_float32_contiguous_inputs_use_the_kernel(
    kernel: _native.NativeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(_native.ENV_VAR, raising=False)
    train, rollout, mask = _batch(4, 10)
    lr = train - rollout
    assert engine._native_kernel(lr, mask, None, None) is kernel
    assert engine._native_kernel(lr, mask.bool(), rollout, None) is kernel
    assert engine._native_kernel(lr.double(), mask, None, None) is None
    assert engine._native_kernel(lr.bfloat16(), mask, None, None) is None
    assert engine._native_kernel(lr.t().contiguous().t(), mask, None, None) is None
    assert engine._native_kernel(lr, mask, rollout.double(), None) is None
    assert engine._native_kernel(lr[:0], mask[:0], None, None) is None
    monkeypatch.setenv(_native.ENV_VAR, "0")
    assert engine._native_kernel(lr, mask, None, None) is None


def test_env_zero_never_uses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> int:
        raise AssertionError("native kernel used with AGENTRL_CORRECTION_NATIVE=0")

    monkeypatch.setattr(_native.NativeKernel, "rows", boom)
    monkeypatch.setattr(_native, "_build", boom)
    train, rollout, mask = _batch(3, 8)
    got = _run(False, monkeypatch, log_ratio=train - rollout, response_mask=mask, is_level="token")
    assert got.weights is not None and bool((got.weights[mask == 0] == 0).all())


def test_bad_env_value_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"AGENTRL_CORRECTION_NATIVE='yes'.*0.*1"):
        _native.kernel()


def test_missing_compiler_falls_back_with_one_warning(
    fresh_state: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_native, "COMPILERS", ("agentrl-no-such-cc",))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(_native.ENV_VAR, raising=False)
    train, rollout, mask = _batch(3, 8)
    with caplog.at_level(logging.WARNING, logger=_native.__name__):
        first = correction_pass(train - rollout, mask, is_level=ISLevel.TOKEN)
        second = correction_pass(train - rollout, mask, is_level=ISLevel.TOKEN)
    warnings = [r for r in caplog.records if r.name == _native.__name__]
    assert len(warnings) == 1
    assert "agentrl-no-such-cc" in warnings[0].getMessage()
    assert "AGENTRL_CORRECTION_NATIVE=0" in warnings[0].getMessage()
    torch_path = _run(
        False, monkeypatch, log_ratio=train - rollout, response_mask=mask, is_level=ISLevel.TOKEN
    )
    for result in (first, second):  # both calls ran the torch path: identical results
        assert result.weights is not None and torch_path.weights is not None
        assert torch.equal(result.weights, torch_path.weights)
        assert metrics_to_floats(result.metrics) == metrics_to_floats(torch_path.metrics)
    monkeypatch.setenv(_native.ENV_VAR, "1")
    with pytest.raises(RuntimeError, match=r"AGENTRL_CORRECTION_NATIVE=1 requires.*no C compiler"):
        correction_pass(train - rollout, mask, is_level=ISLevel.TOKEN)
    assert not list(fresh_state.iterdir())


def test_build_is_cached_by_hash_and_reused(fresh_state: Path) -> None:
    if not any(__import__("shutil").which(c) for c in _native.COMPILERS):
        pytest.skip("no C compiler")
    first = _native._build()
    assert first.parent == fresh_state and first.name.startswith("correction_native_")
    mtime = first.stat().st_mtime_ns
    assert _native._build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in fresh_state.iterdir()] == [first.name]  # no temporary left behind
    loaded = _native.NativeKernel(first)
    assert float(loaded.exp_neg(torch.zeros(1))[0]) == 1.0


def test_row_ranges_on_threads_equal_one_thread(
    kernel: _native.NativeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_native, "PARALLEL_MIN_ELEMENTS", 64)
    train, rollout, mask = _batch(11, 37, scale=0.5, seed=2, outliers=0.05)
    params = torch.tensor([2.0, -0.7, 0.7, 0.2, 0.01], dtype=torch.float32)
    outs = []
    for threads in (1, 4):
        weights, keep = torch.empty_like(mask), torch.empty_like(mask)
        stats = torch.empty((_native.N_STATS, 11), dtype=torch.float64)
        sums = torch.tensor([0.0, 0.0, 0.0, 0.0, -math.inf, math.inf], dtype=torch.float64)
        code = kernel.rows(
            train, rollout, None, mask, params, weights, keep, stats, sums, threads=threads
        )
        assert code == 0
        outs.append((weights, keep, stats, sums))
    for one, many in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(many, one, rtol=1e-12, atol=1e-12)
    train[7, 0] = math.nan  # a row of a later thread's range: its code comes back
    sums = torch.zeros(_native.N_SUMS, dtype=torch.float64)
    code = kernel.rows(train, rollout, None, mask, params, None, None, stats, sums, threads=4)
    assert code == 1
