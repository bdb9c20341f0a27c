"""Verified weight sync: after every push of the policy's weights to a generator, the generator
must hold exactly what the trainer sent, and compute with it what the trainer computes.

1. Digest. The trainer digests exactly the tensors it sends (name, dtype, shape, bytes), as they
   pass to the generator; the generator recomputes the digest from the weights it has loaded,
   under Hugging Face names (an engine that fused q/k/v or gate/up, or tied the head to the
   embeddings, undoes that first: exactrl/rollout/vllm_worker.py). Canonical order: sorted names,
   so neither side's iteration order matters. The two must be equal; the first differing tensor
   is named (a parameter skipped in a sync, a sync skipped while the version moved).
2. Probe. The generator's log-probs of a fixed short sequence against the trainer's forward,
   within a tolerance per dtype: right bytes read wrongly (a split in the wrong order, a rope or
   norm setting the engine reads differently) pass the digest but not the probe.
3. State. Each generator keeps a WeightsState: base (the weights it started with) -> synced(1) ->
   synced(2) ...; a reload of the base weights (or a wake-up that reloads them) after a sync is
   refused (TRL issue #5312: base weights reloaded after sleep/wake, training went on).

Every sample carries the version and digest of the weights it was sampled with.

This module needs only torch and the standard library: the vLLM engine process imports it.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from exactrl.dtypes import PRECISIONS


class WeightSyncError(RuntimeError):
    """A generator's weights differ from the trainer's after a sync, or a sync did not complete."""


PROBE_LENGTH = 16


def tensor_bytes_digest(t: torch.Tensor) -> str:
    """SHA-256 (its first 128 bits) of a tensor's bytes in row-major order, wherever it lives
    (copied to the CPU first when it is not there). SHA-256 for its speed where CPUs hash it in
    hardware (SHA-NI: ~0.9 GB/s on this project's CPU, against ~0.35 for blake2b)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1).view(torch.uint8)  # numpy has no bf16: hash the bytes
    if flat.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        # A numpy view of a tensor's storage makes that storage non-resizable for good, and FSDP2
        # frees an unsharded parameter by resizing its storage to 0 ("Trying to resize storage that
        # is not resizable" in the next backward): hash a copy (a memcpy, far cheaper than the hash).
        flat = flat.clone()
    return hashlib.sha256(flat.numpy()).hexdigest()[:32]


@dataclass(frozen=True)
class WeightsDigest:
    """Per-tensor records name -> (dtype, shape, bytes digest), and one value for all of them."""

    tensors: dict[str, tuple[str, tuple[int, ...], str]]

    def __post_init__(self):  # records that crossed a process boundary may hold lists
        object.__setattr__(self, "tensors", {n: (str(d), tuple(int(x) for x in s), str(h))
                                             for n, (d, s, h) in self.tensors.items()})

    @property
    def value(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            dtype, shape, data = self.tensors[name]
            h.update(f"{name}|{dtype}|{list(shape)}|{data}\n".encode())
        return h.hexdigest()[:32]

    @property
    def num_bytes(self) -> int:
        return sum(math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
                   for dtype, shape, _ in self.tensors.values())

    def first_difference(self, other: WeightsDigest, mine: str = "sent", theirs: str = "loaded") -> str | None:
        """The first tensor (sorted by name) that differs between the two, said in a phrase; None: equal."""
        for name in sorted(set(self.tensors) | set(other.tensors)):
            a, b = self.tensors.get(name), other.tensors.get(name)
            if a == b:
                continue
            if a is None or b is None:
                return f"'{name}' was {'not ' if a is None else ''}{mine} but is {'' if b else 'not '}{theirs}"
            if a[:2] != b[:2]:
                return f"'{name}' is {a[0]}{list(a[1])} {mine}, {b[0]}{list(b[1])} {theirs}"
            return f"'{name}' has other bytes {theirs} than {mine}"
        return None


def _add(records: dict, name: str, t: torch.Tensor) -> None:
    if name in records:  # the same name sent twice: one of them is lost on arrival
        raise WeightSyncError(f"'{name}' appears twice in the weights")
    records[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_bytes_digest(t))


def digest_of(named: Iterable[tuple[str, torch.Tensor]]) -> WeightsDigest:
    """The digest of ``named`` tensors."""
    out = {}
    for name, t in named:
        _add(out, name, t)
    return WeightsDigest(out)


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: a DTensor's shard (FSDP2), a ZeRO-3 partition, else itself."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def shared_digest(named: Iterable[tuple[str, torch.Tensor]], sharded: bool) -> WeightsDigest:
    """The digest of parameters a generator shares with the trainer (the in-process HF loop):
    each rank's own shard when ``sharded``, every rank's records joined under rank{r}/ so every
    rank stamps the same value (which then depends on the sharding as well as the values). The
    generator holds these very tensors, so the trainer's digest of them is the same: computed
    once, it is still what stamps each sample with the weights that sampled it."""
    local = digest_of((name, _local(t)) for name, t in named).tensors
    if not sharded:
        return WeightsDigest(local)
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    return WeightsDigest({f"rank{r}/{n}": rec for r, part in enumerate(parts) for n, rec in part.items()})


class Digesting:
    """Wraps the stream of tensors being sent and digests each one as it passes, so the digest is
    of exactly what was sent (one more read of each tensor, no copy on the CPU)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self.named, self.tensors = named, {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.named:
            _add(self.tensors, name, t)
            yield name, t

    def digest(self) -> WeightsDigest:
        return WeightsDigest(dict(self.tensors))


@dataclass
class WeightsState:
    """Which weights a generator holds: ``base`` (those it started with, version 0), ``synced``
    (the trainer's of ``version``), or ``dropped`` (released by a sleep that discards them: nothing
    may be generated until the next sync); and whether it is ``asleep`` (the sleep level, 0 awake).

        base -> synced(1) -> synced(2) ...        a sync: the version moves by one
        synced -sleep(1)-> asleep -wake-> synced   the weights wait in host memory; on waking they
                                                   must be the very weights that went to sleep
        synced -sleep(2)-> dropped -sync-> synced  discarded: only a sync brings weights back

    Refused: a reload from disk after a sync, a wake-up that brings back other weights than those
    that slept (TRL issue #5312: the base weights came back after sleep/wake and training went on
    at the same version), generating while asleep or with dropped weights. ``resident`` is the
    digest of the weights as the engine holds them after a sync (in its own layout), what a wake-up
    is checked against."""

    engine: str
    kind: str = "base"
    version: int = 0
    digest: str | None = None
    asleep: int = 0
    resident: str | None = None
    history: list[str] = field(default_factory=list)

    def synced(self, version: int, digest: str | None, resident: str | None = None) -> None:
        if version != self.version + 1:
            raise WeightSyncError(f"{self.engine}: a sync to version {version} after version {self.version}; "
                                  "versions move by one per sync")
        if self.asleep:
            raise WeightSyncError(f"{self.engine}: a sync to version {version} while asleep (level {self.asleep}): "
                                  "wake it first")
        self.kind, self.version, self.digest, self.resident = "synced", version, digest, resident
        self.history.append(f"synced({version})")

    def reload_base(self, what: str) -> None:
        """``what`` (e.g. 'reload_weights') is about to load the base weights from disk."""
        if self.kind != "base":
            raise WeightSyncError(f"{self.engine}: {what} would load the base weights over the synced weights of "
                                  f"version {self.version} (state {self.kind}; TRL issue #5312): sync again instead")
        self.history.append(f"reload({what})")

    def dropped(self, what: str) -> None:
        self.kind, self.resident = "dropped", None
        self.history.append(f"dropped({what})")

    def slept(self, level: int) -> None:
        """The engine goes to sleep: level 1 keeps its weights (in host memory), level 2 drops them."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: 1 (weights kept in host memory) or 2 (weights discarded)")
        if level == 2:
            self.dropped("sleep(level=2)")
        self.asleep = level
        self.history.append(f"sleep({level})")

    def woke(self, resident: str | None) -> None:
        """The engine woke holding weights whose resident digest is ``resident`` (None: not
        recomputed, only allowed when its weights were dropped: the next sync replaces them)."""
        level, self.asleep = self.asleep, 0
        self.history.append("wake")
        if level == 1 and self.kind != "dropped" and self.resident is not None and resident != self.resident:
            kept = f"the synced weights of version {self.version}" if self.kind == "synced" else "its base weights"
            self.kind = "dropped"
            raise WeightSyncError(f"{self.engine}: after waking from sleep it holds other weights than {kept} it "
                                  f"went to sleep with (resident digest {str(resident)[:12]}, was "
                                  f"{self.resident[:12]}; TRL issue #5312): sync again before generating")

    def require_usable(self, what: str) -> None:
        if self.asleep:
            raise WeightSyncError(f"{self.engine}: {what} while asleep (level {self.asleep}); wake it first")
        if self.kind == "dropped":
            raise WeightSyncError(f"{self.engine}: {what} with its weights released ({', '.join(self.history[-3:])}); "
                                  "sync the weights first")


def probe_ids(vocab_size: int, avoid: Iterable[int] = (), length: int = PROBE_LENGTH) -> list[int]:
    """A fixed short sequence of ordinary tokens (never ``avoid``: pad, EOS) for the probe."""
    g = torch.Generator().manual_seed(24)
    skip = set(avoid)
    ids = [t for t in torch.randperm(vocab_size, generator=g).tolist() if t not in skip]
    return ids[:length]


@dataclass(frozen=True)
class SyncReport:
    """One verified sync: for the rollout's record and every sample it samples."""

    version: int
    digest: str
    seconds: float  # the whole push: export, transfer, load, both digests, the probe
    probe_error: float
    tensors: int


@dataclass(frozen=True)
class SyncCheck:
    """How a sync is verified: ``policy`` error or warn (rollout.sync_check), the probe's
    tolerance ``probe_tol`` (rollout.probe_tol, else the probe_tol of model.dtype=``dtype``, exactrl/dtypes.py)."""

    policy: str = "error"
    dtype: str = "fp32"
    probe_tol: float | None = None

    @property
    def tol(self) -> float:
        return self.probe_tol if self.probe_tol is not None else PRECISIONS[self.dtype].probe_tol

    def fail(self, message: str) -> None:
        if self.policy == "error":
            raise WeightSyncError(message + " (rollout.sync_check=warn only warns)")
        warnings.warn(message, stacklevel=3)

    def digests(self, engine: str, version: int, sent: WeightsDigest, loaded: WeightsDigest) -> None:
        diff = sent.first_difference(loaded)
        if diff is not None:
            self.fail(f"weight sync to {engine}, version {version}: the weights it holds are not those the trainer "
                      f"sent: {diff} ({len(sent.tensors)} tensors sent, {len(loaded.tensors)} loaded; digests "
                      f"{sent.value[:12]} sent, {loaded.value[:12]} loaded)")

    def probe(self, engine: str, version: int, trainer: torch.Tensor, generator: torch.Tensor) -> float:
        """Max |log-prob difference| on the probe sequence; fails above the tolerance."""
        trainer, generator = trainer.double().cpu(), torch.as_tensor(generator, dtype=torch.float64)
        if trainer.shape != generator.shape:
            self.fail(f"weight sync to {engine}, version {version}: the probe gave {generator.numel()} log-probs, "
                      f"the trainer {trainer.numel()}")
            return math.inf
        error = (trainer - generator).abs().max().item()
        if not error <= self.tol:  # a NaN fails too
            worst = int((trainer - generator).abs().nan_to_num(math.inf).argmax())
            self.fail(f"weight sync to {engine}, version {version}: its log-probs of the probe sequence differ from "
                      f"the trainer's by {error:.3g} > rollout.probe_tol={self.tol:g} ({self.dtype}; worst at token "
                      f"{worst + 1}: {generator[worst].item():.6g} against {trainer[worst].item():.6g})")
        return error
