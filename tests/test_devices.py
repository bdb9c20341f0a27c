"""The device decision and what follows it, on a machine without a GPU: distributed.device
resolves as documented, 'cuda' without CUDA is a one-line config error, autocast takes the
engine's device type, and models, batches, the decode loop's flag and metric reductions are
built on the model's or engine's device. A device other than the CPU is played by 'meta'
(tensors with a device and no data): a tensor left on the CPU shows up as the wrong device."""

from __future__ import annotations

import contextlib

import pytest
import torch

from exactrl import device as dev
from exactrl.algorithms.common import check_world
from exactrl.config import ConfigError, SFTConfig, load_config
from exactrl.data.batch import Sample, collate
from exactrl.distributed.engine import build_engine
from exactrl.models.packing import model_batch
from exactrl.rollout import hf


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_and_cpu_resolve_to_the_cpu_without_cuda(no_cuda):
    assert dev.resolve_device("auto") == torch.device("cpu")
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.process_group_backend(torch.device("cpu")) == "gloo"


def test_auto_with_cuda_is_the_local_rank_gpu_and_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dev.resolve_device("auto") == torch.device("cuda", 3)
    assert dev.resolve_device("cpu") == torch.device("cpu")  # forced CPU on a GPU machine
    assert dev.process_group_backend(torch.device("cuda", 3)) == "nccl"


def test_cuda_without_cuda_is_a_one_line_config_error(no_cuda):
    cfg = load_config(SFTConfig, None, ["distributed.device=cuda"])
    with pytest.raises(ConfigError) as e:
        check_world(cfg)
    msg = str(e.value)
    assert "distributed.device=cuda" in msg and "distributed.device=auto" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="distributed.device"):
        load_config(SFTConfig, None, ["distributed.device=gpu"])


def test_fsdp_cpu_offload_without_a_gpu_is_a_config_error(no_cuda):
    with pytest.raises(ConfigError, match="distributed.fsdp_cpu_offload=true"):
        check_world(load_config(SFTConfig, None, ["distributed.backend=fsdp2", "distributed.fsdp_cpu_offload=true"]))


def test_engine_owns_the_device_and_puts_model_and_canary_on_it(make_model):
    model = make_model(0)
    engine = build_engine(model, load_config(SFTConfig, None, ["distributed.device=cpu"]), total_steps=1)
    assert engine.device == torch.device("cpu") == dev.device_of(model)
    assert engine.canary.param.device == engine.device
    assert "device cpu" in engine.describe()


def test_autocast_runs_on_the_engines_device_type(make_model, monkeypatch):
    engine = build_engine(make_model(0), load_config(SFTConfig, None, ["model.dtype=bf16"]), total_steps=1)
    with engine.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    seen = []
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype: seen.append((device_type, dtype))
                        or contextlib.nullcontext())
    engine.device = torch.device("meta")
    with engine.autocast():
        pass
    assert seen == [("meta", torch.bfloat16)]


@pytest.mark.parametrize("packed", [True, False])
def test_model_batch_is_built_on_the_models_device(make_model, packed):
    model = dev.place(make_model(0), torch.device("meta"))
    mb = model_batch(model, [[1, 2, 3, 4], [5, 6], [7, 8, 9]], 0, packed)
    devices = {k: v.device.type for k, v in mb.inputs.items() if isinstance(v, torch.Tensor)}
    assert set(devices.values()) == {"meta"}, devices
    assert mb.targets is None or {t.device.type for t in mb.targets} == {"meta"}


def test_collate_moves_every_field_to_the_device():
    s = Sample([1, 2, 3], [4, 5], 1.0, True, {})
    s.advantages = torch.ones(4)
    batch = collate([s, s], 0, torch.device("meta"))
    assert {v.device.type for v in batch.values()} == {"meta"}
    assert {v.device.type for v in collate([s], 0).values()} == {"cpu"}  # no device: as before


class Reduced(Exception):
    pass


@pytest.fixture
def recorded_all_reduce(monkeypatch):
    """torch.distributed.all_reduce replaced by a recorder that stops the caller."""
    seen = []

    def all_reduce(t, op=None):
        seen.append(t.device)
        raise Reduced

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return seen


def test_the_engines_reduction_uses_tensors_on_its_device(make_model, recorded_all_reduce):
    # (the step's metrics are reduced by Worker.train_step, from tensors made on the engine's device)
    engine = build_engine(make_model(0), load_config(SFTConfig, None, []), total_steps=1)
    engine.world_size, engine.device = 2, torch.device("meta")
    with pytest.raises(Reduced):
        engine.begin_step(1)  # the ranks' micro-batch counts
    assert recorded_all_reduce == [torch.device("meta")]


def test_the_decode_loops_liveness_flag_is_reduced_on_the_rows_device(recorded_all_reduce):
    with pytest.raises(Reduced):
        hf._any_live(torch.ones(3, dtype=torch.bool, device="meta"), synced=True)
    assert recorded_all_reduce == [torch.device("meta")]



@pytest.mark.parametrize("flags,notice", [("fpu avx2 fma", True), ("fpu avx512f avx512_bf16", False),
                                          ("fpu amx_bf16 amx_tile", False), (None, False)])
def test_bf16_on_a_cpu_without_native_bf16_gets_one_notice(tmp_path, monkeypatch, recwarn, no_cuda, flags, notice):
    """bf16 on an AVX2-only CPU ran 3.5x slower than fp32 without a word (issue 21)."""
    info = tmp_path / "cpuinfo"
    if flags is not None:  # None: no /proc/cpuinfo to read (not Linux): no claim either way
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    monkeypatch.setattr(dev, "CPUINFO", info)
    monkeypatch.setattr(dev, "_process_device", None)
    check_world(load_config(SFTConfig, None, ["model.dtype=bf16", "distributed.device=cpu"]))
    got = [str(w.message) for w in recwarn if "native bf16" in str(w.message)]
    assert len(got) == int(notice)
    if notice:
        assert got[0].startswith("model.dtype=bf16 on a CPU without native bf16") and "set model.dtype=fp32" in got[0]
    check_world(load_config(SFTConfig, None, ["distributed.device=cpu"]))  # fp32: nothing to say
    assert len([w for w in recwarn if "native bf16" in str(w.message)]) == int(notice)
