"""Where and on what a run executes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import ConfigSection, PositiveInt


class RunConfig(ConfigSection):
    """Where and on what a run executes."""

    output_dir: str = "runs/default"
    """Folder for metrics.jsonl and the resolved recipe (relative to the working directory)."""
    device: Literal["cpu", "gpu"] = "cpu"
    """One rank per GPU (NCCL), or per CPU slot (gloo)."""
    num_workers: PositiveInt = 1
    """Total ranks (world size) = tp * cp * pp * dp; Ray starts one actor per rank."""
    ray_address: str | None = None
    """Ray cluster to join: "auto" (the one ``ray start`` started on this machine, or
    RAY_ADDRESS), "HOST:PORT" or "ray://HEAD:10001" (Ray Client). None: start a new local
    cluster for this command, never joining a running one."""
    resume: bool = Field(default=False, strict=True)
    """Continue from the latest checkpoint under output_dir/checkpoints (error if there is none)."""
    memory_report: bool = Field(default=False, strict=True)
    """GPU: record the allocator over the first step and write what is alive at its peak (or at
    an out-of-memory error), by the line that allocated it, to memory_report_rank<r>.txt in
    output_dir (``train/memory_report.py``)."""
    init_from_hf: str | None = None
    """Hugging Face glm5_next safetensors folder whose weights start the run (None: random init).
    Every rank reads it, so it must exist on every node when the run starts; with ``resume`` the
    checkpoint's weights win and this folder is only checked (export copies its config through)."""

    @property
    def torch_device(self) -> str:
        """The torch device type of ``device``: ``cuda`` for ``gpu``, else ``cpu``."""
        return "cuda" if self.device == "gpu" else "cpu"

    @field_validator("init_from_hf")
    @classmethod
    def _init_path_not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("run.init_from_hf is empty: give a checkpoint folder, or leave it unset")
        return value
