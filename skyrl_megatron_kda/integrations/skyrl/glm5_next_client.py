"""This project's sampler for SkyRL: transformers' glm5_next samples from the weights the policy
worker publishes on disk (``weight_sync.DiskPublisher``), on the CPU or on a GPU (``device``).

It stands where SkyRL's HTTP client over vLLM servers stands (``BasePPOExp.get_inference_client``
returns it): the generator calls ``generate``; the trainer brackets each weight sync with
``pause_generation`` / ``resume_generation``, or, under ``trainer.placement.colocate_all``, with
``wake_up(tags=["weights"])`` / ``wake_up(tags=["kv_cache"])`` after a ``sleep``, or, with
``generator.inference_engine.offload_kv_for_weight_sync``, with ``sleep_for_weight_sync`` /
``wake_for_weight_sync`` inside the pause. Generation resumes, or the client becomes fully awake,
on the newest published version; it refuses to generate while paused or asleep, as a colocated
vLLM engine cannot. A version of adapters alone (SkyRL's ``merge_lora=false``, which brackets
nothing when not colocated: vLLM swaps an adapter in place) is loaded by the next ``generate``.
Before the first publication there is nothing to load: resuming or waking then loads nothing (``generate`` raises that no weights are published), so an error inside the
first sync reaches SkyRL as itself, not hidden by the ``finally`` that resumes generation.

Randomness: each ``generate`` call draws from its own generator, seeded from the client's seed,
the optimizer steps of the weights it samples (``weight_sync.TRAIN_STEP``, which a checkpoint
restores), the call's prompts and how many calls with the same prompts came before it on those
weights. So a job resumed from a checkpoint samples what the uninterrupted job sampled at the
same step (one generator for the client's life would restart at the seed), and the fully async
trainer's generation workers, whose turns depend on timing, draw the same for a prompt whatever
order they call in. A request's own ``seed`` replaces that, as in vLLM.

Sampling follows vLLM's semantics for what it supports (temperature, ``max_tokens``,
``min_tokens``, EOS stop, the sampled token's log-prob of the temperature-scaled distribution when
``logprobs`` is set); other sampling settings are refused by name. One sequence at a time, with
transformers' cache of the sequence's own keys and KDA states (built per call, dropped at its
end; no prefix is shared between calls): it is for small models and tests.

Device: the entrypoint passes ``cuda`` for a GPU recipe and ``cpu`` for a CPU one. The model is
fp32 on either, on transformers' torch path (fla's kernels, which take fp32 through TF32 dot
products, are not bound), so a GPU samples what a CPU samples up to rounding; tokens are drawn
on the CPU from the last position's log-probs, so a seed draws the same tokens on both unless
rounding moves a draw across a boundary.

DSA ties: the loaded model's indexers break ties at the top-k boundary as the trainer's torch
kernel does, earlier pool first (``match_trainer_dsa_ties``); transformers' own glm5_next, whose
``torch.topk`` breaks them in any order, is left as it is for everyone else.

The model lives only in the process that loaded it: a pickled copy (the one SkyRL ships to the
policy workers, which only read ``weight_sync_dir``) carries no weights.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode
from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)

from ...model.hf_io import SafetensorsCheckpoint
from ...train.peft_adapters import ADAPTER_CONFIG, merge_adapter_folder
from .weight_sync import DiskSyncTarget, latest_version, published_train_step

_NEUTRAL = {"top_p": (None, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0.0), "stop": (None, [], ()),
            "n": (None, 1)}
"""Sampling settings the client supports only at their no-op values (-> the accepted values)."""
_HONOURED = {"skip_special_tokens", "include_stop_str_in_output", "temperature", "max_tokens",
            "min_tokens", "logprobs", "seed"}
"""Settings it honours (or, for the two text flags, that change nothing for token-level use)."""


def sampling_refusals(params: Dict[str, Any]) -> List[Tuple[str, Any, str]]:
    """(key, value, what the client takes) for each of SkyRL's sampling settings ``params`` (the
    dict its generator sends to ``generate``) that the client does not serve; the entrypoint's
    dry run asks the same."""
    refused = []
    for key, value in params.items():
        if key in _NEUTRAL and value not in _NEUTRAL[key]:
            refused.append((key, value, f"accepted: {_NEUTRAL[key]}"))
        elif key not in _NEUTRAL and key not in _HONOURED:
            refused.append((key, value, "not supported"))
    temperature = params.get("temperature", 1.0)
    if isinstance(temperature, (int, float)) and temperature < 0:
        refused.append(("temperature", temperature, "a temperature >= 0"))
    return refused


SLEEP_TAGS = ("weights", "kv_cache")
"""What ``sleep`` / ``wake_up`` move (vLLM's tags); no tags means both."""

GLM5_NEXT = "transformers.models.glm5_next.modeling_glm5_next"

CLIENT = "Glm5NextInferenceClient"
"""The client's name in its error messages."""


def _glm5_next_class():
    """transformers' ``Glm5NextForConditionalGeneration`` on its torch path, on every device.
    transformers binds fla's Triton kernels (GPU only) in place of its torch functions when the
    module is first imported and fla imports (our own package imports fla), so fla is hidden
    from that one import. On a GPU too: fla's chunk kernels take fp32 inputs through TF32 dot
    products, and on the tiny recipe's random checkpoint every weight moved by 1e-3 relative
    (TF32's rounding) moves log-probs by up to 0.13 where an MoE route or a DSA selection flips
    (by 1.6e-3 at 1e-4); the torch path is fp32 throughout, as on a CPU."""
    if GLM5_NEXT in sys.modules:
        module = sys.modules[GLM5_NEXT]
        kda = inspect.getclosurevars(module.chunk_kimi_delta_attention).nonlocals["implementation"]
        if kda.__module__.startswith("fla"):
            raise RuntimeError(f"{GLM5_NEXT} was imported with fla's kernels before the sampler "
                               "loaded it; import the sampler first")
        return module.Glm5NextForConditionalGeneration
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules)
              if name == "fla" or name.startswith("fla.")}
    sys.modules["fla"] = None  # makes ``import fla`` raise ImportError
    try:
        return importlib.import_module(GLM5_NEXT).Glm5NextForConditionalGeneration
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


def sampler_device(device: str | torch.device) -> torch.device:
    """``device`` checked for the sampler: a CPU, or a CUDA GPU that this process can see (the
    sampler runs where SkyRL's experiment runs, which may not be where the job was checked)."""
    try:
        chosen = torch.device(device)
    except RuntimeError:  # torch's message lists every device type it knows
        chosen = None
    if chosen is None or chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"{CLIENT}: device={str(device)!r}: choose cpu or cuda")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{CLIENT}: device={str(device)!r} but this process sees no CUDA GPU "
                           "(torch.cuda.is_available() is False); run the job where SkyRL's "
                           "experiment sees a GPU, or use a CPU recipe (run.device=cpu)")
    return chosen


def load_glm5_next(folder: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """transformers' glm5_next from a published folder on ``device``, fp32, eval, its DSA ties
    broken as the trainer breaks them (``match_trainer_dsa_ties``). A folder of adapters
    (``merge_lora=false``: ``adapter_config.json``) is served on the base it names
    (``base_model_name_or_path``) with the adapters merged, as vLLM serves an adapter."""
    if (Path(folder) / ADAPTER_CONFIG).is_file():
        with tempfile.TemporaryDirectory(prefix="adapted_") as merged:
            return load_glm5_next(write_adapted_base(folder, merged), device)
    model = _glm5_next_class().from_pretrained(folder, attn_implementation="eager")
    match_trainer_dsa_ties(model)
    return model.float().eval().to(device)


def write_adapted_base(adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The base checkpoint an adapter folder names, with its adapters merged
    (``peft_adapters.merge_adapter_folder``), written to ``out_dir`` beside the base's config."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir}: its base_model_name_or_path {base!r} is not a "
                                "checkpoint folder this sampler can read")
    tensors = merge_adapter_folder(adapter_dir, SafetensorsCheckpoint(base))
    out = Path(out_dir)
    for extra in Path(base).glob("*.json"):  # config and generation settings; not the index
        if extra.name != "model.safetensors.index.json":
            shutil.copyfile(extra, out / extra.name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


class _StableTopk(TorchFunctionMode):
    """``torch.topk`` as a stable sort: among equal values the lower index comes first. Every
    other torch call passes through unchanged. A torch function mode is thread-local and lasts
    only for its ``with`` block, so nothing outside the wrapped call sees it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            return _stable_topk(*args, **kwargs)
        return func(*args, **kwargs)


def _stable_topk(values: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                 sorted: bool = True) -> torch.return_types.topk:
    # (the mode is off while its handler runs, so this sort is the real one)
    ordered, order = values.sort(dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((ordered.narrow(dim, 0, k), order.narrow(dim, 0, k)))


INDEXER_CLASS = "Glm5NextTextIndexer"


def match_trainer_dsa_ties(model: torch.nn.Module) -> int:
    """Make ``model``'s (transformers glm5_next) DSA indexers keep the earlier pool among equal
    scores at the top-k boundary, as the trainer's torch kernel does (``dsa/pool_topk.py``);
    returns how many indexers it changed.

    Why: an indexer score is a sum over indexer heads of weighted ReLUs, so with few heads many
    pools score exactly 0, and on a row longer than ``index_topk`` several tie at the boundary.
    glm5_next picks among them with ``torch.topk`` (any order), the trainer keeps the earlier
    pool; where they pick differently that position attends to other keys and the sampler's
    log-probs differ from the trainer's by far more than rounding. Both number pools from the
    document's first token, ``index_kpool`` tokens each (the same pools, in the same order), so
    a stable descending sort over glm5_next's pool scores is the trainer's rule.

    Only this model changes: each indexer's ``forward`` becomes an instance attribute that runs
    transformers' own forward under ``_StableTopk`` (its one ``topk`` is the selection). The
    class, and every other glm5_next in the process, keep ``torch.topk``."""
    indexers = [m for m in model.modules() if type(m).__name__ == INDEXER_CLASS]
    text = getattr(model.config, "text_config", model.config)
    if "indexed_attention" in getattr(text, "layer_types", ()) and not indexers:
        # a renamed class would leave torch.topk's ties in place, unnoticed
        raise RuntimeError(f"{type(model).__name__} has DSA layers but no {INDEXER_CLASS}: "
                           "cannot match the trainer's tie rule")
    # An indexer already wrapped keeps its one wrapper; another instance-level forward, such as
    # an offloading hook, is wrapped as it stands.
    unwrapped = [m for m in indexers if not hasattr(m.forward, "keeps_earlier_pool")]
    for module in unwrapped:
        module.forward = _under_stable_topk(module.forward)
    return len(unwrapped)


def _under_stable_topk(forward):
    @functools.wraps(forward)
    def stable(*args, **kwargs):
        with _StableTopk():
            return forward(*args, **kwargs)
    stable.keeps_earlier_pool = True
    return stable


def call_seed(seed: int, train_step: int, prompts: str, call: int) -> int:
    """The generator seed of one ``generate`` call: a hash of the client's ``seed``, the optimizer
    steps of the weights it samples, the call's ``prompts`` (their token ids, as text) and its
    index among the calls with those prompts on those weights (63 bits, a valid torch seed). A
    hash, not a sum, so that neighbouring steps draw unrelated streams."""
    digest = hashlib.sha256(f"{seed}/{train_step}/{prompts}/{call}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _tags(tags: Optional[List[str]]) -> set:
    chosen = set(SLEEP_TAGS if tags is None else tags)
    unknown = sorted(chosen - set(SLEEP_TAGS))
    if unknown:
        raise ValueError(f"{CLIENT}: unknown sleep tags {unknown} "
                         f"(known: {', '.join(SLEEP_TAGS)})")
    return chosen


def sampled_tokens(model: torch.nn.Module, prompt: List[int], *, temperature: float, max_tokens: int,
                   min_tokens: int, eos_token_id: Optional[int],
                   generator: torch.Generator) -> Tuple[List[int], List[float], str]:
    """(tokens, their log-probs under softmax(logits / temperature), stop reason) of one sample.
    The model runs on its own device; the token is drawn on the CPU (``generator`` is a CPU one)."""
    ids, logps = list(prompt), []
    device = next(model.parameters()).device
    step, cache = ids, None  # the prompt, then one token at a time against the cache
    for i in range(max_tokens):
        with torch.no_grad():
            # logits_to_keep=1: the head runs on the last position only (at a full-size
            # vocabulary the head over every position is a large share of the forward)
            out = model(input_ids=torch.tensor([step], device=device), past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[0, -1].float().cpu()
        # vLLM's sampled-token log-prob: of the temperature-scaled distribution (raw at 0, greedy)
        logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        allowed = logp.clone()
        if eos_token_id is not None and i < min_tokens:
            allowed[eos_token_id] = float("-inf")
        token = (int(allowed.argmax()) if temperature == 0
                 else int(torch.multinomial(allowed.exp(), 1, generator=generator)))
        ids.append(token)
        logps.append(float(logp[token]))
        step = [token]
        if token == eos_token_id:
            return ids[len(prompt):], logps, "stop"
    return ids[len(prompt):], logps, "length"


class Glm5NextInferenceClient(InferenceEngineInterface, DiskSyncTarget):
    """SkyRL inference client over one transformers glm5_next model on ``device`` (``cpu`` or
    ``cuda``: refused at once where this process sees no CUDA GPU), reloaded from
    ``weight_sync_dir`` (where the policy worker publishes) each time generation resumes."""

    def __init__(self, weight_sync_dir: str | Path, tokenizer, *, model_name: str, seed: int = 0,
                 device: str | torch.device = "cpu"):
        self.device = sampler_device(device)
        self.weight_sync_dir = str(weight_sync_dir)
        self.tokenizer = tokenizer
        self._model_name = model_name
        self.seed = seed
        self.loaded_version: Optional[int] = None
        self.loaded_train_step: Optional[int] = None
        self._model: Optional[torch.nn.Module] = None
        self._calls: Dict[str, int] = {}  # prompts -> generate calls on the loaded version
        self._weight_version = 0
        self.paused = False
        self.asleep: set = set()  # the SLEEP_TAGS that are asleep

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        # weights stay with the sampler
        state["_model"], state["loaded_version"], state["loaded_train_step"] = None, None, None
        return state

    # -- weights -----------------------------------------------------------------------------

    def reload(self) -> int:
        """Load the newest published version (a no-op if it is loaded); returns its number."""
        latest = latest_version(self.weight_sync_dir)
        if latest is None:
            raise FileNotFoundError(f"{self.weight_sync_dir} holds no published weights yet (the "
                                    "trainer publishes them in init_weight_sync_state's first sync)")
        version, folder = latest
        if version != self.loaded_version:
            # the old model goes first: on a GPU its memory is free for the new one
            self._model = self.loaded_version = None
            self._model, self.loaded_version = load_glm5_next(folder, self.device), version
            self.loaded_train_step, self._calls = published_train_step(folder), {}
        return version

    def _reload_if_published(self) -> None:
        """``reload`` once weights are published. Resuming and waking run in SkyRL's ``finally``
        around a sync: an error there would replace the sync's own."""
        if latest_version(self.weight_sync_dir) is not None:
            self.reload()

    def _swap_in_published_adapters(self) -> None:
        """Load a newer version that holds adapters only. SkyRL's adapter-only sync
        (``merge_lora=false``) does not pause generation around it when not colocated: vLLM swaps
        the adapter in place when told to load it; this client looks before each call."""
        latest = latest_version(self.weight_sync_dir)
        if (latest is not None and latest[0] != self.loaded_version
                and (latest[1] / ADAPTER_CONFIG).is_file()):
            self.reload()

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            self.reload()
        return self._model

    # -- what SkyRL's generator and trainer call -------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def increment_weight_version(self) -> None:
        self._weight_version += 1

    async def generate(self, input_batch: InferenceEngineInput,
                       model: Optional[str] = None) -> InferenceEngineOutput:
        if self.paused:
            raise RuntimeError(f"{CLIENT}.generate while generation is paused for a "
                               "weight sync")
        if self.asleep:
            asleep = ", ".join(sorted(self.asleep))
            raise RuntimeError(f"{CLIENT}.generate while asleep ({asleep}): under "
                               "colocate_all SkyRL wakes the engine before generating")
        if input_batch.get("prompt_token_ids") is None:
            raise ValueError(f"{CLIENT}.generate needs prompt_token_ids (SkyRL's "
                             "token-in-token-out path); text prompts are not supported")
        params = dict(input_batch.get("sampling_params") or {})
        for key, value, takes in sampling_refusals(params):
            if key == "temperature":
                raise ValueError(f"{CLIENT}: temperature={value} is negative")
            raise ValueError(f"{CLIENT}: sampling setting {key}={value!r} is not supported"
                             + (f" ({takes})" if takes.startswith("accepted") else ""))
        self._swap_in_published_adapters()
        model = self.model  # loads the newest version if none is loaded yet
        prompts = repr([list(p) for p in input_batch["prompt_token_ids"]])
        seed = (int(params["seed"]) if params.get("seed") is not None
                else call_seed(self.seed, self.loaded_train_step, prompts, self._calls.get(prompts, 0)))
        self._calls[prompts] = self._calls.get(prompts, 0) + 1
        generator = torch.Generator().manual_seed(seed)
        want_logprobs = params.get("logprobs") is not None
        responses, response_ids, stop_reasons, logprobs = [], [], [], []
        for prompt in input_batch["prompt_token_ids"]:
            tokens, logps, reason = sampled_tokens(
                model, list(prompt), temperature=float(params.get("temperature", 1.0)),
                max_tokens=int(params["max_tokens"]), min_tokens=int(params.get("min_tokens") or 0),
                eos_token_id=self.tokenizer.eos_token_id, generator=generator)
            response_ids.append(tokens)
            responses.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
            stop_reasons.append(reason)
            logprobs.append(logps)
        return InferenceEngineOutput(
            responses=responses, response_ids=response_ids, stop_reasons=stop_reasons,
            response_logprobs=logprobs if want_logprobs else None, prompt_logprobs=None,
            rollout_expert_indices=None, rollout_sample_support=None)

    async def pause_generation(self, clear_cache: bool = False) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        """Generation resumes on the newest published weights (SkyRL resumes after each sync)."""
        self._reload_if_published()
        self.paused = False

    async def sleep(self, level: int = 2, tags: Optional[List[str]] = None) -> None:
        """Colocation: the engine gives the GPU to the trainer; it generates nothing until woken.
        Its weights stay loaded where they are (on a GPU they stay resident: a small model's)."""
        self.asleep |= _tags(tags)

    async def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """SkyRL wakes ``weights`` before a sync writes them and ``kv_cache`` after; once nothing
        is asleep the engine serves the newest published version."""
        was_asleep = bool(self.asleep)
        self.asleep -= _tags(tags)
        if was_asleep and not self.asleep:
            self._reload_if_published()

    async def sleep_for_weight_sync(self, offload_kv: bool = True) -> None:
        """``offload_kv_for_weight_sync`` on the fully async trainer: vLLM frees its GPU pools with
        in-flight requests frozen. Here there is nothing to free or offload (the weights stay
        loaded, a sequence's cache lives only inside its ``generate`` call, and no request is in
        flight during a pause, since each ``generate`` runs to its end); it only stops generating
        until woken."""
        if not self.paused:
            raise RuntimeError(f"{CLIENT}.sleep_for_weight_sync without pause_generation "
                               "first (SkyRL pauses, then sleeps for the sync)")
        self.asleep |= set(SLEEP_TAGS)

    async def wake_for_weight_sync(self, tags: List[str]) -> None:
        """Wakes ``tags`` (SkyRL: ``weights`` before the sync writes them, ``kv_cache`` after);
        loads nothing: generation resumes, on the newest version, with ``resume_generation``."""
        self.asleep -= _tags(tags)

    async def is_sleeping(self) -> bool:
        return bool(self.asleep)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Nothing to reset: no cache outlives the ``generate`` call that built it."""

    async def finish_session(self, session_id: str) -> None:
        """Sessions keep no state here."""

    async def get_world_size(self) -> Tuple[int, int]:
        return 1, 1

    async def teardown(self) -> None:
        self._model = None

    def get_endpoint_url(self) -> str:
        raise NotImplementedError(f"{CLIENT} serves no HTTP endpoint: use SkyRL's "
                                  "token-in-token-out generator (SkyRLGymGenerator)")

    async def chat_completion(self, request_payload: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError(f"{CLIENT} serves generate() only (no chat_completion)")

    async def render_chat_completion(self, request_payload: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError(f"{CLIENT} serves generate() only "
                                  "(no render_chat_completion)")

    async def completion(self, request_payload: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError(f"{CLIENT} serves generate() only (no completion)")

    async def update_named_weights(self, request) -> None:
        raise NotImplementedError(f"{CLIENT} loads weights from its disk folder only "
                                  "(weight_sync.DiskPublisher)")

    async def load_lora_adapter(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{CLIENT} does not serve LoRA adapters")
