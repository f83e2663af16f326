"""The first-step memory report (``run.memory_report``): its replay of the allocator's history
finds the peak and what was alive then, on histories built by hand; the setting is refused on CPU."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from skyrl_megatron_kda.recipes import load_recipe
from skyrl_megatron_kda.train.memory_report import live_at_peak, peak_report

GIB = 2**30


def _alloc(addr, gib, filename="site-packages/skyrl_megatron_kda/model/kda_layer.py", line=1):
    frames = [{"filename": "/usr/lib/python3/torch/autograd/graph.py", "line": 9, "name": "apply"},
              {"filename": filename, "line": line, "name": "forward"}]
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": frames}


def _free(addr, gib):
    return {"action": "free_completed", "addr": addr, "size": int(gib * GIB)}


def test_peak_is_the_highest_point_and_lists_what_was_alive_then():
    events = [_alloc(1, 2), _alloc(2, 3, line=7), _free(1, 2), _alloc(3, 4, line=8),  # 7 GiB
              _free(2, 3), _alloc(4, 1), _free(3, 4)]
    peak, live, oom = live_at_peak(events)
    assert peak == 7 * GIB and sorted(live) == [2, 3] and oom is None
    report = peak_report(events, baseline_bytes=GIB)
    assert "at the step's peak: 7.00 GiB (total 8.00 GiB)" in report
    # Grouped by the project's frame (not torch's), largest first.
    rows = [r for r in report.splitlines() if "kda_layer.py" in r]
    assert rows[0].split()[:2] == ["4.00", "1"] and rows[0].endswith("kda_layer.py:8 forward")
    assert rows[1].split()[:2] == ["3.00", "1"]


def test_an_out_of_memory_error_is_reported_where_it_happened():
    events = [_alloc(1, 9), _free(1, 9), _alloc(2, 2), {"action": "oom", "size": 4 * GIB}]
    peak, live, oom = live_at_peak(events)
    # Not the earlier, higher point: what was alive when the request failed.
    assert peak == 2 * GIB and list(live) == [2] and oom["size"] == 4 * GIB
    assert "failed request: 4.00 GiB" in peak_report(events, 0)


def test_memory_report_is_refused_on_cpu():
    with pytest.raises(ValidationError, match="run.memory_report needs run.device=gpu"):
        load_recipe("glm53_flash_tiny", ["run.memory_report=true"], environ={}).recipe
    assert load_recipe("glm53_flash_slice", ["run.memory_report=true"], environ={}).recipe.run.memory_report
