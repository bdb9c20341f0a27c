"""Checkpoints written atomically: a temp directory renamed into place, so a crash mid-write
leaves the previous checkpoint intact. Models are saved in Hugging Face format (safetensors)."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from exactrl.distributed.export import tied_copies
from exactrl.distributed.launch import rank, world_size
from exactrl.models import lora


def _atomic_dir(final: Path, write, collective: bool = False) -> Path:
    """Write a directory under a temporary name, then rename it into place (replacing an
    older one only after the new one is complete). ``collective``: every rank calls this and
    ``write``s its own files into the one temporary directory; the main process renames."""
    final = Path(final)
    me, world = (rank(), world_size()) if collective else (0, 1)
    barrier = torch.distributed.barrier if world > 1 else (lambda: None)
    tmp, old = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.old")
    if me == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write(tmp)
    barrier()
    if me == 0:
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


class NonFiniteError(RuntimeError):
    """A loss, gradient or weight became inf or NaN; nothing non-finite was applied or saved."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


def check_finite(state: dict, path: Path) -> None:
    """Refuse to save weights holding inf or NaN: such a model is never a result."""
    for name, t in state.items():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"the weights hold inf or NaN (first: {name}); '{path}' was not written "
                                 "(lower optim.lr, check the data and rewards)")


def write_model(directory: Path, model, state_dict: dict | None = None) -> None:
    """The model's weights in Hugging Face format, or a LoRA model's adapter in peft's format
    (exactrl/models/lora.py)."""
    if lora.is_peft(model):
        lora.write_adapter(directory, model, state_dict)
        return
    # gathered from shards, a tied weight's copies are separate tensors save_pretrained keeps
    if state_dict is not None:
        copies = tied_copies(model)
        state_dict = {k: v for k, v in state_dict.items() if k not in copies}
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)


def save_pretrained(path: Path, model, tokenizer, state_dict: dict | None = None, merge: bool = False) -> Path:
    """Model + tokenizer, loadable with from_pretrained(path). ``state_dict``: the full
    weights when the model's own parameters are sharded (FSDP2, ZeRO-3). A LoRA model: its
    adapter, and with ``merge`` (model.lora.merge_on_save) the merged model in ``merged/``; a LoRA value model
    (exactrl rm's reward model): the merged model alone, a plain reward model (lora.merged_only)."""
    check_finite(state_dict if state_dict is not None else model.state_dict(), path)

    def write(tmp: Path):
        if lora.merged_only(model):
            lora.write_merged(tmp, model, state_dict)
            tokenizer.save_pretrained(tmp)
            return
        write_model(tmp, model, state_dict)
        tokenizer.save_pretrained(tmp)
        if merge and lora.is_peft(model):
            lora.write_merged(tmp / "merged", model, state_dict)
            tokenizer.save_pretrained(tmp / "merged")

    return _atomic_dir(path, write)


STATE_FILE = "trainer_state.pt"


def _rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # Plain lists and tensors only, so the file loads with torch.load(weights_only=True).
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])


def write_part(directory: Path, model, tokenizer, weights: dict | None, state: dict) -> None:
    """One trained model's files in a checkpoint being written (on the main process): its weights
    in Hugging Face format (``weights``: gathered from shards; None: the model's own), the
    tokenizer, and ``state`` (its engine's optimizer/scheduler/step, the run's position...)."""
    check_finite(weights if weights is not None else model.state_dict(), directory)
    write_model(directory, model, weights)
    tokenizer.save_pretrained(directory)
    torch.save({**state, "world_size": world_size()}, directory / STATE_FILE)


def save_checkpoint(path: Path, tokenizer, workers: dict, position: dict, command: str) -> Path:
    """Every trained worker (``workers``: name -> worker, the policy first, the others each in a
    subdirectory ``name/``), every rank's RNG states, the data position and the command that
    wrote it (``position``, ``command``: what resume needs), written atomically. A collective
    under several processes: each rank writes its part into one temporary directory, renamed
    into place when all are done. Loaded back with ``resume``."""
    me = rank()

    def write(tmp: Path):
        for i, (name, worker) in enumerate(workers.items()):
            d = tmp / name if i else tmp
            d.mkdir(exist_ok=True)
            worker.save_state(d, tokenizer, {"extra": {} if i else position, "command": command})
        torch.save(_rng_state(), tmp / f"rng-rank{me}.pt")

    return _atomic_dir(path, write, collective=True)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from."""


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """A run directory's checkpoint-N directories, oldest first (never the .tmp of one being written)."""
    found = [d for d in Path(run_dir).glob("checkpoint-*")
             if d.is_dir() and d.name.removeprefix("checkpoint-").isdigit()]
    return sorted(found, key=lambda d: int(d.name.removeprefix("checkpoint-")))


def check_resumable(path: str | Path, world: int | None = None) -> dict:
    """The checkpoint's state file, once it is known to fit this run (before anything is written) of ``world``
    trainer processes (default: this process's world; a Ray run's driver gives its groups' ranks)."""
    p = Path(path)
    if p.name.startswith(".") and p.name.endswith((".tmp", ".old")):
        done = [d.name for d in complete_checkpoints(p.parent)]
        which = ": " + ", ".join(done) if done else " (this run has none)"
        raise CheckpointError(f"train.resume_from: '{p}' is a checkpoint whose write was interrupted (never renamed "
                              f"into place); resume from a complete one{which}")
    if not p.is_dir():
        done = [d.name for d in complete_checkpoints(p.parent)] if p.parent.is_dir() else []
        there = (f"; '{p.parent}' holds {', '.join(done)}" if done else
                 f"; '{p.parent}' holds no checkpoint-N" if p.parent.is_dir() else "")
        what = "is not a directory" if p.exists() else "does not exist"
        raise CheckpointError(f"train.resume_from: '{p}' {what}{there}; point it at a checkpoint-N directory of a "
                              "run (or train.resume_from=latest)")
    # A full model's config.json, or a LoRA run's adapter_config.json.
    weights = lora.ADAPTER_CONFIG if (p / lora.ADAPTER_CONFIG).is_file() else "config.json"
    missing = [name for name in (STATE_FILE, weights) if not (p / name).is_file()]
    if missing:
        raise CheckpointError(f"train.resume_from: '{p}' lacks {', '.join(missing)}; point it at a checkpoint-N "
                              "directory of a run")
    try:
        state = torch.load(p / STATE_FILE, weights_only=True)
    except Exception as e:  # truncated or foreign file: torch raises a zoo of types
        raise CheckpointError(f"train.resume_from: '{p / STATE_FILE}' cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); resume from another checkpoint") from None
    world = world_size() if world is None else world
    if state.get("world_size", 1) != world:
        raise CheckpointError(f"train.resume_from: '{p}' was written by {state.get('world_size', 1)} processes; "
                              f"this run has {world}. Resume with the same number of processes.")
    return state


def resume(path: str | Path, workers: dict) -> dict:
    """Load each worker's optimizer, scheduler and step (``workers`` as save_checkpoint took
    them) and this rank's RNG state from checkpoint ``path``; return the data position saved
    with it. The model weights are loaded by the caller, from the same directory, with
    from_pretrained (a LoRA run's adapter: exactrl.models.lora.apply_lora)."""
    p = Path(path)
    world = next(iter(workers.values())).world_size  # a Ray group's ranks are not this process's world
    for i, (name, worker) in enumerate(workers.items()):
        d = p / name if i else p
        worker.load_state(d, check_resumable(d, world)["engine"])
    _set_rng_state(torch.load(p / f"rng-rank{rank()}.pt", weights_only=True))
    return check_resumable(p, world)["extra"]
