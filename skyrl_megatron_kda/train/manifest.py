"""The manifest of one checkpoint: what a complete save wrote, so that a load (and
``skyrl-kda checkpoint verify``) can prove the files are still those bytes.

``<checkpoint>/manifest.json`` lists every other file of the checkpoint directory with its size
and sha256, and records the step, the mesh that saved it, the schedule settings it was trained
under and a hash of the recipe. ``checkpoint.save`` writes it on rank 0 after every rank has
finished writing its shards, and writes it last and atomically (a temporary file, then
``os.replace``): a checkpoint without a manifest is an unfinished save, never a loadable one.

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
          finite: bool = False) -> dict:
    """Hash every file of checkpoint ``path`` and write its manifest (after the shards are all
    on disk; rank 0 only). ``finite``: the save checked that weights and optimizer state hold no
    inf or NaN (``checkpoint.save`` does, and refuses to save otherwise)."""
    path = Path(path)
    manifest = {
        "format": FORMAT,
        "step": step,
        "mesh": mesh,
        "schedule": schedule,
        "recipe_sha256": recipe_sha256,
        "finite": finite,
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


def summary(path: str | Path, manifest: dict) -> str:
    """One line for a verified checkpoint: step, files, bytes and mesh."""
    files = manifest["files"]
    size = sum(r["size"] for r in files.values())
    mesh = " ".join(f"{k}{v}" for k, v in manifest["mesh"].items())
    finite = "; weights and optimizer state finite" if manifest.get("finite") else ""
    return (f"{path}: ok, step {manifest['step']}, {len(files)} files, {size / 2**20:.1f} MiB "
            f"match their sha256; mesh {mesh}{finite}")


def schedule_changes(saved: dict, current: dict) -> list[str]:
    """``key saved -> current`` for each schedule setting that differs (in ``current``'s order)."""
    return [f"{key} {saved.get(key)} -> {value}" for key, value in current.items()
            if saved.get(key) != value]
