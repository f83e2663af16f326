"""What the command line shows besides its product: which library notices it hides, and how an
error reads (one line per problem; the traceback only with ``--debug``)."""

from __future__ import annotations

import logging
import sys
import warnings

import yaml
from pydantic import ValidationError

HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # (message prefix regex, category, module regex): notices about optional accelerators this
    # package does not use, or about calls made inside megatron-core that we cannot change.
    (r"Transformer Engine and Apex are not installed", UserWarning, ""),
    (r"Apex is not installed", UserWarning, r"megatron\.core"),
    (r"absl\.logging is not installed", UserWarning, ""),
    (r"Triton is not supported on current platform", UserWarning, ""),  # fla on a CPU host
    (r"full scope is deprecated", UserWarning, r"megatron\.core"),  # megatron's own default
    (r"", FutureWarning, r"torch\.distributed"),  # megatron's calls of renamed collectives
)
"""Python warnings that say nothing about this package's own use: hidden in the CLI and in every
Ray rank, so that the tables and errors are what a user sees."""

HARMLESS_LOG_RECORDS: dict[str, tuple[str, ...]] = {
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),  # any CPU host with a CUDA_HOME
    "ray._private.authentication.authentication_token_setup": (
        "Token authentication is enabled",),  # Ray's default for a local cluster; "disabled" stays
    "ray._private.worker": ("Started a local Ray instance",),
}
"""Log records (logger name -> message prefixes) of the same kind, from libraries that log
instead of warning."""

_installed = False


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_warnings() -> None:
    """Hide ``HARMLESS_WARNINGS`` and ``HARMLESS_LOG_RECORDS`` in this process; safe to call
    again. Called at CLI start, and as the worker setup hook of a Ray started by
    ``workers.group.init_ray`` in every worker process, before the libraries that emit them are
    imported."""
    global _installed
    if _installed:
        return
    _installed = True
    for message, category, module in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefixes in HARMLESS_LOG_RECORDS.items():
        logging.getLogger(name).addFilter(_DropPrefixes(prefixes))


# --- errors -------------------------------------------------------------------------------

USAGE_ERROR = 2
"""Exit status for input the command refuses (recipe, overrides, paths): argparse's own."""

RUNTIME_ERROR = 1
"""Exit status for a failure while running (a rank failed, an unexpected exception)."""


class RunFailure(RuntimeError):
    """A failure while running whose message says all a user needs (what happened, what was
    kept, how to go on): shown as ``error: <message>``, exit 1."""


def error_lines(err: BaseException, command: str | None = None) -> tuple[list[str], int]:
    """The lines ``error: ...`` that describe ``err``, raised by ``command``, to a user, and the
    exit status.

    Validation errors give one line per invalid value, named by its dotted path; an error from a
    Ray rank gives the rank's own exception first; anything else its message's first line."""
    # Looked up, not imported: an error raised before Ray and torch were imported cannot be a
    # rank's, and the message should not wait seconds for those imports.
    errors = sys.modules.get(__package__ + ".workers.errors")
    if isinstance(err, ValidationError):
        return [f"error: {err.title}: {line}" for line in validation_lines(err)], USAGE_ERROR
    if errors is not None and isinstance(err, errors.WorkerError):
        return [f"error: {worker_message(err, command)}"], RUNTIME_ERROR
    if isinstance(err, RunFailure):
        return [f"error: {message(err)}"], RUNTIME_ERROR
    if isinstance(err, yaml.YAMLError):
        return [f"error: {yaml_message(err)}"], USAGE_ERROR
    if isinstance(err, (ValueError, KeyError, OSError)):
        return [f"error: {message(err)}"], USAGE_ERROR
    return ([f"error: {type(err).__name__}: {message(err)} (--debug shows the traceback)"],
            RUNTIME_ERROR)


def validation_lines(err) -> list[str]:
    """``path.to.key: what is wrong`` for each error of a pydantic ``ValidationError``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(part) for part in e["loc"])
        kind, msg = e["type"], e["msg"]
        value = e.get("input")
        if kind == "extra_forbidden":
            msg = "unknown key"
        else:
            msg = msg.removeprefix("Value error, ")
            # A model-level rule's input is the whole section: its message names the values.
            if not isinstance(value, (dict, list)) and str(value) not in msg:
                msg = f"{msg}, got {value!r}"
        lines.append(f"{path}: {msg}" if path else msg)
    return lines


def worker_message(err, command: str | None = None) -> str:
    """A ``workers.errors.WorkerError`` as one line: the rank and its own message first (what to
    fix), then the failed command and the exception's type."""
    failed = f"{command} failed, " if command else ""
    return f"{message(err)} ({failed}{err.kind})"


def yaml_message(err: yaml.YAMLError) -> str:
    """A YAML syntax error as one line: what is wrong and where."""
    problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"not valid YAML: {problem}{where}"


def message(err: BaseException) -> str:
    """The first line of ``err``'s message (the whole text of a ``KeyError``, not its repr)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    lines = str(text).strip().splitlines()
    if not lines:
        return type(err).__name__
    if len(lines) > 1 and isinstance(err.__cause__, yaml.YAMLError):
        # A message that quotes a YAML error ends with the parser's multi-line report.
        return f"{lines[0].split(' (')[0]}: {yaml_message(err.__cause__)}"
    return lines[0]
