"""Where a rank sits in SkyRL's (dp, sp, tp, pp) view of the recipe's megatron mesh.

SkyRL splits rollout batches over ``MeshRank.dp`` and collects results from tp=0, sp=0 ranks;
its own Megatron worker puts the CP rank in ``sp``, and so do we.
"""

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator
from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank

from ...config import Recipe


def mesh_rank(recipe: Recipe, rank: int) -> MeshRank:
    """SkyRL's view of ``rank`` (dp, sp=cp, tp, pp) in megatron's default rank order, computed
    with megatron's own ``RankGenerator`` before its process groups exist."""
    p = recipe.parallel
    dp = recipe.data_parallel_size
    ranks = RankGenerator(tp=p.tp, ep=1, dp=dp, pp=p.pp, cp=p.cp, order="tp-cp-ep-dp-pp")

    def index(axis: str) -> int:
        return next(group.index(rank) for group in ranks.get_ranks(axis) if rank in group)

    return MeshRank(dp=index("dp"), sp=index("cp"), tp=index("tp"), pp=index("pp"),
                    world_size=recipe.run.num_workers, dp_size=dp, pp_size=p.pp)


def megatron_mesh_rank(recipe: Recipe) -> MeshRank:
    """The same view read from megatron's initialised parallel state."""
    return MeshRank(dp=ps.get_data_parallel_rank(), sp=ps.get_context_parallel_rank(),
                    tp=ps.get_tensor_model_parallel_rank(),
                    pp=ps.get_pipeline_model_parallel_rank(),
                    world_size=recipe.run.num_workers, dp_size=ps.get_data_parallel_world_size(),
                    pp_size=ps.get_pipeline_model_parallel_world_size())


def build_line(recipe: Recipe, role: str) -> str:
    """What a worker group built, said once by its first rank: the mesh, the KDA exchange and
    the DSA kernel in use (a run's logs then show which exchange each group really runs)."""
    p, m = recipe.parallel, recipe.model
    parts = [f"TP{p.tp} x CP{p.cp}" + (" +SP" if p.sequence_parallel else "")
             + f", EP{p.ep} x ETP{p.etp}", f"KDA exchange {recipe.kda.cp_exchange}"]
    if "dsa" in m.layer_types():
        parts.append(f"DSA kernel {m.dsa.kernel} (tp_split {m.dsa.tp_split})")
    return f"{role}: {recipe.run.num_workers} ranks built: " + ", ".join(parts)

