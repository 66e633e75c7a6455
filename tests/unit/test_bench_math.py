from __future__ import annotations

import math

import pytest

from specd.bench import acceptance
from specd.traces import percentile


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 95) == pytest.approx(3.85)
    assert math.isnan(percentile([], 50))


def test_acceptance_from_counter_deltas():
    before = {"specd_spec_decode_num_drafts_total": 2.0}
    after = {
        "specd_spec_decode_num_drafts_total": 12.0,
        "specd_spec_decode_num_draft_tokens_total": 40.0,
        "specd_spec_decode_num_accepted_tokens_total": 30.0,
        "specd_spec_decode_num_accepted_tokens_per_pos_total|position=0": 9.0,
        "specd_spec_decode_num_accepted_tokens_per_pos_total|position=1": 8.0,
    }
    result = acceptance(before, after)
    assert result["acceptance_rate"] == pytest.approx(0.75)
    assert result["mean_acceptance_length"] == pytest.approx(4.0)
    assert result["per_position_acceptance"] == [pytest.approx(0.9), pytest.approx(0.8)]
    assert acceptance({}, {}) == {}
