"""`skyrl-kda demo`: one KDA layer at CP2 on Ray CPU ranks; every exchange must pass."""

from skyrl_megatron_kda.cli import main


def test_demo_passes_on_ray_cpu_ranks(ray_cluster, capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.count(" OK (") == 6  # progress line and table row for each of the three exchanges
    assert "TP8xCP2" in out and "FAIL" not in out


def test_bytes_command_prints_the_glm_table(capsys):
    assert main(["bytes"]) == 0
    assert "3.00" in capsys.readouterr().out
