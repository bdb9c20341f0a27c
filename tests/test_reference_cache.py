"""dpo/kto reference_cache=precompute (exactrl/workers/reference_cache.py): the cached reference log-probs equal
the on-the-fly ones (float64 within 1e-12 in other micro-batches; float32 within the bound below), a second run
with the same reference, data and settings runs no reference forward and does not load the reference, a changed
reference, data set or setting is another cache, and world size 2 computes the same cache, each rank a share."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from pair_references import answer_logprobs, fresh_model, make_pairs

from exactrl.algorithms.dpo import train_dpo
from exactrl.algorithms.kto import train_kto
from exactrl.algorithms.sft import resolve
from exactrl.config import load_config
from exactrl.config.schema_pref import DPOConfig, KTOConfig
from exactrl.data.preference import load_pairs
from exactrl.distributed.step_plan import plan_samples
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.reference_cache import ReferenceCache, cache_key, sequence_key
from exactrl.workers.worker import Worker

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
COMMON = ["model.path=builtin", "data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=2",
          "train.max_steps=2", "train.log_every=1", "optim.lr=1e-3", "data.eval_size=6"]
# float32: the precompute's micro-batches (3 sequences packed) against the step's (4). Measured on this CPU: 0 (a
# packed row's sequences do not share a reduction here), but a kernel may block a matmul by the row's length, which
# rounds differently: bound it at a few ulps of a log-prob of ~-14.
FP32_BOUND = 2e-6


def _step_values(reference: Worker, samples, micro: int) -> list[torch.Tensor]:
    plan = plan_samples(samples, micro, "token-mean", unit=2)
    return reference.forward(samples, "logprobs", [[list(mb) for mb in plan.micro_batches]])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cached_values_equal_the_steps_own(tmp_path, tokenizer, dtype):
    """Ten sequences of 2-70 tokens: filled 3 per packed forward, they equal the reference's forward in the step's
    micro-batches of 2 pairs (float64 within 1e-12, float32 within FP32_BOUND), read back from the file the same;
    a second cache on that file computes nothing and never asks for the reference."""
    samples = make_pairs(tokenizer, dtype)
    reference = Worker("reference", fresh_model(tokenizer, seed=9, dtype=dtype), pad_id=tokenizer.pad_token_id)
    cache = ReferenceCache(tmp_path, "k")
    assert cache.fill(samples, lambda: reference, per_forward=3) == len(samples)
    expected = _step_values(reference, samples, 4)
    err = max(float((a.double() - b.double()).abs().max()) for a, b in zip(cache.logprobs(samples), expected))
    print(f"{dtype}: cached vs the step's micro-batches, max abs difference {err:.3g}")
    assert err <= (1e-12 if dtype == torch.float64 else FP32_BOUND), err
    assert all(v.dtype == dtype for v in cache.logprobs(samples))

    def no_reference():
        raise AssertionError("the reference was asked for, but every sequence is cached")

    again = ReferenceCache(tmp_path, "k")
    assert again.fill(samples, no_reference, per_forward=3) == 0
    assert all(torch.equal(a, b) for a, b in zip(again.logprobs(samples), cache.logprobs(samples)))


def test_world_2_fills_the_same_cache(tmp_path):
    """At world size 2 (gloo) each rank computes a share of the forwards and receives all: every rank holds the same
    values, which equal the single process's within 1e-12 (float64)."""
    script = Path(__file__).parent / "dist" / "reference_cache_world.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = {}
    for world in (1, 2):
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
        path = tmp_path / f"world{world}.json"
        proc = subprocess.run([sys.executable, *launcher, str(script), str(world), str(tmp_path / f"c{world}"),
                               str(path)], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[world] = json.loads(path.read_text())
    assert out[2]["same_on_every_rank"] and out[1]["computed"] == out[2]["computed"] == 10
    err = max(abs(a - b) for r1, r2 in zip(out[1]["values"], out[2]["values"]) for a, b in zip(r1, r2))
    assert err <= 1e-12, err
    assert torch.load(tmp_path / "c2" / "world.pt", weights_only=True).keys() == torch.load(
        tmp_path / "c1" / "world.pt", weights_only=True).keys()


class Counting:
    """Counts the reference's forwards and builds, through Worker's own methods."""

    def __init__(self, monkeypatch):
        self.forwards = self.builds = 0
        forward, build = Worker.forward_fields, Worker.build.__func__

        def forward_fields(worker, samples, names, layout):
            self.forwards += worker.role == "reference"
            return forward(worker, samples, names, layout)

        def counted_build(cls, cfg, role, path, **kw):
            self.builds += role == "reference"
            return build(cls, cfg, role, path, **kw)

        monkeypatch.setattr(Worker, "forward_fields", forward_fields)
        monkeypatch.setattr(Worker, "build", classmethod(counted_build))

    def reset(self):
        self.forwards = self.builds = 0


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r and "step" in r]


def _cache_files(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "reference-cache").glob("*.pt")}


def _run(tmp_path, name, *extra, spec=SPEC):
    return train_dpo(load_config(DPOConfig, None, [*COMMON, *extra, f"output_dir={tmp_path / name}"]), spec=spec)


def test_dpo_second_run_reads_the_cache(tmp_path, monkeypatch):
    """dpo: the first precompute run builds the reference and computes its log-probs once; a second run with the
    same reference and data runs no reference forward, builds no reference and trains the same."""
    count = Counting(monkeypatch)
    first = _run(tmp_path, "first", "dpo.reference_cache=precompute")
    assert count.builds == 1 and count.forwards >= 1 and len(_cache_files(tmp_path)) == 1
    count.reset()
    second = _run(tmp_path, "second", "dpo.reference_cache=precompute")
    assert (count.forwards, count.builds) == (0, 0)
    assert _losses(second.run_dir) == _losses(first.run_dir)
    _check_pairwise(first)


def _check_pairwise(result, beta: float = 0.1) -> None:
    """The logged held-out pairwise accuracy against plain padded forwards of the saved policy and the reference:
    the share of pairs with beta * (log-ratio of chosen - log-ratio of rejected) > 0, and its mean."""
    path = resolve("builtin", "model", SPEC)
    tok = load_tokenizer(path)
    pairs = load_pairs(resolve("builtin", "pairs_eval", SPEC), tok, load_config(DPOConfig, None, []).data)[0][:6]
    samples = [s for p in pairs for s in p.samples()]
    with torch.no_grad():
        policy, ref = (torch.stack([v.double().sum() for v in answer_logprobs(load_causal_lm(m, trainable=False),
                                                                             samples, tok.pad_token_id)])
                       for m in (result.final_model, path))
    margin = beta * ((policy - ref)[0::2] - (policy - ref)[1::2])
    logged = next(r for r in map(json.loads, (result.run_dir / "metrics.jsonl").read_text().splitlines())
                  if "eval_pairwise_accuracy" in r)
    assert logged["eval_pairs"] == 6 and 0 < float((margin > 0).double().mean()) < 1
    assert logged["eval_pairwise_accuracy"] == float((margin > 0).double().mean())
    assert logged["eval_reward_margin"] == pytest.approx(float(margin.mean()), rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_dpo_cached_run_trains_as_the_on_the_fly_run(tmp_path, monkeypatch):
    """fp32: the precompute run's losses equal the on-the-fly run's within 1e-6 (the reference forwards once per
    step and once for the held-out pairs there, never during a cached run's steps)."""
    count = Counting(monkeypatch)
    plain = _run(tmp_path, "plain")
    assert count.forwards == 2 + 1 and count.builds == 1
    cached = _run(tmp_path, "cached", "dpo.reference_cache=precompute")
    assert _losses(cached.run_dir) == pytest.approx(_losses(plain.run_dir), rel=1e-6, abs=1e-7)


def test_a_changed_reference_data_or_setting_is_another_cache(tmp_path, tokenizer):
    """The file's key: the same for the same reference files, data and settings; another for one reference weight
    nudged by 1e-3, one token of the data changed, or another dtype."""
    ref = tmp_path / "ref"
    shutil.copytree(resolve("builtin", "model", SPEC), ref)
    data = make_pairs(tokenizer)
    settings = {"dtype": "fp32"}
    key = cache_key(ref, settings, data)
    assert cache_key(ref, dict(settings), make_pairs(tokenizer)) == key
    other = make_pairs(tokenizer)
    other[3].response_ids[0] += 1
    assert cache_key(ref, settings, other) != key
    assert cache_key(ref, {"dtype": "bf16"}, data) != key
    weights = next(ref.glob("*.safetensors"))
    state = load_file(weights)
    name = next(iter(state))
    state[name] = state[name] + 1e-3
    save_file(state, weights, metadata={"format": "pt"})
    assert cache_key(ref, settings, data) != key


def test_kto_second_run_runs_no_reference_forward(tmp_path, monkeypatch):
    """kto: the rows and the KL rows (a prompt with another row's completion) come from the cache too, so a second
    run runs no reference forward at all and gives the same losses and z."""
    count = Counting(monkeypatch)
    runs = []
    for name in ("first", "second"):
        count.reset()
        runs.append(train_kto(load_config(KTOConfig, None, [*COMMON, "kto.reference_cache=precompute",
                                                            f"output_dir={tmp_path / name}"]), spec=SPEC))
    assert (count.forwards, count.builds) == (0, 0)
    assert _losses(runs[1].run_dir) == _losses(runs[0].run_dir)


def test_sequence_keys_follow_the_token_ids():
    assert sequence_key([1, 2, 3]) == sequence_key([1, 2, 3]) != sequence_key([1, 2, 4])
