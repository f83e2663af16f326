"""The main job until the full recipe lands: one GLM-5.3-Flash-shaped KDA layer on a CP mesh of
Ray actors (CPU ranks over gloo by default), each exchange checked against CP=1, with the bytes
it moved next to the analytic model."""

from __future__ import annotations

import time

import ray

from .config import LayerRecipe, load_layer_recipe, merge
from .kda.exchange import EXCHANGES, ExchangeShape

# Tiny GLM-5.3-Flash-shaped layer: same structure, small dims; packed THD with uneven documents.
TINY = {
    "model": {"hidden_size": 64, "params_dtype": "float32"},
    "parallel": {"tp": 1, "cp": 2},
    "kda": {"num_heads": 4, "head_dim": 16, "gate_low_rank": 16, "output_gate_low_rank": 16,
            "kernel": "torch"},
    "data": {"seq_len": 256},
}
TINY_LENGTHS = (96, 32, 8, 120)  # one packed row of 256 tokens


def check_on_mesh(rank: int, world: int, recipe: LayerRecipe, lengths: tuple[int, ...]):
    """Rank side: megatron parallel state for the recipe's mesh, then the CP=1 comparison."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from .kda.parity import check_exchange, make_batch

    torch.set_num_threads(1)
    par = recipe.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp, context_parallel_size=par.cp)
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        singles = [dist.new_group([r]) for r in range(world)]
        device = "cpu" if recipe.kda.kernel == "torch" else "cuda"
        batch = make_batch(recipe.model.hidden_size, lengths=lengths, device=device,
                           dtype=getattr(torch, recipe.model.params_dtype))
        return check_exchange(recipe, batch, groups.tp, groups.cp, singles[rank])
    finally:
        parallel_state.destroy_model_parallel()


def byte_table(tokens: int = 2**20) -> list[str]:
    """The analytic per-rank forward bytes of each exchange at GLM-5.3-Flash dims (bf16, SP on)."""
    lines = [f"analytic CP bytes per rank per KDA layer, forward, T={tokens}, bf16 (backward: the mirror, plus allgather's rows gathered again)",
             f"{'model':<22}{'mesh':<10}{'a2a GiB':>9}{'allgather GiB':>15}{'a2a/allgather':>15}"
             f"{'input side':>12}"]
    for heads, hidden, meshes in ((64, 4096, ((8, 2), (8, 4), (8, 8), (1, 2))), (8, 4096, ((1, 2),))):
        for tp, cp in meshes:
            shape = ExchangeShape(tokens=tokens, batch=1, hidden=hidden, num_heads=heads, head_dim=128,
                                  tp=tp, cp=cp, sequence_parallel=tp > 1)
            a2a, ag = (EXCHANGES[n].bytes_moved(shape)["cp"] for n in ("a2a", "allgather"))
            back = EXCHANGES["a2a"].output_bytes(shape)  # the same all-to-all for both
            name = f"{heads} heads, hidden {hidden}"
            lines.append(f"{name:<22}{f'TP{tp}xCP{cp}':<10}{a2a / 2**30:>9.3f}{ag / 2**30:>15.3f}"
                         f"{a2a / ag:>15.2f}{(a2a - back) / (ag - back):>12.2f}")
    return lines


def run_demo(overrides: dict, exchanges: list[str]) -> bool:
    """Check each exchange on a CPU (or GPU) mesh; prints a table; True when every check passed."""
    from .kda.parity import fp32_tolerance
    from .workers.group import ActorGroup

    base = load_layer_recipe(merge(TINY, overrides))
    world = base.parallel.tp * base.parallel.cp
    device = "cpu" if base.kda.kernel == "torch" else "gpu"
    print(f"KDA layer demo: hidden {base.model.hidden_size}, {base.kda.num_heads} heads x "
          f"{base.kda.head_dim}, TP{base.parallel.tp} x CP{base.parallel.cp}"
          f"{' +SP' if base.parallel.sequence_parallel else ''}, packed documents {TINY_LENGTHS}, "
          f"{world} Ray {device} ranks", flush=True)
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=max(world, 1), include_dashboard=False, log_to_driver=False)
    ok = True
    try:
        group = ActorGroup(world, device)
        rows = [f"{'exchange':<11}{'out err':>9}{'dx err':>9}{'grad err':>10}"
                f"{'CP bytes/rank fwd':>19}{'model':>9}  verdict"]
        for name in exchanges:
            t0 = time.time()
            recipe = base.model_copy(update={"kda": base.kda.model_copy(update={"cp_exchange": name})})
            results = group.run(check_on_mesh, load_layer_recipe(recipe.model_dump()), TINY_LENGTHS)
            out = max(r.errors["out"] for r in results)
            dx = max(r.errors["dx"] for r in results)
            grad = max(v for r in results for k, v in r.errors.items() if k.startswith("grad."))
            measured = results[0].measured_bytes.get("cp/fwd", {}).get("received", 0)
            model = results[0].model_bytes["cp"]
            tolerance = fp32_tolerance(name) if base.model.params_dtype == "float32" else 2e-2
            passed = max(out, dx, grad) <= tolerance and all(
                r.measured_bytes.get("cp/fwd", {}).get("received", 0) == r.model_bytes["cp"] for r in results)
            ok &= passed
            rows.append(f"{name:<11}{out:>9.1e}{dx:>9.1e}{grad:>10.1e}{measured:>19}{model:>9}  "
                        f"{'OK' if passed else 'FAIL'} (tol {tolerance:g}, {time.time() - t0:.1f} s)")
            print(rows[-1], flush=True)
        group.shutdown()
    finally:
        if started_here:
            ray.shutdown()
    print("\n" + "\n".join(rows))
    print("(errors: max relative to CP=1 over ranks)\n")
    print("\n".join(byte_table()))
    return ok
