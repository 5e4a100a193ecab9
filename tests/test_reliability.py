"""Young/Daly checkpoint-interval arithmetic, checked against its closed forms and a numeric
minimisation of the expected wall time."""

import math

import pytest

from meshtron.errors import UserError
from meshtron.reliability import (
    DEFAULT_GPU_FAILURES_PER_HOUR,
    cluster_mtbf_s,
    daly_interval_s,
    expected_overhead_fraction,
    first_order_overhead_fraction,
    interval_steps,
    young_interval_s,
)


def test_llama3_rate_gives_about_three_hours_on_16k_gpus():
    mtbf_h = cluster_mtbf_s(16_384) / 3600
    assert mtbf_h == pytest.approx(54 * 24 / 419)
    assert 3.0 < mtbf_h < 3.2
    assert DEFAULT_GPU_FAILURES_PER_HOUR * cluster_mtbf_s(1) == pytest.approx(3600)


def test_young_closed_form():
    assert young_interval_s(60, 3 * 3600) == pytest.approx(math.sqrt(2 * 60 * 3 * 3600))


@pytest.mark.parametrize("delta,m", [(10, 3600), (60, 3 * 3600), (600, 7200), (30, 1e6)])
def test_daly_is_the_minimum_of_the_expected_wall_time(delta, m):
    taus = [daly_interval_s(delta, m) * f for f in (0.8, 0.9, 1.0, 1.1, 1.25)]
    costs = [expected_overhead_fraction(t, delta, m) for t in taus]
    # Daly's estimate is within a fraction of a percent of the true minimum, so it beats
    # intervals 10-25% away on either side.
    assert costs[2] <= min(costs) + 1e-4
    # and within a few percent of Young's when delta << M
    if delta / m < 0.01:
        assert daly_interval_s(delta, m) == pytest.approx(young_interval_s(delta, m), rel=0.05)


def test_first_order_terms_match_the_complete_model_for_rare_failures():
    tau, delta, m, r = 1800.0, 20.0, 200 * 3600.0, 60.0
    full = expected_overhead_fraction(tau, delta, m, r)
    assert first_order_overhead_fraction(tau, delta, m, r) == pytest.approx(full, rel=0.01)


def test_daly_caps_at_mtbf_when_checkpoints_cost_more_than_two_mtbf():
    assert daly_interval_s(1000, 400) == 400


def test_interval_steps_rounds_and_is_at_least_one():
    assert interval_steps(1.0, 0.001, 1.0) == 1
    assert interval_steps(2.0, 60, 3 * 3600) == round(daly_interval_s(60, 3 * 3600) / 2)


@pytest.mark.parametrize("call", [
    lambda: cluster_mtbf_s(0),
    lambda: cluster_mtbf_s(8, 0.0),
    lambda: young_interval_s(-1, 10),
    lambda: daly_interval_s(1, 0),
    lambda: expected_overhead_fraction(10, 1, float("inf")),
])
def test_bad_input_is_a_user_error(call):
    with pytest.raises(UserError):
        call()
