"""Where the vLLM engine process runs: the interpreter of an environment that has vLLM
(rollout.vllm.python), checked before a run starts, and the engine's import path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from exactrl.config.loader import ConfigError

ROOT = Path(__file__).resolve().parents[2]  # the checkout: on the engine's PYTHONPATH
# Presence, not import: importing vLLM takes longer than a refusal should; a vLLM that is there but does not import
# fails the engine's start (EngineStartError), named in one line too.
HAS_VLLM = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"


def engine_pythonpath() -> str:
    """The engine's PYTHONPATH: this checkout first (it imports exactrl's engine modules), then the caller's."""
    return os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def check_vllm_python(python: str | None, prefix: str = "", timeout: float = 60.0) -> None:
    """Refuse, before anything starts, an engine interpreter (``{prefix}rollout.vllm.python``, unset: this one)
    that does not exist, cannot run, or has no vllm module: a ConfigError naming the key, the path and how to get
    vLLM. Without it the run would find out after its model loaded, at the engine's start."""
    key = f"{prefix}rollout.vllm.python"
    how = (f"on CPU, `make vllm` builds .venv-vllm: then set {key}=.venv-vllm/bin/python (on a GPU: pip install vllm "
           "beside exactrl and leave it unset; docs/scaling-out.md, \"vLLM on a CPU\")")
    given = f"{key}={python}" if python else f"{prefix}rollout.engine=vllm with {key} unset (this Python)"
    exe = python or sys.executable
    found = shutil.which(exe)
    if found is None:
        p = Path(exe)
        if os.sep not in exe:
            why = "is not a command on PATH"
        elif not p.exists():
            why = "does not exist"
        elif p.is_dir():
            why = "is a directory, not a Python interpreter (give its bin/python)"
        else:
            why = "is not executable"
        raise ConfigError(f"{given}: '{exe}' {why}; {how}")
    try:
        proc = subprocess.run([found, "-c", HAS_VLLM], env={**os.environ, "PYTHONPATH": engine_pythonpath()},
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{given}: '{exe}' did not answer within {timeout:g} s when asked whether it has vllm") \
            from None
    except OSError as e:  # e.g. not a program this machine runs (exec format error)
        raise ConfigError(f"{given}: '{exe}' does not run ({e.strerror or e}); {how}") from None
    if proc.returncode == 3:
        raise ConfigError(f"{given}: '{exe}' has no vllm module; {how}")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        said = f": {last}" if last else ""
        raise ConfigError(f"{given}: '{exe}' does not run as a Python (exit code {proc.returncode}{said}); "
                          f"{how}")
