"""The whole recipe and the checks that span its sections.

``MeshRecipe`` is what one KDA layer needs on its mesh (model, mesh, kda, data, cluster);
``Recipe`` adds the optimisation loop and where the job runs. The rules that ask a registry (the
exchange on the mesh, the DSA kernel on the device, the CP layout's row multiple) are
``recipe_rules``'s, applied wherever a recipe is loaded.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import ConfigSection
from .cluster import ClusterConfig
from .data import DataConfig
from .dotpath import flatten
from .kda import KDAConfig
from .model import KERNEL_OPTIONS, DSAConfig, ModelConfig
from .parallel import ParallelConfig
from .run import RunConfig
from .train import TrainConfig

MODEL_SECTIONS = ("model", "kda")
"""The recipe sections that say what the model is. A checkpoint loads only into the model that
saved it, so a resume refuses a change to any of their settings (``train.run_folder``) except
``MODEL_LEVERS``; a new setting in them is compared until it is listed there."""

MODEL_LEVERS = frozenset({
    # How the DSA layers compute the same function: kernel, TP split, query blocks, and every
    # kernel's own options (what the backward keeps or recomputes, the latent gradient's
    # summation order, the indexer's product precision: kernel choices, like model.dsa.kernel).
    "model.dsa.kernel", "model.dsa.tp_split", "model.dsa.indexer_query_block",
    *(f"model.dsa.{kernel}.{option}" for kernel in KERNEL_OPTIONS
      for option in DSAConfig.model_fields[kernel].annotation.model_fields),
    # How routed rows reach their experts (the same parameters and arithmetic per row).
    "model.moe.dispatcher",
    # mHC's map projection in row chunks (a memory lever: fp32 summation order only).
    "model.hyper_connections.map_chunk_rows",
    # The KDA layer's CP exchange and its choice, kernel and chunking.
    "kda.cp_exchange", "kda.allow_inexact", "kda.kernel", "kda.fla_backward",
    "kda.chunk_size", "kda.kernel_segments", "kda.kernel_head_group",
})
"""Settings of ``MODEL_SECTIONS`` that change how the same parameters compute the same model
(memory, chunking, kernels, exchange, layout), not their shapes or the model's meaning: free to
change on a resume, like the mesh (``parallel``, ``run.num_workers``)."""


def model_meaning(dump: dict) -> dict:
    """The settings that make the model what it is, by dotted name (every setting of
    ``MODEL_SECTIONS`` but ``MODEL_LEVERS``), from a recipe's ``model_dump(mode="json")`` or
    the ``recipe.yaml`` a run wrote."""
    sections = flatten({section: dump.get(section) or {} for section in MODEL_SECTIONS})
    return {name: value for name, value in sections.items() if name not in MODEL_LEVERS}


class MeshRecipe(ConfigSection):
    """The model on its mesh: model, parallel layout, KDA layer, batch shape and cluster, with the
    checks that span them. It is all that one KDA layer or the cost model of ``auto`` reads;
    ``Recipe`` adds the optimisation loop and where the job runs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model sizes."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel layout."""
    kda: KDAConfig = Field(default_factory=KDAConfig)
    """The KDA layer and its CP exchange."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Batch shape."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Nodes, GPUs and links, read only by the cost models (``auto`` and the step time)."""

    @model_validator(mode="after")
    def _heads_divisible_by_tp(self) -> MeshRecipe:
        heads, tp = self.kda.num_heads, self.parallel.tp
        if heads % tp:
            raise ValueError(
                f"kda.num_heads={heads} must be divisible by tp={tp}: each TP rank owns whole heads"
            )
        return self

    @model_validator(mode="after")
    def _cp_shard_fits_sequence_parallel(self) -> MeshRecipe:
        seq_len, p = self.data.seq_len, self.parallel
        if p.sequence_parallel and (seq_len // p.cp) % p.tp:
            raise ValueError(
                f"data.seq_len/cp = {seq_len}/{p.cp} = {seq_len // p.cp} tokens per CP rank must "
                f"be divisible by tp={p.tp} under sequence parallelism: each TP rank holds 1/tp "
                "of its CP rank's tokens"
            )
        return self


class Recipe(MeshRecipe):
    """A whole training job: the model, its mesh, data, optimisation and where it runs.

    Megatron's world-size rule: ``run.num_workers`` must be divisible by ``tp * cp * pp`` (the rest
    is data parallelism) and by ``ep * etp * pp`` (the expert mesh folds over the same ranks).
    """

    description: str = ""
    """One line saying what the recipe is for (``skyrl-kda recipes`` prints it)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation loop."""
    run: RunConfig = Field(default_factory=RunConfig)
    """Ranks, device and output folder."""

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the dense mesh: num_workers / (tp * cp * pp)."""
        p = self.parallel
        return self.run.num_workers // (p.tp * p.cp * p.pp)

    @model_validator(mode="after")
    def _world_size_fits_mesh(self) -> Recipe:
        p, world = self.parallel, self.run.num_workers
        dense, expert = p.tp * p.cp * p.pp, p.ep * p.etp * p.pp
        if world % dense:
            raise ValueError(
                f"run.num_workers={world} must be divisible by tp*cp*pp = {p.tp}*{p.cp}*{p.pp} = "
                f"{dense}: the ranks left over form the data-parallel replicas"
            )
        if world % expert:
            raise ValueError(
                f"run.num_workers={world} must be divisible by ep*etp*pp = {p.ep}*{p.etp}*{p.pp} "
                f"= {expert}: Megatron folds the expert mesh over the same ranks"
            )
        return self

    @model_validator(mode="after")
    def _experts_fit_mesh(self) -> Recipe:
        p, moe = self.parallel, self.model.moe
        if moe.num_experts % p.ep:
            raise ValueError(
                f"model.moe.num_experts={moe.num_experts} must be divisible by ep={p.ep}: each "
                "expert-parallel rank owns whole experts"
            )
        if moe.ffn_hidden_size % p.etp:
            raise ValueError(
                f"model.moe.ffn_hidden_size={moe.ffn_hidden_size} must be divisible by "
                f"etp={p.etp}: expert tensor parallelism splits each expert's columns"
            )
        if p.ep > 1 and p.tp > 1 and not p.sequence_parallel:
            raise ValueError(
                f"ep={p.ep} with tp={p.tp} needs parallel.sequence_parallel=true (Megatron's MoE "
                "token dispatch requires it)"
            )
        return self

    @model_validator(mode="after")
    def _dense_parts_divisible_by_tp(self) -> Recipe:
        m, tp = self.model, self.parallel.tp
        if m.vocab_size % tp:
            raise ValueError(
                f"model.vocab_size={m.vocab_size} must be divisible by tp={tp}: the embedding and "
                "output layer split the vocabulary")
        if m.dsa.num_heads % tp:
            raise ValueError(
                f"model.dsa.num_heads={m.dsa.num_heads} must be divisible by tp={tp}: each TP "
                "rank owns whole attention heads"
            )
        if m.dense_ffn_hidden_size % tp:
            raise ValueError(
                f"model.dense_ffn_hidden_size={m.dense_ffn_hidden_size} must be divisible by "
                f"tp={tp}: tensor parallelism splits the FFN columns"
            )
        if tp > 1 and "dsa" in m.layer_types() and not self.parallel.sequence_parallel:
            raise ValueError(
                f"DSA layers at tp={tp} need parallel.sequence_parallel=true: without it megatron "
                "sums the duplicated q_layernorm gradient over TP (dsa/layer.py)"
            )
        return self

    @model_validator(mode="after")
    def _gpu_settings_fit_device(self) -> Recipe:
        if self.run.device == "cpu" and self.kda.kernel == "fla":
            raise ValueError(
                "kda.kernel=fla needs run.device=gpu (fla's kernels are Triton on CUDA); "
                "use kda.kernel=torch or auto on CPU"
            )
        if self.run.device == "cpu" and self.kda.fla_backward == "tilelang":
            raise ValueError("kda.fla_backward=tilelang needs run.device=gpu (fla's TileLang "
                             "kernels are CUDA); use kda.fla_backward=triton on CPU")
        if self.run.device == "cpu" and self.run.memory_report:
            raise ValueError("run.memory_report needs run.device=gpu (it reads CUDA's allocator "
                             "history); leave it false on CPU")
        return self

    @model_validator(mode="after")
    def _optimizer_offload_fits_device(self) -> Recipe:
        fraction = self.train.optimizer_offload_fraction
        if fraction and self.run.device == "cpu":
            raise ValueError(
                f"train.optimizer_offload_fraction={fraction} needs run.device=gpu: megatron's "
                "HybridDeviceOptimizer offloads only CUDA parameters (a CPU rank's step fails); "
                "use 0 on CPU")
        return self
