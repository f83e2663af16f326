"""SkyRL integration: a SkyRL RL job selects a KDA recipe through SkyRL's own seams.

``trainer.override_entrypoint=skyrl_megatron_kda.integrations.skyrl.entrypoint`` makes SkyRL's
``main_base`` hand the command line to ``entrypoint.main``, which parses it with
``config.KDASkyRLConfig`` (SkyRL's config plus a ``trainer.kda`` section naming the recipe) and
injects ``workers.KDAPolicyWorker`` and ``reference.KDARefWorker`` through
``RayPPOTrainer.build_models``. ``settings`` maps SkyRL's own settings onto the recipe (or refuses
them by name); ``gate`` lists what blocks a launch (the dry run exits 1 on any); ``offload``
serves colocation with SkyRL's Megatron offload helpers; ``local_ray`` starts Ray for a CPU job;
``tracking`` writes each step's metrics and console line.

skyrl is optional: importing this package without it raises an ImportError naming the extra.
"""

ENTRYPOINT = "skyrl_megatron_kda.integrations.skyrl.entrypoint"
"""The module to pass as ``trainer.override_entrypoint``."""

SKYRL_VERSION = "0.4.0"
"""The SkyRL release these seams were written against and are tested with."""

try:
    import skyrl.train.config  # noqa: F401  (the lightest module that needs all of SkyRL's config deps)
except ModuleNotFoundError as err:
    raise ImportError(
        f"skyrl_megatron_kda.integrations.skyrl needs SkyRL {SKYRL_VERSION} (missing module "
        f"{err.name!r}): pip install 'skyrl_megatron_kda[skyrl]' && "
        f"pip install --no-deps skyrl=={SKYRL_VERSION} (docs/skyrl.md says why --no-deps)"
    ) from err
