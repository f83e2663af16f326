"""The environment override of ``kda.cp_exchange``, applied to a raw mapping before validation
(``recipe_rules.load_recipe_dict`` calls it).

This is the only module of the package that reads environment variables
(``SKYRL_KDA_CP_EXCHANGE``), and it does so only inside ``env_cp_exchange`` (which
``apply_env_overrides`` calls), never at import. The values the variable may take are the
exchange registry's, passed in: the config imports no registry.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping, Sequence

from .kda import KDAConfig

logger = logging.getLogger(__name__)

CP_EXCHANGE_ENV = "SKYRL_KDA_CP_EXCHANGE"
"""Environment variable that overrides ``kda.cp_exchange`` (kept for jobs written against the
plugin's first release, which read only this)."""


def env_cp_exchange(choices: Sequence[str], environ: Mapping[str, str] | None = None) -> str | None:
    """The exchange ``SKYRL_KDA_CP_EXCHANGE`` names, one of ``choices`` (the registry's
    ``kda.cp_exchange`` values), or None when it is unset or empty. ``environ`` defaults to
    ``os.environ``."""
    env = os.environ if environ is None else environ
    value = env.get(CP_EXCHANGE_ENV)
    if not value:
        return None
    allowed = tuple(choices)
    if value not in allowed:
        raise ValueError(
            f"{CP_EXCHANGE_ENV}={value!r} is not a KDA CP exchange; "
            f"allowed values: {', '.join(allowed)}"
        )
    return value


def apply_env_overrides(raw: dict, choices: Sequence[str],
                        environ: Mapping[str, str] | None = None) -> dict:
    """Return a copy of ``raw`` with ``SKYRL_KDA_CP_EXCHANGE`` (one of ``choices``) applied to
    ``kda.cp_exchange``.

    Jobs written for the plugin's first release select the exchange with this variable; it is
    read here only, explicitly, and logged, so the config stays the single source of truth.
    An empty value counts as unset. ``environ`` defaults to ``os.environ``.
    """
    out = copy.deepcopy(raw)
    value = env_cp_exchange(choices, environ)
    if value is None:
        return out
    kda = out.get("kda")
    if kda is None:
        kda = out["kda"] = {}
    if not isinstance(kda, dict):
        raise ValueError(f"kda must be a mapping to apply {CP_EXCHANGE_ENV}, got {kda!r}")
    default = KDAConfig.model_fields["cp_exchange"].default
    configured = kda.get("cp_exchange", f"{default} (default)")
    logger.warning(
        "%s=%s overrides kda.cp_exchange (config value: %s)", CP_EXCHANGE_ENV, value, configured
    )
    kda["cp_exchange"] = value
    return out
