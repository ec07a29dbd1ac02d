"""The A/A noise floor (pagoda/ab/calibration.py): measured from each endpoint's own
passes, it keeps a systematic offset between two processes of one configuration from being
called a winner, and leaves a real difference called."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.ab.stats import analyze
from tests.ab.synthetic import request, result

SAME_HARDWARE = {"engine": "pagoda 0.1.0", "cpu": "test", "dtype": "float32"}


def two_process_run(offset: float, drift: float, repeats: int = 2, num_blocks: int = 6,
                    block_size: int = 8, seed: int = 0, tpot_drifts: bool = True) -> dict:
    """Two endpoints replayed in blocks, every request once per repeat. B's latencies are
    A's times (1 + offset) (what differs between two processes: no noise at all), and
    every endpoint's odd passes run (1 + drift) slower than its even ones (what differs
    between two passes of one process). Requests vary in size (lognormal), the same on
    both endpoints. tpot_drifts False: only TTFT drifts between passes."""
    rng = np.random.default_rng(seed)
    base = np.exp(rng.normal(np.log(0.2), 0.4, size=num_blocks * block_size))
    requests = []
    for repeat in range(repeats):
        slow = 1.0 + drift * (repeat % 2)
        for name, factor in (("A", 1.0), ("B", 1.0 + offset)):
            for key, ttft in enumerate(base):
                requests.append(request(name, key, float(ttft * slow * factor),
                                        tpot=0.02 * (slow if tpot_drifts else 1.0) * factor,
                                        repeat=repeat,
                                        block=key // block_size))
    run = result(requests)
    for endpoint in run["endpoints"]:
        endpoint["hardware"] = dict(SAME_HARDWARE)
    return run


def test_the_floor_is_the_largest_difference_between_an_endpoints_halves():
    analysis = analyze(two_process_run(offset=0.04, drift=0.06), resamples=300,
                       calibrate=True)
    calibration = analysis["calibration"]
    assert calibration["requested"] and calibration["method"] == "repeats"
    assert set(calibration["by_endpoint"]) == {"A", "B"}
    # every latency scales with the odd passes' drift: each decisive statistic moves 6%
    assert set(calibration["per_metric"]) == {"P50 TTFT", "P95 TTFT", "P50 TPOT", "P95 TPOT",
                                              "P50 E2E", "P95 E2E"}
    for value in calibration["per_metric"].values():
        assert value == pytest.approx(0.06, rel=1e-6)
    assert calibration["floor"] == pytest.approx(0.06, rel=1e-6)
    rows = analysis["comparisons"][0]["metrics"]
    assert all(r["min_difference"] == pytest.approx(0.06) for r in rows if r["decisive"])


def test_a_process_offset_under_the_floor_is_not_called_a_winner():
    run = two_process_run(offset=0.04, drift=0.06)
    uncalibrated = analyze(run, resamples=300, calibrate=False)
    [comparison] = uncalibrated["comparisons"]
    # the 4% offset is certain (every pair shows it) and over the fixed 2%: a false winner
    assert comparison["outcome"] == "worse" and uncalibrated["choice"] == "A"
    calibrated = analyze(run, resamples=300, calibrate=True)
    [comparison] = calibrated["comparisons"]
    assert comparison["outcome"] == "no_difference" and calibrated["choice"] is None
    assert "A/A noise floor" in calibrated["verdict"] and "6.0%" in calibrated["verdict"]
    assert "A/A noise floor" not in uncalibrated["verdict"]


def test_one_floor_for_every_metric_so_a_quiet_one_calls_no_false_winner():
    # TTFT moves 6% between passes, TPOT not at all; the 4% process offset shows on both
    run = two_process_run(offset=0.04, drift=0.06, tpot_drifts=False)
    calibration = analyze(run, resamples=300, calibrate=True)["calibration"]
    assert calibration["per_metric"]["P50 TPOT"] == pytest.approx(0.0, abs=1e-9)
    assert calibration["floor"] == pytest.approx(0.06, rel=1e-6)
    analysis = analyze(run, resamples=300, calibrate=True)
    [comparison] = analysis["comparisons"]
    tpot = next(m for m in comparison["metrics"] if m["name"] == "P50 TPOT")
    assert tpot["difference"] == pytest.approx(0.04) and tpot["excludes_zero"]
    assert tpot["min_difference"] == pytest.approx(0.06) and not tpot["significant"]
    assert comparison["outcome"] == "no_difference"


def test_a_real_difference_over_the_floor_is_still_called():
    calibrated = analyze(two_process_run(offset=0.30, drift=0.06), resamples=300,
                         calibrate=True)
    [comparison] = calibrated["comparisons"]
    assert comparison["outcome"] == "worse" and calibrated["choice"] == "A"


def test_calibration_is_on_by_default_when_the_endpoints_report_the_same_hardware():
    run = two_process_run(offset=0.04, drift=0.06)
    assert analyze(run, resamples=300)["calibration"]["requested"]
    run["endpoints"][1]["hardware"] = {**SAME_HARDWARE, "dtype": "bfloat16"}
    analysis = analyze(run, resamples=300)
    assert analysis["calibration"] == {"requested": False}
    assert analysis["comparisons"][0]["outcome"] == "worse"
    run["endpoints"][1]["hardware"] = None  # an endpoint that says nothing: not the same
    assert not analyze(run, resamples=300)["calibration"]["requested"]


def test_one_pass_is_split_by_blocks_and_one_block_gives_no_floor():
    one_pass = analyze(two_process_run(offset=0.0, drift=0.0, repeats=1), resamples=300,
                       calibrate=True)
    assert one_pass["calibration"]["method"] == "blocks"
    assert one_pass["calibration"]["floor"] > 0  # different requests in the two halves
    one_block = analyze(two_process_run(offset=0.0, drift=0.0, repeats=1, num_blocks=1),
                        resamples=300, calibrate=True)
    assert one_block["calibration"] == {"requested": True}
    assert "No A/A noise floor" in one_block["verdict"]
