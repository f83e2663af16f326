"""The manifest of one checkpoint: what a complete save wrote, so that a load (and
``skyrl-kda checkpoint verify``) can prove the files are still those bytes.

``<checkpoint>/manifest.json`` lists every other file of the checkpoint directory with its size
and sha256, and records the step, the mesh that saved it, the schedule settings it was trained
under and a hash of the recipe; a LoRA run's (adapters only) also records ``lora``: its
``train.lora`` settings, the frozen base's fingerprint and the number of adapter tensors of the
whole model (every global expert's, a shared expert adapter once: the same on every mesh).
``checkpoint.save`` writes it on rank 0 after every rank has finished writing its shards, and
writes it last and atomically (a temporary file, then ``os.replace``): a checkpoint without a
manifest is an unfinished save, never a loadable one.

Plain files and the standard library only: reading a run's record must not import torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Recipe

MANIFEST = "manifest.json"
FORMAT = 1
"""Version of the manifest's layout; a load refuses another one rather than guess."""

_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that is not what its save wrote (or whose save never finished): one line
    naming the checkpoint and the file."""


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB pieces (shards are GiB-sized)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            digest.update(piece)
    return digest.hexdigest()


def recipe_hash(recipe: Recipe) -> str:
    """sha256 of the recipe the ranks ran (the content of the run's ``recipe.yaml``)."""
    text = json.dumps(recipe.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _files(path: Path) -> list[str]:
    """The checkpoint's files (relative, sorted), the manifest and its temporary excepted."""
    names = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
    return sorted(n for n in names if n not in (MANIFEST, MANIFEST + ".tmp"))


def write(path: str | Path, *, step: int, mesh: dict, schedule: dict, recipe_sha256: str,
          finite: bool = False, lora: dict | None = None) -> dict:
    """Hash every file of checkpoint ``path`` and write its manifest (after the shards are all
    on disk; rank 0 only). ``finite``: the save checked that weights and optimizer state hold no
    inf or NaN (``checkpoint.save`` does, and refuses to save otherwise). ``lora``: the record of
    an adapter checkpoint (``settings``, ``base_sha256``, ``adapter_tensors``; None: full
    weights)."""
    path = Path(path)
    manifest = {
        "format": FORMAT,
        "step": step,
        "mesh": mesh,
        "schedule": schedule,
        "recipe_sha256": recipe_sha256,
        "finite": finite,
        **({} if lora is None else {"lora": lora}),
        "files": {name: {"size": (path / name).stat().st_size,
                         "sha256": file_sha256(path / name)} for name in _files(path)},
    }
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the manifest
    os.replace(tmp, path / MANIFEST)
    return manifest


def read(path: str | Path) -> dict:
    """The manifest of checkpoint ``path`` (its record only; ``verify`` checks the files)."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: its save did not finish "
                              "(or it was written before checkpoints had manifests)")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a format-{FORMAT} manifest")
    return manifest


def verify(path: str | Path) -> dict:
    """Check every file of checkpoint ``path`` against its manifest (present, same size, same
    sha256, nothing extra); returns the manifest, or raises ``CheckpointError`` naming the file."""
    path = Path(path)
    manifest = read(path)
    for name, record in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = file.stat().st_size
        if size != record["size"]:
            raise CheckpointError(f"checkpoint {path}: {name} is {size} bytes, the manifest says "
                                  f"{record['size']} (truncated or replaced after the save)")
        if file_sha256(file) != record["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} has changed since the save "
                                  "(sha256 differs from the manifest)")
    extra = sorted(set(_files(path)) - set(manifest["files"]))
    if extra:
        raise CheckpointError(f"checkpoint {path}: {extra[0]} is not in the manifest (added after "
                              "the save)")
    return manifest


def mesh_text(mesh: dict) -> str:
    """``world2 tp2 cp1 ep1 etp1``: a manifest's mesh in one word per axis."""
    return " ".join(f"{k}{v}" for k, v in mesh.items())


def summary(path: str | Path, manifest: dict) -> str:
    """One line for a verified checkpoint: step, files, bytes and mesh; for an adapter checkpoint
    its LoRA rank and the base fingerprint it needs."""
    files = manifest["files"]
    size = sum(r["size"] for r in files.values())
    finite = "; weights and optimizer state finite" if manifest.get("finite") else ""
    lora = manifest.get("lora")
    adapters = "" if lora is None else (
        f"; LoRA adapters only (rank {lora['settings']['rank']}, {lora['adapter_tensors']} "
        f"tensors) on base {lora['base_sha256']}")
    return (f"{path}: ok, step {manifest['step']}, {len(files)} files, {size / 2**20:.1f} MiB "
            f"match their sha256; mesh {mesh_text(manifest['mesh'])}{finite}{adapters}")


def lora_changes(saved: dict, current: dict) -> list[str]:
    """``train.lora.key saved -> current`` for each LoRA setting that differs."""
    return [f"train.lora.{key} {saved.get(key)} -> {value}" for key, value in current.items()
            if saved.get(key) != value]


def schedule_changes(saved: dict, current: dict) -> list[str]:
    """``key saved -> current`` for each schedule setting that differs (in ``current``'s order)."""
    return [f"{key} {saved.get(key)} -> {value}" for key, value in current.items()
            if saved.get(key) != value]


def lora_refusal(path, record: dict, lora: dict | None, base_sha256: str | None,
                 mesh: dict) -> str | None:
    """Why checkpoint ``path`` (its manifest ``record``) cannot load into a run of ``train.lora``
    settings ``lora`` (None: LoRA off) on ``mesh`` whose base has fingerprint ``base_sha256``:
    full weights into a LoRA run or adapters into a full one, adapters of other LoRA settings, or
    another base (the fingerprint is the same on every mesh); None where it can."""
    saved = record.get("lora")
    if saved is None and lora is None:
        return None
    if saved is None:
        return (f"checkpoint {path} holds full weights (saved with train.lora.rank=0) and this "
                f"run sets train.lora.rank={lora['rank']}: resume with train.lora.rank=0, or "
                "export it (skyrl-kda export) and start the LoRA run from it with "
                "run.init_from_hf")
    if lora is None:
        return (f"checkpoint {path} holds LoRA adapters only (train.lora.rank="
                f"{saved['settings']['rank']}) and this run has train.lora.rank=0: resume with "
                "the checkpoint's train.lora settings")
    changes = lora_changes(saved["settings"], lora)
    if changes:
        return (f"checkpoint {path} holds adapters of other LoRA settings: {', '.join(changes)}; "
                "its adapters have the saved shapes and targets: resume with the checkpoint's "
                "train.lora settings")
    if saved["base_sha256"] != base_sha256:
        # On GPU megatron seeds each TP/EP rank's initialisation of its own shard.
        mesh_note = ("" if record["mesh"] == mesh else
                     f"; saved on mesh {mesh_text(record['mesh'])}, this run is {mesh_text(mesh)}, "
                     "and seed-initialised weights on GPU differ between meshes")
        return (f"checkpoint {path}'s adapters were trained on another base: base fingerprint "
                f"{saved['base_sha256'][:16]} saved, {base_sha256[:16]} here: resume with the "
                f"base the run started from (the same run.init_from_hf and train.seed){mesh_note}")
    return None
