"""The analytic byte model of the exchanges at GLM-5.3-Flash dims (kda/README.md, byte formulas).

The measured bytes of real runs are checked against this same model in test_kda_parity.py."""

import pytest

from skyrl_megatron_kda.kda.exchanges import A2AExchange, AllGatherExchange, ExchangeShape

T = 2**20
GiB = 2**30


def shape(tp, cp, heads=64, hidden=4096):
    return ExchangeShape(tokens=T, batch=1, hidden=hidden, num_heads=heads, head_dim=128,
                         tp=tp, cp=cp, sequence_parallel=tp > 1)


def input_bytes(cls, s):
    return cls.bytes_moved(s)["cp"] - cls.output_bytes(s)


def test_glm_tp8_cp2_matches_reference_table():
    s = shape(8, 2)
    # The reference counts the projected width alone; a2a sends each peer's block padded to whole
    # 16-byte vectors (2,564 columns -> 2,568), so that the receiver's reorder is vectorised.
    block = s.projected_width // (s.tp * s.cp)
    assert (block, A2AExchange.block_width(s)) == (2564, 2568)
    assert input_bytes(A2AExchange, s) * block / A2AExchange.block_width(s) / GiB == pytest.approx(2.504, abs=1e-3)
    assert input_bytes(AllGatherExchange, s) / GiB == pytest.approx(0.5)
    assert A2AExchange.output_bytes(s) / GiB == pytest.approx(0.5)
    a2a, ag = A2AExchange.bytes_moved(s)["cp"], AllGatherExchange.bytes_moved(s)["cp"]
    assert ag <= a2a / 3, f"allgather {ag / GiB:.3f} GiB vs a2a {a2a / GiB:.3f} GiB"
    assert a2a / ag == pytest.approx(3.0, abs=0.01)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_input_ratio_is_padded_projected_width_over_cp_hidden_whatever_tp(tp, cp):
    s = shape(tp, cp)
    ratio = input_bytes(A2AExchange, s) / input_bytes(AllGatherExchange, s)
    assert ratio == pytest.approx(s.tp * s.cp * A2AExchange.block_width(s) / (cp * s.hidden))
    assert ratio == pytest.approx(10.0 / cp, rel=0.02)  # beta and the padding: 1.3% at one head per rank


def test_few_heads_make_a2a_cheaper():
    s = shape(1, 2, heads=8)
    ratio = input_bytes(A2AExchange, s) / input_bytes(AllGatherExchange, s)
    assert ratio == pytest.approx(0.63, abs=0.005)
    assert A2AExchange.bytes_moved(s)["cp"] < AllGatherExchange.bytes_moved(s)["cp"]


def test_allgather_edge_shrinks_as_cp_grows():
    ratios = [A2AExchange.bytes_moved(shape(8, cp))["cp"] / AllGatherExchange.bytes_moved(shape(8, cp))["cp"]
              for cp in (2, 4, 8)]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 1.25


def test_a2a_blocks_are_whole_16_byte_vectors():
    for tp, cp, heads in ((8, 2, 64), (1, 2, 8), (4, 4, 64), (1, 4, 16)):
        s = shape(tp, cp, heads=heads)
        for element_size in (2, 4):
            e = ExchangeShape(**{**s.__dict__, "element_size": element_size})
            width = A2AExchange.block_width(e)
            assert width * element_size % 16 == 0
            assert 0 <= width - e.projected_width // (tp * cp) < 16 // element_size


def test_cp1_moves_nothing_over_cp():
    for cls in (A2AExchange, AllGatherExchange):
        assert cls.bytes_moved(shape(8, 1))["cp"] == 0
