"""A throw-away environment with DeepSpeed 0.18.5 (inside the affected range 0.15.2-0.18.9 of
the CPU-offload accumulation bug), cached under .venv-cache/. It holds exactrl's other pins
too, so both `exactrl audit stack --python` and a real `exactrl sft` can run there (with the
checkout on PYTHONPATH). First build: about 3 minutes, mostly DeepSpeed compiling its
shared-memory op on first use; then it is reused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.18.5"


def old_deepspeed_python() -> str:
    env = ROOT / ".venv-cache" / f"ds-{VERSION}"
    python = env / "bin" / "python"
    ready = env / ".ready-with-exactrl-pins"
    if not ready.exists():
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel; pinned first, as in the Makefile
        pins = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#") and not line.startswith("deepspeed")]
        subprocess.run([*pip, *pins, f"deepspeed=={VERSION}"], check=True)
        ready.touch()
    return str(python)


def ds_env(version: str | None = None) -> dict:
    """Environment for a DeepSpeed subprocess: CPU accelerator, and JIT-compiled ops cached
    per DeepSpeed version under .venv-cache/ (the installed one unless ``version``)."""
    if version is None:
        from importlib.metadata import version as installed

        version = installed("deepspeed")
    return {"DS_ACCELERATOR": "cpu",
            "TORCH_EXTENSIONS_DIR": str(ROOT / ".venv-cache" / "torch_extensions" / f"deepspeed-{version}")}
