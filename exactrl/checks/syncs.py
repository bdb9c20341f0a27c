"""Where the host would wait for the device: the ops that read a tensor's value on the host, make
a shape from values, or copy between host and device without being asynchronous.

On a GPU the host queues kernels ahead of the device; an op of this kind makes it wait until
everything queued has run, and the device then idles while the host catches up (a training
step's micro-batches stop overlapping the host's work), and a CUDA graph cannot capture it.
What counts is what ``torch.cuda.set_sync_debug_mode`` reports and a capture refuses:

* a value read: ``.item()``, ``bool(t)``, ``float(t)`` (aten._local_scalar_dense), ``.tolist()``,
  ``.numpy()``, ``.cpu()``, ``.to("cpu")``: a copy to the host;
* a shape made from values: ``nonzero``, ``torch.where(cond)`` with one argument, indexing with a
  boolean mask (index, index_put), ``masked_select``, ``unique``, ``bincount``,
  ``repeat_interleave`` without ``output_size``; and ``torch.equal``, a value read;
* a copy to the device from pageable host memory, or one that is not ``non_blocking``: CUDA
  stages pageable memory and a blocking copy ends in a stream synchronisation
  (``torch.tensor(data, device=...)`` is one). ``exactrl.device.to_device`` is the asynchronous form.

``HostSyncs`` records them (or calls ``on_sync``, which may raise) in three regimes:

* on a CUDA device: an op on a CUDA tensor and a copy between the CPU and CUDA count;
* ``every=True``: every tensor counts as a device tensor (the static decode step, which must hold
  no host work at all: exactrl/rollout/static_decode.py runs its first step under it, on the CPU
  too, so CI sees what a capture would refuse);
* emulated, for a CPU run standing in for a GPU one (there is no device in CI): the tensors given
  as ``on_device`` (a model's parameters and buffers), whatever is moved to or created on
  ``EMULATED`` (``torch.device("cpu", 0)``: give it as the engine's device) and everything computed
  from them are the device's tensors, and report ``EMULATED`` as their ``.device``; other CPU
  tensors are the host's. Host work on host tensors (a collated batch before it moves, a number
  the host computes from it) does not count, as on a GPU. What it cannot see: a sync op on a
  tensor created without a device argument and never mixed with a device tensor, and a copy to
  the host written ``.to(torch.device("cpu"))`` (torch's own code moves device tensors to the
  device it reads from them, the CPU here: only ``.to("cpu")`` counts as a copy to the host).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten

# The host's stand-in for a device in an emulated run: a CPU index no CPU tensor reports.
EMULATED = torch.device("cpu", 0)
HOST = torch.device("cpu")

# Ops that read values on the host or size their output from values.
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
         aten.unique_dim.default, aten.unique_consecutive.default, aten.equal.default, aten.bincount.default}
# Ops that do so when an index is a boolean mask (its nonzero is taken on the host).
INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
# Tensor methods that hand the host a device tensor's values.
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__array__}
DEVICE_GETTER = torch.Tensor.device.__get__

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above the exactrl package


@dataclass(frozen=True)
class Sync:
    what: str  # the op and why the host waits
    where: str  # the innermost frame outside torch that ran it, file:line in function

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


def _where() -> str:
    """The innermost frame outside torch and this module: the line that asked for the op."""
    frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and f.filename != __file__]
    f = frames[-1]
    return f"{os.path.relpath(f.filename, _ROOT)}:{f.lineno} in {f.name}"


def _is_device(d) -> bool | None:
    """Whether ``d`` (a device, string or None) names the emulated device (True), the host (False), or nothing."""
    if d is None:
        return None
    d = torch.device(d) if isinstance(d, (str, int)) else d
    return d == EMULATED if isinstance(d, torch.device) else None


class HostSyncs:
    """A context recording the ops run inside it that would make the host wait for the device
    (``syncs``, each with the exactrl line that ran it); ``on_sync(sync)`` is called on each as
    it happens (raise there to stop at the first). See the module's docstring for ``every`` and
    ``on_device`` (the emulated regime)."""

    def __init__(self, *, every: bool = False, on_device: Iterable[torch.Tensor] | None = None,
                 on_sync: Callable[[Sync], None] | None = None):
        self.every, self.emulated, self.on_sync = every, on_device is not None, on_sync
        self.syncs: list[Sync] = []
        self._device: dict[int, torch.Tensor] = {}  # emulated: id -> the device's tensor (held: ids stay unique)
        self._quiet = 0  # inside a read already recorded at the Python level
        for t in on_device or ():
            self._mark(t)
        self._modes = [_Dispatch(self)] if every else [_Function(self), _Dispatch(self)]

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._device.clear()

    # --- which tensors are the device's -----------------------------------------------------
    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.every:
            return True
        return t.device.type not in ("cpu", "meta") or (self.emulated and id(t) in self._device)

    def _mark(self, out) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._device[id(t)] = t

    def _propagate(self, inputs, out) -> None:
        if self.emulated and any(self.on_device(t) for t in tree_leaves(inputs)):
            self._mark(out)

    def record(self, what: str) -> None:
        if self._quiet:
            return
        sync = Sync(what, _where())
        self.syncs.append(sync)
        if self.on_sync is not None:
            self.on_sync(sync)

    # --- the aten level: every op, the backward's too --------------------------------------------
    def dispatch(self, func, args, kwargs):
        leaves = tree_leaves((args, kwargs))
        if func in READS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            if any(self.on_device(t) for t in leaves):
                self.record(f"{func} (reads values on the host)")
        elif func in INDEXED and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            if any(self.on_device(t) for t in leaves):
                self.record(f"{func} with a boolean index (its nonzero is taken on the host)")
        elif func in COPIES and not self.every and not self.emulated:
            self._real_copy(func, args, kwargs)
        out = func(*args, **kwargs)
        self._propagate((args, kwargs), out)
        return out

    def _real_copy(self, func, args, kwargs) -> None:
        """A copy between the CPU and a CUDA device (the emulated regime sees them at the Python level)."""
        if func is aten._to_copy.default:
            src, dst = args[0], kwargs.get("device") or args[0].device
        else:
            dst, src = args[0].device, args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if func is aten.copy_.default and len(args) > 2 else False)
        if src.device.type == dst.type:
            return
        if dst.type == "cpu":
            self.record(f"{func} to the host (copies a device tensor's values to the host)")
        elif src.device.type == "cpu" and not (non_blocking and src.is_pinned()):
            self.record(f"{func} to the device from {'pageable' if non_blocking else 'a blocking copy of'} host "
                        "memory (waits for the device's queue)")

    # --- the Python level: reads of a device tensor, moves to and from the emulated device ----------
    def function(self, func, types, args, kwargs):
        kwargs = kwargs or {}
        if func == DEVICE_GETTER:
            return EMULATED if self.emulated and self.on_device(args[0]) else func(*args, **kwargs)
        if func in HOST_READS and self.on_device(args[0]):
            return self._read(f"Tensor.{func.__name__} of a device tensor (copies it to the host)", func, args,
                              kwargs)
        if func is torch.Tensor.to and isinstance(args[0], torch.Tensor):
            return self._to(func, args, kwargs)
        if func in (torch.tensor, torch.as_tensor) and _target(func, args, kwargs) is not None:
            device = _target(func, args, kwargs)
            host_data = not isinstance(args[0], torch.Tensor)
            if host_data and (device.type == "cuda" or (self.emulated and device == EMULATED)):
                self.record(f"torch.{func.__name__}(host data, device={device}) (a blocking copy to the device)")
        out = func(*args, **_untargeted(kwargs))
        if self.emulated and _is_device(kwargs.get("device")):
            self._mark(out)  # created on the emulated device
        else:
            self._propagate((args, kwargs), out)
        return out

    def _read(self, what, func, args, kwargs):
        self.record(what)
        self._quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._quiet -= 1

    def _to(self, func, args, kwargs):
        """Tensor.to: in the emulated regime a move between the host and ``EMULATED`` (on the CPU
        both are the CPU: the move copies, so host and device tensors stay apart, as on a GPU)."""
        if not self.emulated:
            return func(*args, **kwargs)  # a copy between the CPU and CUDA: the aten level sees it
        src, target = args[0], self._to_device(args[1:], kwargs)
        if target is None:  # a dtype alone
            out = func(*args, **kwargs)
            self._propagate(args[0], out)
            return out
        to_device, from_device = target == EMULATED, self.on_device(src)
        args, kwargs = tree_map(lambda a: HOST if isinstance(a, torch.device) and a == EMULATED else a, (args, kwargs))
        if from_device and not to_device:
            if any(isinstance(a, str) for a in (*args[1:], kwargs.get("device"))):  # .to("cpu"): to the host
                return self._read("Tensor.to(the host) of a device tensor (copies it to the host)", func, args, kwargs)
            # A torch.device of the CPU: torch's own code reads a device tensor's device below the Python
            # level (the CPU, in an emulated run) and moves it there -- where it already is.
            to_device = True
        out = func(*args, **kwargs)
        if to_device and not from_device:
            if not kwargs.get("non_blocking", False):
                self.record("Tensor.to(the device) without non_blocking (a blocking copy from host memory)")
            out = out.clone() if out is src else out
        if to_device:
            self._mark(out)
        return out

    def _to_device(self, rest, kwargs) -> torch.device | None:
        """The device a Tensor.to call names (positionally, by keyword, or as another tensor's), or None."""
        for a in (*rest, kwargs.get("device"), kwargs.get("other")):
            if isinstance(a, torch.device):
                return a
            if isinstance(a, str):
                return torch.device(a)
            if isinstance(a, torch.Tensor):
                return EMULATED if self.on_device(a) else a.device
        return None


def _target(func, args, kwargs) -> torch.device | None:
    d = kwargs.get("device")
    return None if d is None else torch.device(d) if isinstance(d, (str, int)) else d


def _untargeted(kwargs: dict) -> dict:
    """``kwargs`` with the emulated device replaced by the host for the call itself."""
    return kwargs if not _is_device(kwargs.get("device")) else {**kwargs, "device": HOST}


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.owner.dispatch(func, args, kwargs or {})


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncs):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.owner.function(func, types, args, kwargs)
