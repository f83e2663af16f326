"""Names of the files a training run writes into ``run.output_dir`` (``train.run`` writes them;
``train.report`` and ``train.export`` read them back). A module of its own so that reading a run
does not import the trainer, megatron-core or Ray."""

METRICS = "metrics.jsonl"
"""One JSON line of merged rank metrics per step."""

RECIPE = "recipe.yaml"
"""The recipe as the ranks ran it (``kda.cp_exchange=auto`` resolved)."""
