"""The run manifest: what produced a run (versions, git revision, hardware, data hashes)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock

from exactrl.distributed.launch import world_size
from exactrl.run_dir import MANIFEST_LOCK

PACKAGES = ("exactrl", "torch", "transformers", "tokenizers", "deepspeed", "vllm", "ray", "peft", "accelerate")


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if rev.returncode:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def file_sha256(path: str | Path) -> str:
    """A file's SHA-256; for a directory (a save_to_disk dataset), over its files' names and bytes."""
    p = Path(path)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]:
        if p.is_dir():
            h.update(str(f.relative_to(p)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def hardware() -> dict:
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def write_manifest(run_dir: Path, seed: int, data_files: dict[str, str | Path | None],
                   extra: dict | None = None) -> dict:
    manifest = {
        "versions": package_versions(),
        "git_revision": git_revision(),
        "seed": seed,
        # the processes of this launch (torchrun's, however started): what `exactrl audit run` divides the batch by
        # to get K; a Ray run's trainer ranks are its "ray" record's
        "world_size": world_size(),
        "hardware": hardware(),
        "data": {k: {"path": str(v), "sha256": file_sha256(v)} for k, v in data_files.items() if v},
        "command": sys.argv,
        **(extra or {}),
    }
    _update(run_dir, lambda _: manifest, read=False)
    return manifest


def record_check(run_dir: Path, name: str, result: dict) -> None:
    """Add a start-up check's figures to the run's manifest under ``checks.<name>``."""
    record(run_dir, "checks", name, result)


def record(run_dir: Path, section: str, name: str, value: dict) -> None:
    """Add ``value`` to the run's manifest under ``<section>.<name>`` (e.g. a phase's rollout correction)."""
    def add(manifest: dict) -> dict:
        manifest.setdefault(section, {})[name] = value
        return manifest

    _update(run_dir, add)


def record_fact(run_dir: Path, name: str, value: dict) -> None:
    """Add what a run learnt once it started (e.g. its Ray placement) to its manifest under ``name``."""
    _update(run_dir, lambda manifest: {**manifest, name: value})


def _update(run_dir: Path, change: Callable[[dict], dict], read: bool = True) -> None:
    """Replace manifest.json by ``change``(its content; {} when absent or not ``read``) under a
    lock, through a temporary file of this writer's own: several processes (the ranks' checks,
    a pipeline's phases) may update one manifest, and a read-modify-write without the lock
    loses updates, while one shared temporary name lets a writer rename another's
    half-written file into place."""
    path = Path(run_dir) / "manifest.json"
    with FileLock(Path(run_dir) / MANIFEST_LOCK):
        manifest = json.loads(path.read_text()) if read and path.is_file() else {}
        text = json.dumps(change(manifest), indent=2)
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".manifest.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # as a plain write would leave it (mkstemp's is 0600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
