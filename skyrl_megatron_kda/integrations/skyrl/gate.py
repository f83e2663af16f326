"""What blocks a KDA SkyRL job's launch, checked on the head node before Ray starts.

Two lists. ``input_errors``: what the launch will read or import and cannot (the data files and
their first record, the environments the data and the config name, the sampling settings the
chosen sampler serves, the batch against the data's size, the logger's module, the checkpoint
to resume from); the entrypoint prints each as one ``error:`` line and exits 2, dry run or not.
``launch_blockers``: settings the KDA workers or SkyRL refuse and the model folders; the
entrypoint prints the list under ``launch blocked by:`` (the dry run, after its provenance table)
or refuses the launch with it, exit 1. Each check contributes one line per problem, so a new
check is one more line in one of the two lists; either way the command exits non-zero, so a CI
job can use the dry run as a gate.
"""

import glob
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import skyrl_gym
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.tracking import Tracking
from skyrl.train.utils.trainer_utils import GLOBAL_STEP_PREFIX

from ...config import Recipe
from ...console import message
from ...model.hf_io import check_hf_config
from .config import uses_reference
from .fully_async import fully_async_problems
from .glm5_next_client import sampling_refusals
from .tracking import LOGGER_MODULES
from .settings import decided_settings, missing_weights_folders, reference_settings


def launch_blockers(cfg, recipe: Recipe, refused: List[str]) -> List[str]:
    """Everything that blocks the launch of ``cfg`` (after ``config.apply_recipe``, whose
    ``refused`` settings come first), one line each; empty: ready."""
    return [
        *refused,
        *skyrl_config_errors(cfg),
        *fully_async_problems(cfg),
        *model_folder_problems(cfg, recipe),
        *env_module_problems(cfg.trainer.kda.env_modules),
    ]


def env_module_problems(names: List[str]) -> List[str]:
    """``trainer.kda.env_modules`` that cannot be imported here, one line each. Checked without
    importing them (the experiment imports them on the node it runs on)."""
    problems = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or an empty name
            found = False
        if not found:
            problems.append(f"trainer.kda.env_modules: no module {name!r} to import (the "
                            "experiment imports it to register its environments; put its folder "
                            "on PYTHONPATH)")
    return problems


def skyrl_config_errors(cfg) -> List[str]:
    """SkyRL's own ``validate_cfg`` as one line (empty: it passed). SkyRL checks the job with
    ``assert`` and ``ValueError`` and stops at the first failure."""
    try:
        validate_cfg(cfg)
    except (AssertionError, ValueError) as err:
        return [f"SkyRL's validate_cfg: {message(err)}"]
    return []


def model_folder_problems(cfg, recipe: Recipe) -> List[str]:
    """The model folders the workers will load (``trainer.policy.model.path``, the reference's
    when SkyRL builds one, or the recipe's ``run.init_from_hf``), checked here as the workers
    check them: a folder with a ``config.json`` that describes the recipe's model (each
    differing field named). Reads config.json only, never the weights."""
    t = cfg.trainer
    decided = decided_settings(t, recipe, model_path=t.policy.model.path)
    if uses_reference(t):
        decided += reference_settings(t, recipe, t.ref.model.path)[1]
    # Policy and reference usually name the same folder: one line each.
    paths = list(dict.fromkeys(d for d in decided if d.key == "run.init_from_hf"))
    problems = []
    for d in paths:
        missing = missing_weights_folders([d])
        if missing:
            problems += missing
        elif not os.path.isfile(os.path.join(d.value, "config.json")):
            problems.append(f"{d.source}={d.value!r} has no config.json: not a Hugging Face "
                            "model folder")
        else:
            try:
                check_hf_config(recipe, d.value)
            except ValueError as err:  # also a config.json that is not JSON
                problems.append(f"{d.source}: {message(err)}")
    return problems


# --- what the launch reads or imports -----------------------------------------------------

DATA_FILES = (".parquet", ".json", ".jsonl")
"""The extensions SkyRL's ``PromptDataset`` reads as files (anything else it loads by name)."""
PROMPT_KEY, ENV_CLASS_KEY = "prompt", "env_class"
"""The record keys SkyRL's ``PromptDataset`` reads (its defaults, which ``BasePPOExp`` keeps)."""


@dataclass
class DataSummary:
    """What the dry run read of ``data.train_data`` (or ``data.val_data``)."""

    setting: str
    records: int = 0
    files: int = 0
    env_classes: Set[str] = field(default_factory=set)
    without_env_class: int = 0
    not_read: List[str] = field(default_factory=list)
    """Entries read at launch only: Hugging Face dataset names or folders, and URLs."""
    errors: List[str] = field(default_factory=list)

    def line(self) -> str:
        """The dry run's line of what it read."""
        envs = ", ".join(sorted(self.env_classes)) or "none"
        text = (f"{self.setting}: {self.records} prompts in {self.files} file(s); env_class "
                f"{envs}" + (f"; {self.without_env_class} without (environment.env_class)"
                             if self.without_env_class else ""))
        for entry in self.not_read:
            text += f"; {entry!r} not read here (a Hugging Face dataset or a URL: at launch)"
        return text


def _json_records(path: str, setting: str):
    """A JSON data file's records, as ``datasets`` reads them: one object per line, or one
    array of objects."""
    with open(path) as f:
        if f.read(1 << 16).lstrip().startswith("["):
            f.seek(0)
            yield from json.load(f)
            return
        f.seek(0)
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{setting}: {path} line {number} is not JSON ({err.msg}); "
                                     "SkyRL reads one JSON object per line") from None


def _check_prompt(record, number: int, path: str, setting: str) -> None:
    prompt = record.get(PROMPT_KEY) if isinstance(record, dict) else None
    if not isinstance(prompt, list):
        raise ValueError(
            f"{setting}: record {number} of {path} has no {PROMPT_KEY!r} list of chat messages, "
            f'as SkyRL reads a prompt: {{"{PROMPT_KEY}": [{{"role": "user", "content": "..."}}], '
            f'"{ENV_CLASS_KEY}": "..."}}')


def _read_file(path: str, setting: str, out: DataSummary) -> None:
    """Counts ``path``'s records into ``out`` and collects their env classes; the first record
    (every record of a JSON file, which is parsed whole anyway) must hold a prompt."""
    envs: List = []
    if path.lower().endswith(".parquet"):
        pf = pq.ParquetFile(path)
        first = next(pf.iter_batches(batch_size=1), None)
        if first is not None:
            _check_prompt(first.to_pylist()[0], 1, path, setting)
        out.records += pf.metadata.num_rows
        if ENV_CLASS_KEY in pf.schema_arrow.names:
            envs = pq.read_table(path, columns=[ENV_CLASS_KEY]).column(0).to_pylist()
        else:
            envs = [None] * pf.metadata.num_rows
    else:
        for number, record in enumerate(_json_records(path, setting), 1):
            _check_prompt(record, number, path, setting)
            envs.append(record.get(ENV_CLASS_KEY))
        out.records += len(envs)
    out.without_env_class += sum(env is None for env in envs)
    out.env_classes |= {str(env) for env in envs if env is not None}


def read_data(entries, setting: str) -> DataSummary:
    """Each entry of ``data.train_data`` (``setting``), as SkyRL's ``PromptDataset`` will read
    it: a local .parquet / .json / .jsonl file (or glob) must exist and its records parse, each a
    prompt; counts them and collects their ``env_class`` values. What SkyRL hands to
    ``datasets.load_dataset`` by name (no such extension: a hub dataset or a dataset folder) and
    URLs are left to the launch (``not_read``)."""
    out = DataSummary(setting)
    for entry in [entries] if isinstance(entries, str) else list(entries):
        entry = str(entry)
        if "://" in entry or os.path.splitext(entry)[1].lower() not in DATA_FILES:
            out.not_read.append(entry)
            continue
        paths = sorted(glob.glob(os.path.expanduser(entry))) or [os.path.expanduser(entry)]
        for path in paths:
            if not os.path.isfile(path):
                out.errors.append(f"{setting}: no file {entry!r} on this node (SkyRL's loader reads "
                                  "it at launch); give a .jsonl or .parquet file of prompts, e.g. "
                                  f"{setting}=['/data/train.jsonl']")
                break
            try:
                _read_file(path, setting, out)
                out.files += 1
            except (ValueError, OSError, pa.ArrowException) as err:
                text = message(err)
                out.errors.append(text if text.startswith(setting) else
                                  f"{setting}: {path} cannot be read as SkyRL reads it: {text}")
                break
    return out


def env_class_errors(cfg, data: List[DataSummary]) -> List[str]:
    """Every environment the job names (each record's ``env_class``, and
    ``environment.env_class`` for records without one and for evaluation) must be registered
    with skyrl_gym once ``trainer.kda.env_modules`` are imported, as in the experiment."""
    problems = []
    for name in cfg.trainer.kda.env_modules:
        if not _findable(name):
            continue  # launch_blockers names a module it cannot find
        try:
            importlib.import_module(name)
        except Exception as err:  # the experiment's import would fail the same way
            problems.append(f"trainer.kda.env_modules: importing {name!r} fails: "
                            f"{type(err).__name__}: {message(err)}")
    registered = skyrl_gym.envs.registration.registry
    named = {(env, "the data's env_class") for d in data for env in d.env_classes}
    named.add((cfg.environment.env_class, "environment.env_class"))
    for env, where in sorted(named):
        if env not in registered:
            problems.append(
                f"{where} {env!r} is not a registered environment (registered: "
                f"{', '.join(sorted(registered))}); fix the name, or list the module that "
                "registers it in trainer.kda.env_modules")
    return problems


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def sampling_errors(cfg) -> List[str]:
    """With ``trainer.kda.sampler=glm5_next``, the sampling settings SkyRL's generator sends that
    the project's sampler does not serve (vLLM serves all of SkyRL's), by their SkyRL key."""
    if cfg.trainer.kda.sampler != "glm5_next":
        return []
    where = {"max_tokens": "max_generate_length"}
    problems = []
    sections = [("generator.sampling_params", cfg.generator.sampling_params)]
    if evaluates(cfg):
        sections.append(("generator.eval_sampling_params", cfg.generator.eval_sampling_params))
    for prefix, params in sections:
        sent = get_sampling_params_for_backend(cfg.generator.inference_engine.backend, params)
        extra = params.additional_kwargs or {}
        for key, value, takes in sampling_refusals(sent):
            setting = (f"{prefix}.additional_kwargs.{key}" if key in extra
                       else f"{prefix}.{where.get(key, key)}")
            problems.append(f"{setting}={value!r}: not served by the project's sampler "
                            f"(trainer.kda.sampler=glm5_next; {takes}); drop it, or use "
                            "trainer.kda.sampler=vllm")
        if params.repetition_penalty != 1.0:
            problems.append(f"{prefix}.repetition_penalty={params.repetition_penalty}: SkyRL does "
                            "not send it to the sampler (its typed sampling settings leave it out) "
                            "and the project's sampler has no repetition penalty; set it to 1.0")
    return problems


def logger_errors(t) -> List[str]:
    """``trainer.logger`` must be one of SkyRL's backends and its module importable here."""
    if t.logger not in Tracking.supported_backends:
        return [f"trainer.logger={t.logger!r}: choose one of "
                f"{', '.join(Tracking.supported_backends)}"]
    module = LOGGER_MODULES.get(t.logger)
    if module is not None and not _findable(module):
        return [f"trainer.logger={t.logger}: the {module!r} package is not installed here; "
                f"pip install 'skyrl_megatron_kda[loggers]' (wandb, tensorboard, mlflow) or "
                f"{module}, or set trainer.logger=console"]
    return []


def resume_errors(t) -> List[str]:
    """``trainer.resume_mode=from_path``: ``trainer.resume_path`` must name a
    ``global_step_<N>`` folder with SkyRL's ``trainer_state.pt`` (what SkyRL's
    ``load_checkpoints`` reads first). Remote paths are read at launch only."""
    if str(t.resume_mode).lower() != "from_path":
        return []
    path: Optional[str] = t.resume_path
    if not path:
        return ["trainer.resume_mode=from_path needs trainer.resume_path: a checkpoint folder "
                f"{t.ckpt_path}/{GLOBAL_STEP_PREFIX}<step>"]
    if "://" in str(path):
        return []
    name = os.path.basename(os.path.normpath(str(path)))
    if GLOBAL_STEP_PREFIX not in name:
        return [f"trainer.resume_path={path!r}: name a {GLOBAL_STEP_PREFIX}<step> folder under "
                "the earlier job's trainer.ckpt_path"]
    state = os.path.join(str(path), "trainer_state.pt")
    if not os.path.isfile(state):
        what = "no folder" if not os.path.isdir(str(path)) else "no trainer_state.pt in"
        return [f"trainer.resume_path: {what} {path!r} on this node; name a saved "
                f"{GLOBAL_STEP_PREFIX}<step> folder under the earlier job's trainer.ckpt_path"]
    return []


def evaluates(cfg) -> bool:
    """Whether SkyRL builds an evaluation dataset (``BasePPOExp.get_eval_dataset``'s rule), and
    so reads ``data.val_data`` and samples with ``generator.eval_sampling_params``."""
    return cfg.trainer.eval_interval > 0 and bool(cfg.data.val_data)


def check_inputs(cfg) -> Tuple[List[str], List[str]]:
    """(errors, notes) of what the launch of ``cfg`` will read or import: one line per thing it
    cannot (empty: none), and the dry run's lines of what was read."""
    t = cfg.trainer
    train = read_data(cfg.data.train_data, "data.train_data")
    data = [train]
    problems = [*logger_errors(t), *train.errors]
    if evaluates(cfg):
        data.append(read_data(cfg.data.val_data, "data.val_data"))
        problems += data[-1].errors
    problems += env_class_errors(cfg, data)
    if not train.errors and not train.not_read and train.records < t.train_batch_size:
        problems.append(f"trainer.train_batch_size={t.train_batch_size} is larger than "
                        f"data.train_data ({train.records} prompts); lower it or add prompts")
    problems += [*sampling_errors(cfg), *resume_errors(t)]
    return problems, [d.line() for d in data]
