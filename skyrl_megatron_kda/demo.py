"""``skyrl-kda demo``: a check of the KDA layer's CP exchanges, not training (``skyrl-kda run``
trains). One KDA layer of the tiny recipe (``glm53_flash_tiny``) on a CP mesh of Ray actors (CPU
ranks over gloo by default), each exchange checked against CP=1, with the bytes it moved next to
the analytic model."""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from .config import Recipe, parse_overrides
from .kda import exchanges
from .kda.exchanges import ExchangeShape
from .kda.parity import check_exchange, fp32_tolerance, make_batch
from .recipes import get_recipe
from .tables import format_table
from .workers.group import ActorGroup, ensure_ray

DEMO_RECIPE = "glm53_flash_tiny"
"""The recipe whose KDA layer the demo checks (the one tiny recipe; its layer is
GLM-5.3-Flash-shaped with small dims)."""

DEMO_MESH = ("parallel.tp=1", "parallel.cp=2", "parallel.sequence_parallel=false", "parallel.ep=1")
"""The demo's default mesh, two ranks, over the recipe's own (``--set`` overrides it): one KDA
layer needs no expert parallelism, and CP alone is what the exchanges are about."""

TINY_LENGTHS = (96, 32, 8, 120)  # one packed row of 256 tokens (the recipe's data.seq_len)


def demo_recipe(overrides: Sequence[str] = (), exchange: str | None = None) -> Recipe:
    """The demo's recipe: ``DEMO_RECIPE`` on ``DEMO_MESH`` with ``overrides``, one rank per
    TP x CP position (``run.num_workers`` follows the mesh), and ``exchange`` if given."""
    pairs = [*DEMO_MESH, *overrides]
    mesh = parse_overrides(pairs).get("parallel")
    tp, cp = (mesh.get("tp"), mesh.get("cp")) if isinstance(mesh, dict) else (None, None)
    if isinstance(tp, int) and isinstance(cp, int):  # other values: the recipe refuses them
        pairs.append(f"run.num_workers={tp * cp}")
    if exchange is not None:
        pairs.append(f"kda.cp_exchange={exchange}")
    # The exchange under test is the one checked: SKYRL_KDA_CP_EXCHANGE must not replace it.
    return get_recipe(DEMO_RECIPE, pairs, environ={})


def check_on_mesh(rank: int, world: int, recipe: Recipe, lengths: tuple[int, ...]):
    """Rank side: megatron parallel state for the recipe's mesh, then the CP=1 comparison."""

    torch.set_num_threads(1)
    par = recipe.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp, context_parallel_size=par.cp)
    try:
        groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        singles = [dist.new_group([r]) for r in range(world)]
        batch = make_batch(recipe.model.hidden_size, lengths=lengths,
                           device=recipe.run.torch_device,
                           dtype=getattr(torch, recipe.model.params_dtype))
        return check_exchange(recipe, batch, groups.tp, groups.cp, singles[rank])
    finally:
        parallel_state.destroy_model_parallel()


def byte_table(tokens: int = 2**20) -> list[str]:
    """The analytic per-rank forward bytes of each exchange at GLM-5.3-Flash dims (bf16, SP on)."""
    rows = []
    for heads, hidden, meshes in ((64, 4096, ((8, 2), (8, 4), (8, 8), (1, 2))), (8, 4096, ((1, 2),))):
        for tp, cp in meshes:
            shape = ExchangeShape(tokens=tokens, batch=1, hidden=hidden, num_heads=heads, head_dim=128,
                                  tp=tp, cp=cp, sequence_parallel=tp > 1)
            a2a, ag = (exchanges.get(n).bytes_moved(shape)["cp"] for n in ("a2a", "allgather"))
            back = exchanges.get("a2a").output_bytes(shape)  # the same all-to-all for both
            rows.append((f"{heads} heads, hidden {hidden}", f"TP{tp}xCP{cp}", f"{a2a / 2**30:.3f}",
                         f"{ag / 2**30:.3f}", f"{a2a / ag:.2f}", f"{(a2a - back) / (ag - back):.2f}"))
    return [f"analytic CP bytes per rank per KDA layer, forward, T={tokens}, bf16 (backward: the "
            "mirror, plus allgather's rows gathered again)",
            *format_table(("model", "mesh", "a2a GiB", "allgather GiB", "a2a/allgather",
                           "input side"), rows, align="<<>>>>")]


def run_demo(overrides: Sequence[str], exchanges: Sequence[str]) -> bool:
    """Check each exchange on a CPU (or GPU) mesh; prints a table; True when every check passed."""
    # Every exchange's recipe is validated before Ray starts: a bad name or mesh fails at once.
    recipes = {name: demo_recipe(overrides, name) for name in exchanges}
    base = demo_recipe(overrides)
    world, device = base.run.num_workers, base.run.device
    print(f"KDA layer demo ({DEMO_RECIPE}): hidden {base.model.hidden_size}, {base.kda.num_heads} "
          f"heads x {base.kda.head_dim}, TP{base.parallel.tp} x CP{base.parallel.cp}"
          f"{' +SP' if base.parallel.sequence_parallel else ''}, packed documents {TINY_LENGTHS}, "
          f"{world} Ray {device} ranks", flush=True)
    started_here = ensure_ray(base.run)
    ok = True
    rows = []
    try:
        group = ActorGroup.for_recipe(base)
        for name, recipe in recipes.items():
            t0 = time.time()
            results = group.run(check_on_mesh, recipe, TINY_LENGTHS)
            out = max(r.errors["out"] for r in results)
            dx = max(r.errors["dx"] for r in results)
            grad = max(v for r in results for k, v in r.errors.items() if k.startswith("grad."))
            measured = results[0].measured_bytes.get("cp/fwd", {}).get("received", 0)
            model = results[0].model_bytes["cp"]
            tolerance = fp32_tolerance(name) if base.model.params_dtype == "float32" else 2e-2
            passed = max(out, dx, grad) <= tolerance and all(
                r.measured_bytes.get("cp/fwd", {}).get("received", 0) == r.model_bytes["cp"] for r in results)
            ok &= passed
            verdict = f"{'OK' if passed else 'FAIL'} (tol {tolerance:g}, {time.time() - t0:.1f} s)"
            rows.append((name, f"{out:.1e}", f"{dx:.1e}", f"{grad:.1e}", measured, model, verdict))
            print(f"{name}: {verdict}", flush=True)
        group.shutdown()
    finally:
        if started_here:
            ray.shutdown()
    print()
    print("\n".join(format_table(("exchange", "out err", "dx err", "grad err",
                                   "CP bytes/rank fwd", "model", "verdict"), rows,
                                  align="<>>>>><")))
    print("(errors: max relative to CP=1 over ranks)\n")
    print("\n".join(byte_table()))
    return ok
