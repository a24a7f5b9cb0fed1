"""The entropy floor's coefficient and the temperature schedule (clew.algorithms.entropy_control)."""

from __future__ import annotations

import math

import pytest

from clew.algorithms import adapt_entropy_coef, entropy_coef_in_effect, linear_schedule

BOUNDS = {"target": 0.3, "step_size": 0.01, "min_coef": 0.0, "max_coef": 0.05}


def test_the_coefficient_rises_below_the_target_and_falls_above_it() -> None:
    assert adapt_entropy_coef(0.02, 0.1, **BOUNDS) == pytest.approx(0.03)
    assert adapt_entropy_coef(0.02, 0.5, **BOUNDS) == pytest.approx(0.01)


def test_the_coefficient_stays_at_the_target_and_when_nothing_was_measured() -> None:
    assert adapt_entropy_coef(0.02, 0.3, **BOUNDS) == 0.02
    assert adapt_entropy_coef(0.02, math.nan, **BOUNDS) == 0.02
    assert adapt_entropy_coef(0.02, math.inf, **BOUNDS) == 0.02


def test_the_coefficient_is_clipped_to_its_bounds() -> None:
    assert adapt_entropy_coef(0.045, 0.0, **BOUNDS) == 0.05
    assert adapt_entropy_coef(0.005, 1.0, **BOUNDS) == 0.0
    # A start outside the bounds is brought inside whatever the entropy.
    assert adapt_entropy_coef(0.2, 0.3, **BOUNDS) == 0.05


def test_a_run_below_the_target_climbs_to_the_ceiling_and_one_above_falls_to_the_floor() -> None:
    up = down = 0.02
    for _ in range(10):
        up = adapt_entropy_coef(up, 0.1, **BOUNDS)
        down = adapt_entropy_coef(down, 0.9, **BOUNDS)
    assert (up, down) == (0.05, 0.0)


def test_the_bonus_applies_at_or_below_the_target_and_not_above() -> None:
    assert entropy_coef_in_effect(0.04, None, 0.3) == 0.04  # nothing measured yet
    assert entropy_coef_in_effect(0.04, 0.2, 0.3) == 0.04
    assert entropy_coef_in_effect(0.04, 0.3, 0.3) == 0.04
    assert entropy_coef_in_effect(0.04, 0.31, 0.3) == 0.0


@pytest.mark.parametrize(("start", "end"), [(1.0, 0.5), (0.6, 1.2)])
def test_the_schedule_starts_at_the_first_step_and_ends_at_the_last(start, end) -> None:
    assert linear_schedule(start, end, 1, 11) == start
    assert linear_schedule(start, end, 11, 11) == end
    assert linear_schedule(start, end, 6, 11) == pytest.approx((start + end) / 2)
    values = [linear_schedule(start, end, s, 11) for s in range(1, 12)]
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    assert steps == pytest.approx([(end - start) / 10] * 10)


def test_the_schedule_holds_its_ends_outside_the_run() -> None:
    assert linear_schedule(1.0, 0.5, 0, 11) == 1.0
    assert linear_schedule(1.0, 0.5, 40, 11) == 0.5
    assert linear_schedule(1.0, 0.5, 1, 1) == 1.0  # a run of one step takes the start
