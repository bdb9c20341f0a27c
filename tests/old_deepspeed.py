"""A throw-away environment with DeepSpeed 0.18.5 (inside the affected range 0.15.2-0.18.9 of
the CPU-offload accumulation bug), cached under .venv-cache/. It is an overlay on the project's
.venv: its own site-packages hold only DeepSpeed 0.18.5 (installed without dependencies, and found
first), and a .pth line adds the .venv's site-packages behind it, so torch, transformers and every
other pin are the very files the suite tests, and exactrl itself resolves to this checkout. Both
`exactrl audit stack --python` and a real `exactrl sft` run there. Building it takes seconds (it
took three minutes as a full second install of every pin); DeepSpeed compiles its CPU ops on first
use, cached per version (ds_env)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.18.5"


def old_deepspeed_python() -> str:
    env = ROOT / ".venv-cache" / f"ds-{VERSION}"
    python = env / "bin" / "python"
    ready = env / ".ready-overlay"
    if ready.exists():
        return str(python)
    env.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(env.parent / f".ds-{VERSION}.lock"):  # test workers in parallel build it once
        if ready.exists():
            return str(python)
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
        own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
        base = sysconfig.get_paths()["purelib"]  # this interpreter's: the suite's .venv
        # "import" lines of a .pth file run at start-up; addsitedir also reads base's own .pth files
        # (the editable install of exactrl), which a bare path line would not.
        Path(own, "zz_exactrl_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
        # DeepSpeed 0.18.5 is an sdist whose build imports torch, so it builds without isolation, and by this
        # interpreter's pip and setuptools: a new venv's own (setuptools 65, no wheel) cannot build a wheel at all
        # ("invalid command 'bdist_wheel'"), which only a pip cache holding the wheel from elsewhere had hidden.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", own, f"deepspeed=={VERSION}"], check=True)
        found = subprocess.run([str(python), "-c", "import deepspeed; print(deepspeed.__version__)"],
                               check=True, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert found.stdout.strip().splitlines()[-1] == VERSION, found.stdout
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
