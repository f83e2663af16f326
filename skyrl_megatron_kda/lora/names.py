"""Which linears a LoRA target list selects, by name alone (docs/lora.md): SkyRL's (megatron's)
module names mapped onto ours, what ``all-linear`` means, the linears whose weight the model
reads instead of calling them, and those refused. Both the model (``model.lora``) and the plan
(``memory.lora``) select by these rules; no torch here."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

# SkyRL's (megatron's) module names, each mapped onto the last name component of ours: the
# KDA layer plays megatron's gated-delta-net (``in_proj`` / ``out_proj``), MLA its attention
# (``linear_qkv`` / ``linear_proj``); the dense MLP and the shared experts use megatron's names.
SKYRL_NAMES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                   "linear_kv_down_proj"),
    "linear_proj": ("linear_proj",),
    "linear_fc1": ("linear_fc1",),
    "linear_fc2": ("linear_fc2",),
    # glm5_next's packed ``in_proj_qkvbfg_a`` (SkyRL's vLLM patch): f_a/g_a, not f_b/g_b
    "in_proj": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj"),
    "out_proj": ("o_proj",),
}
# What "all-linear" adapts: megatron's all-linear, every name above.
ALL_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")

# Linears whose weight the model reads instead of calling them: their adapter reaches the model
# through ``adapted_weight``, and input dropout (which would drop the adapter's input alone) is
# refused on them. (The ``tp_split=sequence`` rows path reads every MLA linear: ``_reads_weight``.)
_KDA_PROJECTION = "KDA's projection reads head slices of its weight (kda/layer.py, project)"
WEIGHT_READ_DIRECTLY = {
    **{name: _KDA_PROJECTION
       for name in ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj")},
    "f_a_proj": "KDA reads its low-rank f_a weight itself (kda/layer.py, project)",
    "g_a_proj": "KDA reads its low-rank g_a weight itself (kda/layer.py, project)",
    "linear_kv_up_proj": "DSA's kernels take its weight to expand the KV latent",
}
# Refused outright, with the reason.
REFUSED = {
    "output_layer": "the LM head reads its weight in the chunked log-probs (model/glm.py, "
                    "_vocab_weight) and a tied head is the embedding's",
}


def expand(names: Sequence[str]) -> list[str]:
    """Module-name patterns of ``names``: SkyRL's names (and ``all-linear``) become ours."""
    out: list[str] = []
    for name in names:
        if name == "all-linear":
            out.extend(n for key in ALL_LINEAR for n in SKYRL_NAMES[key])
        else:
            out.extend(SKYRL_NAMES.get(name, (name,)))
    return out


def matches(module_name: str, patterns: Sequence[str]) -> bool:
    """A pattern with a wildcard matches the whole dotted name, a plain one its last component."""
    last = module_name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(module_name, p) if any(c in p for c in "*?[") else last == p
               for p in patterns)
