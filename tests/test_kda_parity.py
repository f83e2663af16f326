"""Every KDA CP exchange equals the CP=1 layer: outputs, input grads and param grads, on CPU.

One spawn of 8 gloo ranks runs the whole matrix (importing megatron-core costs seconds per
process); the tests below read its results. A case that raises fails its own tests only (the
rank code records it and goes on; see ``test_a_crashing_case_fails_only_itself``). fp32
throughout. The head-parallel exchanges only move and reorder rows and heads, so the only
differences allowed are fp32 summation order (~1e-7, tolerance 1e-5); ``state`` composes the
incoming state from fp32 summaries (measured ~6e-6, tolerance 1e-4). A layout bug gives errors of
order 1e-1..1 (see the negative controls).
"""

import pytest

from skyrl_megatron_kda.kda.parity import fp32_tolerance
from tests.support.ranks import run_ranks
from tests.support.kda_cases import CPU, Case, case_results, merge_ranks, parity_matrix


MESHES = [
    # (tp, cp, sequence_parallel)
    (1, 2, False),  # CP only
    (1, 4, False),
    (2, 2, True),  # TP x CP with SP: the production layout
    (2, 4, True),  # 8 ranks
]
CASES = [
    Case(exchange, tp, cp, sp, fmt)
    for exchange in ("a2a", "allgather", "state")
    for tp, cp, sp in MESHES
    for fmt in ("sbhd", "thd")
]
CASES += [
    Case("a2a", 2, 2, False, "sbhd"),  # a2a also works with TP but without SP
    Case("a2a", 2, 2, False, "thd"),
    Case("allgather", 2, 1, True, "thd"),  # CP=1 runs the same code path (TP/SP only)
    Case("state", 2, 2, False, "thd"),  # state needs no SP either
    Case("state", 1, 2, False, "sbhd8"),  # 8x longer sequences: same CP bytes
    Case("state", 2, 4, True, "sbhd8"),
]
# The contiguous CP layout (rank r holds rows [r*T/cp, (r+1)*T/cp) of the packed row): state
# passing through ranks in order, sequences cut anywhere, one shorter than the conv halo.
CASES += [
    Case("state", tp, cp, sp, fmt, layout="contiguous")
    for tp, cp, sp in MESHES
    for fmt in ("sbhd", "thd_short")
]
CASES += [
    Case(exchange, tp, cp, sp, "thd_short", layout="contiguous")
    for exchange in ("a2a", "allgather")
    for tp, cp, sp in ((1, 4, False), (2, 2, True))
]
CONTROLS = [
    Case("a2a", 1, 2, False, "sbhd", corrupt="contiguous_shards"),
    Case("allgather", 2, 2, True, "thd", corrupt="contiguous_shards"),
    Case("a2a", 2, 2, True, "thd", corrupt="skip_reorder"),
    Case("allgather", 1, 4, False, "sbhd", corrupt="skip_reorder"),
    Case("state", 1, 4, False, "thd", corrupt="contiguous_shards"),
    Case("state", 1, 2, False, "sbhd", corrupt="chain_order"),
    Case("state", 2, 4, True, "thd", corrupt="no_halo"),
    Case("state", 1, 4, False, "thd_short", corrupt="no_halo", layout="contiguous"),
]


@pytest.fixture(scope="module")
def results():
    return merge_ranks(run_ranks(8, parity_matrix, CASES + CONTROLS))


def _worst(results, case):
    worst = {}
    for r in case_results(results, case):
        for key, err in r.errors.items():
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_exchange_equals_cp1(results, case):
    assert len(case_results(results, case)) == case.tp * case.cp, "every rank of the mesh reported"
    worst = _worst(results, case)
    assert {"out", "dx"} <= worst.keys() and any(k.startswith("grad.A_log") for k in worst)
    tolerance = fp32_tolerance(case.exchange)
    bad = {k: v for k, v in worst.items() if not v <= tolerance}
    assert not bad, f"relative errors above {tolerance} (a layout bug gives 1e-1..1): {bad}"


@pytest.mark.parametrize("case", CONTROLS, ids=lambda c: c.id)
def test_negative_control_is_caught(results, case):
    worst = _worst(results, case)
    assert max(worst["out"], worst["dx"]) > 1e-2, (
        f"a deliberately wrong layout ({case.corrupt}) went unnoticed: {worst}"
    )


@pytest.mark.parametrize("case", [c for c in CASES if c.cp > 1], ids=lambda c: c.id)
def test_measured_bytes_equal_model(results, case):
    for r in case_results(results, case):
        for group in ("cp", "tp"):
            for phase, model in (("fwd", r.model_bytes), ("bwd", r.model_bytes_bwd)):
                measured = r.measured_bytes.get(f"{group}/{phase}", {"sent": 0, "received": 0})
                assert measured["sent"] == measured["received"] == model[group], (
                    f"{group}/{phase}: measured {measured}, model {model[group]}"
                )
        assert r.model_bytes["cp"] > 0


@pytest.mark.parametrize("tp,cp,sp", [(1, 2, False), (2, 4, True)])
def test_state_bytes_do_not_grow_with_sequence_length(results, tp, cp, sp):
    short = case_results(results, Case("state", tp, cp, sp, "sbhd"))
    long = case_results(results, Case("state", tp, cp, sp, "sbhd8"))
    for a, b in zip(short, long):
        assert a.measured_bytes["cp/fwd"] == b.measured_bytes["cp/fwd"]
        assert a.measured_bytes["cp/bwd"] == b.measured_bytes["cp/bwd"]


def test_activation_memory_per_rank_is_cp1s_share():
    """Between forward and backward a CP2 rank keeps at most half of what the CP=1 layer keeps
    (plus the projection weights' copies, which do not shrink with CP; 4% here). Hidden rows wide
    against the projected heads (1024 vs 2 heads x 16), as GLM's 4096 against 8 local heads: an
    exchange that kept its gathered rows for backward (``allgather`` did) measured 0.61."""
    from tests.support.kda_cases import Setup, saved_activation_bytes

    setup = Setup(hidden=1024, heads=2, head_dim=16, low_rank=8)
    for saved in run_ranks(2, saved_activation_bytes, ("a2a", "allgather", "state"), setup, 1024):
        shares = {name: saved[name] / saved["cp1"] for name in ("a2a", "allgather", "state")}
        assert all(share <= 0.5 * 1.04 for share in shares.values()), shares


def test_a_crashing_case_fails_only_itself():
    """One rank of a CP2 mesh raises in the first case while its peer enters the exchange: that
    case reports both ranks' failure, and the next case on the same mesh still passes."""
    crash = Case("a2a", 1, 2, False, "sbhd", corrupt="crash_rank0")
    after = Case("a2a", 1, 2, False, "thd")
    results = merge_ranks(run_ranks(2, parity_matrix, [crash, after], CPU, 20))  # 20 s wait
    with pytest.raises(AssertionError, match=r"(?s)raised.*rank 0:.*deliberate crash on rank 0"
                                             r".*rank 1:.*"):
        case_results(results, crash)
    assert len(case_results(results, after)) == 2
    worst = _worst(results, after)
    assert max(worst.values()) <= fp32_tolerance("a2a"), worst
