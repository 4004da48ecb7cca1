"""Trace-driven arrivals (arrivals.py, kind "azure"): the trace's own gaps, in order, from where the seed says,
scaled to the cell's rate; and the SLO sweeps that rerun their core cells on them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gateway.lab.sim.arrivals import AZURE_TRACE, ArrivalSpec, arrival_times, trace_gaps


@pytest.fixture(scope="module")
def azure() -> np.ndarray:
    if not AZURE_TRACE.is_file():
        pytest.skip(f"the Azure arrival trace is not at {AZURE_TRACE} (a clone with ../shared beside it has it)")
    return trace_gaps(AZURE_TRACE)


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(times, prepend=0.0)


def test_a_small_trace_is_replayed_as_a_rotation_of_its_gaps_scaled_to_the_rate(tmp_path):
    trace = tmp_path / "trace.csv"
    # Out of order, 7 fractional digits, and two requests at the same instant (a zero gap).
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:00:01.0000000,10,5\n2023-11-16 18:00:00.0000000,10,5\n"
                     "2023-11-16 18:00:03.0000000,10,5\n2023-11-16 18:00:03.0000000,10,5\n"
                     "2023-11-16 18:00:06.0000001,10,5\n")
    assert trace_gaps(trace) == pytest.approx([1.0, 2.0, 0.0, 3.0000001])
    spec = ArrivalSpec("azure", 2.0, trace=trace)
    # Four gaps of mean 1.5 s at 2 req/s: each gap over 3, whatever the offset.
    rotations = {tuple(np.round(np.roll([1, 2, 0, 3], -k) / 3, 6)) for k in range(4)}
    seen = set()
    for seed in range(12):
        got = tuple(np.round(_gaps(arrival_times(spec, 4, seed)), 6))
        assert got in rotations
        seen.add(got)
    assert len(seen) > 1  # seeds start at different places
    wrapped = _gaps(arrival_times(spec, 9, 0))  # longer than the trace: round again
    assert np.allclose(wrapped[4:8], wrapped[:4]) and len(wrapped) / wrapped.sum() == pytest.approx(2.0)


def test_a_missing_trace_is_named_with_what_to_do(tmp_path):
    missing = tmp_path / "nowhere.csv"
    with pytest.raises(FileNotFoundError, match="nowhere.csv") as err:
        ArrivalSpec("azure", 10.0, trace=missing)
    assert "../shared/data/arrivals/" in str(err.value) and "AzurePublicDataset" in str(err.value)
    ArrivalSpec("poisson", 10.0, trace=missing)  # only the trace's own kind reads it


def test_a_file_without_timestamps_is_refused(tmp_path):
    trace = tmp_path / "lengths.csv"
    trace.write_text("ContextTokens,GeneratedTokens\n10,5\n")
    with pytest.raises(ValueError, match="TIMESTAMP"):
        arrival_times(ArrivalSpec("azure", trace=trace), 3, 0)


def test_the_azure_trace_reads_as_its_readme_describes_it(azure):
    assert len(azure) >= 19_000
    assert 1 / azure.mean() == pytest.approx(5.5, rel=0.05)  # about 5.5 req/s over the hour
    assert azure.std() / azure.mean() == pytest.approx(1.1, abs=0.05)  # coefficient of variation about 1.1
    assert ArrivalSpec("azure").label() == "azure trace"


@pytest.mark.parametrize("rate", [3.0, 18.0, 40.0])
def test_trace_arrivals_keep_the_rate_and_repeat_per_seed(azure, rate):
    spec = ArrivalSpec("azure", rate)
    times = arrival_times(spec, 2500, 3)
    assert np.all(np.diff(times) >= 0)
    assert len(times) / times[-1] == pytest.approx(rate, rel=1e-9)
    assert np.array_equal(times, arrival_times(spec, 2500, 3))
    assert not np.array_equal(times, arrival_times(spec, 2500, 4))


def test_trace_arrivals_are_the_traces_own_gaps_in_order(azure):
    """The bursts are the trace's: consecutive scaled gaps stand in the ratios of a run of the trace's gaps."""
    got = _gaps(arrival_times(ArrivalSpec("azure", 30.0), 400, 1))
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([azure, azure[:400]]), 400)[:len(azure)]
    scale = windows[:, 0] / got[0]
    start = np.flatnonzero(np.all(np.isclose(windows, got * scale[:, None], rtol=1e-9), axis=1))
    assert len(start) == 1


@pytest.mark.parametrize("trace, synthetic", [("qlm_trace", "qlm"), ("qos_trace", "qos"),
                                              ("qlm_multi_trace", "qlm_multi"), ("qos_fair_trace", "qos_fair")])
def test_the_trace_sweeps_rerun_synthetic_cells_with_only_the_arrivals_changed(azure, trace, synthetic):
    from gateway.lab.experiments.catalog import PAIRS, SWEEPS
    from gateway.lab.experiments.sweeps import _identity, _matches

    cells = SWEEPS[trace](100)
    assert {c.spec.arrivals.kind for c in cells} == {"azure"}

    def key(cell) -> tuple:  # the cell with its arrivals' kind (and gamma's shape) left out
        spec = dataclasses.replace(cell.spec, arrivals=dataclasses.replace(cell.spec.arrivals, kind="poisson",
                                                                           shape=0.5))
        return repr(dataclasses.replace(cell, spec=spec))

    synthetic_cells = {key(c) for c in SWEEPS[synthetic](100)}
    assert all(key(c) in synthetic_cells for c in cells)
    rows = [_identity(c) for c in cells]
    pairs = PAIRS[trace](cells)
    assert pairs
    for pair in pairs:
        for side in (pair.a, pair.b):
            assert sum(_matches(r, side) for r in rows) == 1, (pair.name, side)
