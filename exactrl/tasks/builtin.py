"""Materialise the built-in task on disk (cached): model dir, tokenizer, SFT/RL/eval JSONL files.

Everything a user would otherwise download lives in one directory, so the built-in default
runs through exactly the code path a user's own checkpoint and data take.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from exactrl.tasks import arithmetic
from exactrl.tasks.tiny_model import save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer



def cache_dir() -> Path:
    """Where built-in artefacts live: $EXACTRL_CACHE, else ~/.cache/exactrl."""
    return Path(os.environ.get("EXACTRL_CACHE") or Path.home() / ".cache" / "exactrl")


@dataclass(frozen=True)
class BuiltinSpec:
    seed: int = 0
    digits: int = 3
    direct_fraction: float = 0.5
    skip_prob: float = 0.75
    n_sft: int = 20000
    n_rl: int = 20000
    n_eval: int = 2000

    def key(self) -> str:
        return "arith-" + "-".join(f"{k}{v}" for k, v in asdict(self).items())


@dataclass(frozen=True)
class BuiltinPaths:
    root: Path
    model: Path
    sft_train: Path
    rl_train: Path
    eval: Path


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def ensure_builtin(spec: BuiltinSpec = BuiltinSpec(), cache: Path | None = None) -> BuiltinPaths:
    """Build (once) and return the paths of the built-in model and data for ``spec``."""
    root = Path(cache or cache_dir()) / spec.key()
    paths = BuiltinPaths(root, root / "model-init", root / "sft_train.jsonl", root / "rl_train.jsonl", root / "eval.jsonl")
    if (root / "DONE").exists():
        return paths
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / ".lock"):  # several ranks or runs may ask at once: one builds, the others wait
        if not (root / "DONE").exists():
            _build(spec, paths)
    return paths


def _build(spec: BuiltinSpec, paths: BuiltinPaths) -> None:
    root = paths.root
    tok = save_tokenizer(paths.model)
    save_tiny_model(paths.model, tok, seed=spec.seed)
    train = arithmetic.generate("train", spec.n_sft + spec.n_rl, spec.seed, spec.digits)
    _write_jsonl(paths.sft_train, arithmetic.sft_rows(train[: spec.n_sft], spec.direct_fraction, spec.skip_prob, spec.seed))
    _write_jsonl(paths.rl_train, arithmetic.rl_rows(train[spec.n_sft :]))
    _write_jsonl(paths.eval, arithmetic.rl_rows(arithmetic.generate("eval", spec.n_eval, spec.seed, spec.digits)))
    (root / "DONE").write_text(json.dumps(asdict(spec)))


def ensure_builtin_sft(spec: BuiltinSpec = BuiltinSpec(), cache: Path | None = None) -> Path:
    """The built-in model after the demo's SFT phase: the starting point of RL examples (built once)."""
    from exactrl.algorithms.sft import train_sft  # the task package must not need the trainer to import
    from exactrl.config.schema import DemoConfig

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
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    env["EXACTRL_CACHE"] = str(root.parent)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per rank; the one builder may use every core
    code = ("from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin_sft; "
            f"ensure_builtin_sft(BuiltinSpec(**{asdict(spec)!r}))")
    if subprocess.run([sys.executable, "-c", code], env=env).returncode != 0:
        raise RuntimeError(f"building the built-in SFT model into {root / 'sft-model'} failed (see the output above)")
    return root / "sft-model"


def resolve(path: str | None, kind: str, spec: BuiltinSpec = BuiltinSpec()) -> str | None:
    """Map 'builtin' in model.path / data.* to the built-in files, and 'builtin-sft' in
    model.path to the built-in model after SFT; other paths pass through.

    ``kind`` is one of model, sft_train, rl_train, eval.
    """
    if path == "builtin-sft" and kind == "model":
        return str(ensure_builtin_sft(spec))
    if path != "builtin":
        return path
    return str(getattr(ensure_builtin(spec), kind))
