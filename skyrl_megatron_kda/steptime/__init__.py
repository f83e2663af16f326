"""Seconds per training step of a recipe, before launch: each layer type's work on one rank,
priced by rates measured part by part on one H200 (``calibration.py``), and each collective's
bytes by the ``cluster`` section's links (``model.py``); ``table.py`` prints ``plan``'s section."""

from __future__ import annotations

from .model import Lever, Part, StepTime, estimate_step_time, levers
from .table import step_time_lines

__all__ = ["Lever", "Part", "StepTime", "estimate_step_time", "levers", "step_time_lines"]
