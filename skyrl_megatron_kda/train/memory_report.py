"""What holds the GPU at a step's peak: torch's allocator history over one training step, reduced
to the tensors alive at the highest point (or at an out-of-memory error), grouped by the line of
this project or of its libraries that allocated them.

``skyrl-kda plan`` models the peak phase by phase; when a measured peak disagrees with it, this
report names the phase it missed. ``run.memory_report=true`` writes it for the first step to
``<output_dir>/memory_report_rank<r>.txt`` (GPU only: the history is CUDA's allocator's)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

OWN_CODE = ("skyrl_megatron_kda", "megatron/core", "fla/", "tilelang")
"""Frames that name who allocated a block: the first one from these packages, innermost first."""

_GIB = 2**30


def _origin(frames: list[dict]) -> str:
    for frame in frames:
        if any(part in frame["filename"] for part in OWN_CODE):
            path = frame["filename"].split("site-packages/")[-1]
            return f"{path}:{frame['line']} {frame['name']}"
    return "(outside the project and its libraries)"


def live_at_peak(events: list[dict]) -> tuple[int, dict[int, dict], dict | None]:
    """Replay one device's allocator events: the highest sum of live allocations, the blocks live
    then (address -> alloc event), and the out-of-memory event if the history has one (the peak
    is then the moment it happened, with the request that failed)."""
    live: dict[int, dict] = {}
    current = peak = 0
    peak_index = -1
    for i, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, peak_index = current, i
        elif action == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        elif action == "oom":
            return current, dict(live), event
    live = {}
    for event in events[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, live, None


def peak_report(events: list[dict], baseline_bytes: int, top: int = 30) -> str:
    """The report's text: the step's peak above ``baseline_bytes`` (what was allocated when
    recording started: weights, gradients, optimizer state) and the largest groups alive then."""
    peak, live, oom = live_at_peak(events)
    groups: dict[str, list[int]] = defaultdict(list)
    for event in live.values():
        groups[_origin(event.get("frames", []))].append(event["size"])
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    when = "at the out-of-memory error" if oom else "at the step's peak"
    lines = [f"allocated before the step: {baseline_bytes / _GIB:.2f} GiB",
             f"allocated during the step {when}: {peak / _GIB:.2f} GiB "
             f"(total {(baseline_bytes + peak) / _GIB:.2f} GiB)"]
    if oom:
        lines.append(f"the failed request: {oom.get('size', 0) / _GIB:.2f} GiB")
    lines.append(f"{'GiB':>8} {'blocks':>6}  allocated at")
    for origin, sizes in ranked[:top]:
        lines.append(f"{sum(sizes) / _GIB:8.2f} {len(sizes):6d}  {origin}")
    rest = ranked[top:]
    if rest:
        lines.append(f"{sum(sum(s) for _, s in rest) / _GIB:8.2f} {sum(len(s) for _, s in rest):6d}"
                     f"  ({len(rest)} more places)")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def recording(path: Path, max_entries: int = 2_000_000) -> Iterator[None]:
    """Record the allocator's history inside the block and write ``peak_report`` to ``path`` when
    it ends, also when it ends in an error (an out-of-memory step is what one wants explained)."""
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)
    try:
        yield
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        events = snapshot["device_traces"][torch.cuda.current_device()]
        path.write_text(peak_report(events, baseline))
