"""The frozen reference's log-probs computed once, before training, and kept on disk (dpo/kto
``reference_cache=precompute``; TRL's precompute_ref_log_probs).

A reference is frozen, so its log-probs of a sequence never change during a run, nor between runs with
the same reference weights, the same tokenised data and the same forward settings (dtype, attention,
packing). The cache file is named by a digest of those three, so a second such run reads it and runs no
reference forward (a run whose entries are all there does not even load the reference model); a changed
reference, data set or setting gives another file. Inside, entries are keyed by each sequence's token ids,
so the KL rows of KTO (a prompt with another row's completion) are cached like any row.

Values: the per-token log-probs of every target, as Worker.forward returns them. They equal the on-the-fly
ones bit for bit when computed in the same micro-batches; the precompute packs its own micro-batches
(train.micro_batch_size sequences per forward, in data order), which in float32 moves a log-prob by a few
ulps (docs/algorithms/preference.md gives the measured bound), in float64 by under 1e-12.

Every rank runs its share of each forward and receives all (Worker.forward); every rank reads the same
file, so the cache directory must be on a filesystem they share (checked: the ranks must agree on what
is missing). Rank 0 writes the file, whole, by rename.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from exactrl.data.batch import Sample
from exactrl.distributed.collectives import gather
from exactrl.distributed.launch import is_main, world_size
from exactrl.progress import progress


def sequence_key(ids: list[int]) -> str:
    return hashlib.blake2b(json.dumps(ids).encode(), digest_size=16).hexdigest()


def files_digest(path: str | Path) -> str:
    """sha256 over every file under ``path`` (its relative name and bytes, in name order): the reference's weights
    and config as loaded."""
    root, h = Path(path), hashlib.sha256()
    files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
    for f in files:
        h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def cache_key(reference_path: str | Path, settings: dict, data: Iterable[Sample]) -> str:
    """The cache file's name: a digest of the reference's files, the forward ``settings`` and the token ids of
    every sequence of the data set (``data``)."""
    h = hashlib.sha256()
    h.update(files_digest(reference_path).encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    for s in data:
        h.update(sequence_key(s.ids).encode())
    return h.hexdigest()[:32]


def forward_settings(cfg) -> dict:
    """What changes a reference forward's values beside its weights and the tokens."""
    return {"dtype": cfg.model.dtype, "attn": cfg.model.attn_implementation, "packed": cfg.train.padding_free,
            "logprob_chunk": cfg.train.logprob_chunk_size, "lora_base": cfg.model.lora.rank > 0}


def forward_layout(n: int, per_forward: int, world: int) -> list[list[list[int]]]:
    """Indices 0..n-1 as each rank's micro-batches of at most ``per_forward``, every rank the same number and none
    empty (a sharded model's forwards are collectives: a rank short of samples repeats the last one)."""
    per_rank = [list(range(n))[r::world] or [n - 1] for r in range(world)]
    chunks = max(-(-len(p) // per_forward) for p in per_rank)
    out = []
    for p in per_rank:
        size = -(-len(p) // chunks)
        out.append([p[i * size : (i + 1) * size] or [p[-1]] for i in range(chunks)])
    return out


class ReferenceCache:
    """Per-sequence reference log-probs, by token ids, in the file ``directory/<key>.pt``."""

    def __init__(self, directory: str | Path, key: str):
        self.path = Path(directory) / f"{key}.pt"
        self.values: dict[str, torch.Tensor] = {}
        if self.path.exists():
            self.values = torch.load(self.path, weights_only=True)
        self.computed = 0  # sequences this run computed (0: everything came from the file)

    def missing(self, samples: list[Sample]) -> list[Sample]:
        """The sequences of ``samples`` not in the cache, each once, in order; the same list on every rank."""
        seen, out = set(), []
        for s in samples:
            k = sequence_key(s.ids)
            if k not in self.values and k not in seen:
                seen.add(k)
                out.append(s)
        counts = gather(len(out))
        if len(set(counts)) > 1:
            raise RuntimeError(f"the reference cache {self.path}: the ranks miss {counts} sequences each; put the "
                               "cache directory on a filesystem every rank reads")
        return out

    def fill(self, samples: list[Sample], reference: Callable, per_forward: int) -> int:
        """Compute the reference log-probs of every sequence of ``samples`` the cache lacks, ``per_forward``
        sequences per forward on each rank, with a progress bar, and save the file. ``reference()`` returns the
        reference worker, called only when something is missing. Returns how many were computed."""
        todo = self.missing(samples)
        if not todo:
            return 0
        worker, world = reference(), world_size()
        bar = progress(len(todo), "reference log-probs", enabled=is_main(), unit="seq")
        block = per_forward * world * 8  # sequences per gather: the bar moves, the gathered objects stay small
        for start in range(0, len(todo), block):
            part = todo[start : start + block]
            for s, v in zip(part, worker.forward(part, "logprobs", forward_layout(len(part), per_forward, world))):
                self.values[sequence_key(s.ids)] = v
            bar.update(len(part))
        bar.close()
        if is_main():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            torch.save(self.values, tmp)
            os.replace(tmp, self.path)
        self.computed += len(todo)
        return len(todo)

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The cached per-token log-probs of each of ``samples`` (all must be there: fill first)."""
        out = []
        for s in samples:
            v = self.values.get(sequence_key(s.ids))
            if v is None:
                raise KeyError(f"the reference cache {self.path} lacks a sequence of {len(s.ids)} tokens ({s.source}): "
                               "fill it with every sequence the run reads before training")
            out.append(v)
        return out
