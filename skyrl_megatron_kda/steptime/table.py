"""``skyrl-kda plan``'s step-time section: the parts, the total, tokens/s/GPU, the dominant term
and what the next lever would buy."""

from __future__ import annotations

from ..config import Recipe
from ..tables import format_table
from .model import estimate_step_time, levers, unpriced_dispatcher, unpriced_dsa_kernel


def step_time_lines(recipe: Recipe) -> list[str]:
    why = unpriced_dsa_kernel(recipe) or unpriced_dispatcher(recipe)
    if why is not None:
        return [f"step time: not estimated: {why}"]
    step = estimate_step_time(recipe)
    c = recipe.cluster
    lines = [
        f"step time estimate (s per optimizer step, one rank; {step.tokens} tokens over {step.gpus} "
        f"{c.gpu.upper()} GPUs, {c.gpus_per_node} per node, {c.inter_node_kind} between nodes); "
        "compute and "
        "communication in series (no overlap assumed; bound with full overlap below)",
    ]
    if recipe.run.device == "cpu":
        lines.append("(rates measured on one H200: the times below are that GPU's, not this CPU recipe's)")
    elif c.gpu != "h200":
        lines.append(f"(rates measured on one H200, scaled to the {c.gpu.upper()} by its spec "
                     "sheet: docs/step_time.md)")
    rows = [(p.name, str(p.layers or ""), f"{p.compute_s:.2f}", f"{p.comm_s:.2f}", f"{p.total_s:.2f}",
             f"{100 * p.total_s / step.step_s:.0f}%", p.what) for p in step.parts if p.total_s > 0]
    rows.append(("total", "", f"{step.compute_s:.2f}", f"{step.comm_s:.2f}", f"{step.step_s:.2f}",
                 "100%", ""))
    lines += format_table(("part", "layers", "compute s", "comm s", "total s", "share", "communication"),
                          rows, align="<>>>>><")
    lines.append("not priced: the embedding lookup (under a millisecond per 32,768 rows; "
                 "docs/step_time.md); modelled, not measured: every collective and the network")
    term, seconds = step.dominant()
    lines.append(f"step: {step.step_s:.2f} s, {step.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
                 f"({step.tokens / step.step_s:,.0f} tokens/s); with every collective hidden: "
                 f"{step.overlapped_s:.2f} s")
    lines.append(f"dominant: {term}, {seconds:.2f} s ({100 * seconds / step.step_s:.0f}%)")
    for lever in levers(recipe, step):
        lines.append(f"lever: {lever.name} -> {lever.step_s:.2f} s per step "
                     f"({step.step_s / lever.step_s:.2f}x; {lever.why})")
    return lines
