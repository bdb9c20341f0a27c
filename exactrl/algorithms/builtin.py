"""The built-in names of model.path and data.*: 'builtin' (files of exactrl/tasks/builtin.py)
and 'builtin-sft', the built-in model after the demo's SFT phase, which takes training to build
(so it lives here, above the trainer, and the task package never imports it)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from filelock import FileLock

from exactrl.config.schema import DemoConfig
from exactrl.tasks import builtin
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin


def ensure_builtin_sft(spec: BuiltinSpec = BuiltinSpec(), cache: Path | None = None) -> Path:
    """The built-in model after the demo's SFT phase: the starting point of RL examples (built once)."""
    from exactrl.algorithms.sft import train_sft  # sft.py resolves model.path through this module

    root = ensure_builtin(spec, cache).root
    final = root / "sft-model"
    if (final / "config.json").exists():
        return final
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank under torchrun: build it in a process of its own
        return _build_sft_elsewhere(spec, root)
    with FileLock(root / ".sft-lock"):
        if (final / "config.json").exists():
            return final
        print(f"building the built-in SFT starting point once, into {final} (a few minutes) ...")
        cfg = DemoConfig().sft.model_copy(update={"output_dir": str(root / f".sft-run-{os.getpid()}")})
        result = train_sft(cfg, spec=spec)
        os.replace(result.final_model, final)
    return final


def _build_sft_elsewhere(spec: BuiltinSpec, root: Path) -> Path:
    """Build the SFT starting point in a one-process child (the SFT run must not join this
    rank's process group); every rank waits for it on the same file lock."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    env["EXACTRL_CACHE"] = str(root.parent)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per rank; the one builder may use every core
    code = ("from exactrl.algorithms.builtin import ensure_builtin_sft; from exactrl.tasks.builtin import BuiltinSpec; "
            f"ensure_builtin_sft(BuiltinSpec(**{asdict(spec)!r}))")
    if subprocess.run([sys.executable, "-c", code], env=env).returncode != 0:
        raise RuntimeError(f"building the built-in SFT model into {root / 'sft-model'} failed (see the output above)")
    return root / "sft-model"


def resolve(path: str | None, kind: str, spec: BuiltinSpec = BuiltinSpec()) -> str | None:
    """'builtin-sft' in model.path -> the built-in model after SFT (built once); else as
    exactrl.tasks.builtin.resolve."""
    if path == "builtin-sft" and kind == "model":
        return str(ensure_builtin_sft(spec))
    return builtin.resolve(path, kind, spec)
