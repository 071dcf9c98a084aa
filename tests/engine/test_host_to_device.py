"""Host-to-device copies without host waits (engine/host_to_device.py): one packed copy gives
the same tensors as one copy per field, and a failed pin falls back with one warning. The
side-stream ordering itself needs a GPU (tests/engine/test_cuda_paths.py runs the engine on it)."""
from __future__ import annotations

import logging

import pytest
import torch

from batchinfer.engine import host_to_device
from batchinfer.engine.host_to_device import packed_to_device
from batchinfer.engine.step_plan import INPUT_DTYPES, StepPlan, model_inputs


def test_one_packed_copy_gives_each_field_in_its_dtype():
    parts = {"a": [1, 2, 3], "b": [], "c": [7], "u": [0.25, 0.5]}
    dtypes = {"a": torch.int32, "b": torch.long, "c": torch.long, "u": torch.float64}
    out = packed_to_device(parts, dtypes, torch.device("cpu"), carrier=torch.float64)
    for name, values in parts.items():
        assert out[name].dtype == dtypes[name]
        assert out[name].tolist() == values


def test_packed_model_inputs_equal_one_tensor_per_field():
    plan = StepPlan(mb_id=0, input_ids=[5, 6, 7, 8, 9, 10], query_lens=[1, 4, 1],
                    seq_lens=[17, 4, 40], block_tables=[[3, 4], [7], [1, 2, 9]],
                    sample_items=[0, 1, 2], sample_request_ids=["a", "b", "c"],
                    sample_output_lens=[3, 0, 9])
    plain = model_inputs(plan, 16, torch.device("cpu"), packed=False)
    packed = model_inputs(plan, 16, torch.device("cpu"), packed=True)
    for name in ("input_ids", "positions", "logits_rows"):
        assert torch.equal(getattr(plain, name), getattr(packed, name))
    for name in ("query_start", "seq_lens", "block_tables", "slot_blocks", "slot_offsets"):
        got, want = getattr(packed.meta, name), getattr(plain.meta, name)
        assert got.dtype == want.dtype == INPUT_DTYPES[name] and torch.equal(got, want), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here: nothing to fall back from")
def test_a_failed_pin_falls_back_to_pageable_memory_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(host_to_device, "_pinning_failed", False)
    cpu = torch.arange(4)
    with caplog.at_level(logging.WARNING, logger="batchinfer.engine.host_to_device"):
        assert host_to_device.pinned(cpu) is cpu     # no accelerator: torch refuses to pin
        assert host_to_device.pinned(cpu) is cpu
    assert len(caplog.records) == 1 and "pageable" in caplog.records[0].getMessage()
