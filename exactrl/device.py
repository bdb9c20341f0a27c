"""The device of this process: one decision, made once, that models, batches, KV caches and
collectives all follow.

``distributed.device``: auto (``cuda:LOCAL_RANK`` when CUDA is available, else the CPU), cpu, or
cuda (an error when CUDA is not available). The train engine holds the answer as ``engine.device``;
code that only has a model (the decode loop, the packing self-check, ``model_batch``) asks the
model with ``device_of``, which returns what ``place`` recorded.

NCCL only takes tensors on the GPU of the calling rank, and pickles ``all_gather_object``'s
payload onto ``torch.cuda.current_device()``: so choosing CUDA also calls torch.cuda.set_device,
and ``process_group_backend`` gives NCCL exactly when the device is a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """distributed.device asks for a device this machine does not have."""


_process_device: torch.device | None = None


def resolve_device(setting: str = "auto", key: str = "distributed.device") -> torch.device:
    """The device ``setting`` (auto, cpu, cuda; the config's ``key``) means on this machine for this rank."""
    if setting not in DEVICES:
        raise DeviceError(f"{key}={setting!r}: choose one of {', '.join(DEVICES)}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{key}=cuda, but this torch ({torch.__version__}) sees no CUDA device; "
                          "install a CUDA build of torch (make setup TORCH=\"torch==... --index-url "
                          f"https://download.pytorch.org/whl/cu128\") or set {key}=auto")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def use_device(setting: str = "auto", key: str = "distributed.device") -> torch.device:
    """Decide this process's device (once: a later call with another answer is an error, since
    models and the process group already follow the first), select it for CUDA, return it."""
    global _process_device
    device = resolve_device(setting, key)
    if _process_device is not None and _process_device != device:
        raise DeviceError(f"{key}={setting} gives {device}, but this process already runs on "
                          f"{_process_device}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # accelerate imports DeepSpeed in every save_pretrained when it is installed, whatever the backend; told
        # the answer, DeepSpeed skips its accelerator probe and its "Setting accelerator to CPU" line.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _process_device = device
    return device


def check_device(cfg) -> torch.device:
    """This process's device from ``cfg.distributed`` (decided here, before any process group or
    model), with the settings that need a GPU checked against it."""
    device = use_device(cfg.distributed.device)
    if getattr(cfg.distributed, "fsdp_cpu_offload", False) and device.type == "cpu":
        raise DeviceError("distributed.fsdp_cpu_offload=true offloads from a GPU, and this process runs on the CPU "
                          f"(distributed.device={cfg.distributed.device}); set it to false")
    return device


CPUINFO = Path("/proc/cpuinfo")
# CPU flags of native bf16 arithmetic: x86's AVX512-BF16 and AMX-BF16, Arm's BF16 extension.
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_lacks_native_bf16() -> bool:
    """Whether this machine's CPU (as /proc/cpuinfo lists its flags) has no native bf16: its bf16
    matmuls are then emulated, many times slower than fp32. False when the flags cannot be read."""
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        return False
    flags = {f for line in lines if line.startswith(("flags", "Features")) for f in line.split(":", 1)[-1].split()}
    return bool(flags) and not flags & BF16_FLAGS


def process_device() -> torch.device:
    """This process's device: the one decided by use_device, else what 'auto' gives."""
    return _process_device if _process_device is not None else use_device("auto")


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _hf_model(model):
    return model if hasattr(model, "config") else getattr(model, "module", model)


def place(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move ``model`` to ``device`` and record it there (a no-op for a model already on it)."""
    model.to(device)
    _hf_model(model).exactrl_device = device
    return model


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (in host memory) on ``device`` without the host waiting for the device: a
    blocking copy from pageable memory ends in a stream synchronisation, so on CUDA it goes
    through pinned memory, asynchronously (the pinned buffer is not reused before the copy has
    run: torch's caching host allocator records the copy's stream). Elsewhere ``tensor.to(device)``."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=True)


def device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s inputs go: the device ``place`` recorded, else its first parameter's
    (a sharded parameter's local device), else the CPU."""
    recorded = getattr(_hf_model(model), "exactrl_device", None)
    if recorded is not None:
        return recorded
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
