"""benchmarks/engine/gemm_roofline.py's arithmetic: the fractions a W-decode or ShareGPT run
reports against the GEMM roofline timed beside it (the timing itself is the benchmark's)."""
from __future__ import annotations

import pytest

from benchmarks.engine.gemm_roofline import RooflineSampler


def sampler(batch: int, steps: list[float], prefill: float, stream_gbps: float) -> RooflineSampler:
    """A sampler with these timings, without building or timing any GEMM."""
    s = RooflineSampler.__new__(RooflineSampler)
    s.batch, s.samples, s.prefill_samples, s.stream_samples = batch, steps, [prefill], [stream_gbps]
    return s


def test_a_mixed_length_workload_is_priced_at_full_decode_steps_of_the_engines_limit():
    # 500 requests, 144,114 output tokens: 143,614 decode rows at 0.2 s per 256-row step
    s = sampler(256, [0.25, 0.2, 0.3], prefill=10.0, stream_gbps=50.0)
    out = s.mixed_summary(generated=144_114, requests=500, elapsed_s=200.0)
    gemm_s = 10.0 + 143_614 * 0.25 / 256
    assert out["workload_roofline_tok_per_s"] == pytest.approx(144_114 / gemm_s, abs=0.1)
    assert out["fraction_of_workload_roofline"] == pytest.approx(144_114 / 200.0 / (144_114 / gemm_s),
                                                                 abs=1e-3)
    best_s = 10.0 + 143_614 * 0.2 / 256
    assert out["workload_roofline_tok_per_s_vs_best"] == pytest.approx(144_114 / best_s, abs=0.1)
    assert "workload_ceiling_with_kv_read" not in out      # no K/V bytes given


def test_the_kv_read_ceiling_adds_the_decode_reads_at_the_stream_rate():
    s = sampler(256, [0.25], prefill=10.0, stream_gbps=50.0)
    out = s.mixed_summary(generated=144_114, requests=500, elapsed_s=200.0, decode_kv_bytes=100e9)
    gemm_s = 10.0 + 143_614 * 0.25 / 256
    assert out["kv_read_s_at_stream_rate"] == pytest.approx(2.0)
    assert out["workload_ceiling_with_kv_read"] == pytest.approx(gemm_s / (gemm_s + 2.0), abs=1e-3)


def test_a_fixed_length_workload_keeps_its_decode_and_workload_fractions():
    # W-decode: 128 rows x 128 tokens, 0.1 s a step, 1 s of prefill GEMMs, 14 s run
    s = sampler(128, [0.1], prefill=1.0, stream_gbps=50.0)
    out = s.summary(128, 128 * 128, 14.0)
    assert out["roofline_tok_per_s"] == pytest.approx(1280.0)
    assert out["workload_roofline_tok_per_s"] == pytest.approx(128 * 128 / (1.0 + 127 * 0.1), abs=0.1)
    assert out["fraction_of_roofline"] == pytest.approx(128 * 128 / 14.0 / 1280.0, abs=1e-3)
