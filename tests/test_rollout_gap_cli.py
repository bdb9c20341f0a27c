"""The rollout-trainer gap end to end on the built-in task (train_rl, as `exactrl rl` runs it):
with the HF loop it stays at the exact baseline, with and without the old-log-prob pass and with
a generator whose log-probs are over the top-p/top-k kept set; with a generator whose log-probs
are moved by known amounts (a test-only wrapper) the metrics move by exactly those amounts and
the correction acts on exactly the tokens its closed form names. The choice lands in the
manifest, which `exactrl audit run` reports."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import ClassVar

import pytest

from exactrl.algorithms import rl
from exactrl.audit.runs import audit_run
from exactrl.config import RLConfig, load_config
from exactrl.rollout.hf import HFEngine
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers import placement
from test_kept_set import KeptSetEngine

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
# log-prob shifts the perturbed generator adds, cycling over a response's tokens: rho = exp(-shift)
# = 1, 0.61, 2.72, 0.14, 1.35: far from every bound used below (1/2, 2, 5)
SHIFTS = (0.0, 0.5, -1.0, 2.0, -0.3)


class Perturbed(HFEngine):
    """The HF loop whose recorded log-probs are moved by SHIFTS (what it injected, per response, in ``shifts``)."""

    shifts: ClassVar[list[list[float]]] = []

    def generate(self, prompt_ids, params=None, seeds=None, **kwargs):
        out = []
        for g in super().generate(prompt_ids, params, seeds, **kwargs):
            shift = [SHIFTS[t % len(SHIFTS)] for t in range(len(g.logprobs))]
            Perturbed.shifts.append(shift)
            out.append(replace(g, logprobs=[lp + s for lp, s in zip(g.logprobs, shift)]))
        return out


def run(tmp_path, monkeypatch, engine, *overrides) -> tuple[list[dict], object]:
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(placement, "HFEngine", engine)  # the generator of the in-process roles
    cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                       "algo.group_size=4", "train.max_steps=2", "train.log_every=1",
                                       "rollout.max_new_tokens=12", "rollout.temperature=0.9",
                                       f"output_dir={tmp_path / 'run'}", *overrides])
    result = rl.train_rl(cfg, spec=SPEC)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], result


@pytest.mark.parametrize("engine,overrides", [
    (HFEngine, []),
    (KeptSetEngine, ["algo.ppo_epochs=2", "train.max_steps=4", "rollout.top_p=0.8", "rollout.top_k=6",
                     "algo.rollout_correction=tis"]),
], ids=["hf-one-update", "kept-set-old-pass-tis"])
def test_the_hf_loop_stays_at_the_exact_baseline(tmp_path, monkeypatch, engine, overrides):
    """The gap of the trainer's own decode loop is rounding (~1e-5, algo.gen_ratio_tol's comment),
    measured in the update's forward (one update) or over the old-log-prob pass, over the kept set
    when the generator's log-probs are."""
    rows, result = run(tmp_path, monkeypatch, engine, *overrides)
    for r in rows:
        assert r["rollout_gap/abs_max"] < 1e-4 and r["rollout_gap/chi2_token"] < 1e-8
        assert r["rollout_gap/outside_frac"] == 0.0
        assert r.get("rollout_correction/corrected_frac", 0.0) == 0.0
    entry = json.loads((result.run_dir / "manifest.json").read_text())["rollout_correction"]["rl"]
    assert entry["kept_set_replayed"] == (engine is KeptSetEngine)


def expected(shifts: list[list[float]], cap: float) -> dict[str, float]:
    """The gap's metrics if the trainer's log-probs were exactly the HF loop's: delta = -shift."""
    flat = [-s for row in shifts for s in row]
    rho = [math.exp(d) for d in flat]
    return {"rollout_gap/abs_mean": sum(map(abs, flat)) / len(flat), "rollout_gap/abs_max": max(map(abs, flat)),
            "rollout_gap/k1": -sum(flat) / len(flat), "rollout_gap/k3": sum(r - 1 - d for r, d in zip(rho, flat)) / len(
                flat), "rollout_gap/chi2_token": sum((r - 1) ** 2 for r in rho) / len(rho),
            "rollout_gap/chi2_seq": sum((math.exp(-sum(row)) - 1) ** 2 for row in shifts) / len(shifts),
            "rollout_gap/outside_frac": sum(not 1 / cap <= r <= cap for r in rho) / len(rho)}


@pytest.mark.parametrize("overrides,corrected", [
    # one update per rollout (the update's forward measures), icepop [1/2, 5] masks the rho = 0.14 tokens
    (["algo.rollout_correction=icepop", "algo.ratio_check=off"], lambda rho: not 0.5 <= rho <= 5.0),
    # an old-log-prob pass (two epochs), tis folded truncates the rho = 2.72 tokens at 2
    (["algo.ppo_epochs=2", "train.max_steps=4", "algo.rollout_correction=tis", "algo.rollout_correction_form=folded"],
     lambda rho: rho > 2.0),
], ids=["icepop-one-update", "tis-folded-old-pass"])
def test_a_perturbed_generator_moves_the_metrics_by_what_it_injected(tmp_path, monkeypatch, overrides, corrected):
    Perturbed.shifts = []
    rows, result = run(tmp_path, monkeypatch, Perturbed, *overrides)
    per_rollout = len(Perturbed.shifts) // 2  # two rollouts of 8 responses
    for rollout in range(2):
        shifts = Perturbed.shifts[rollout * per_rollout : (rollout + 1) * per_rollout]
        want = expected(shifts, 2.0)
        first = next(r for r in rows if r["rollout"] == rollout)
        # the HF loop's own rounding (<= ~1e-5 per token) is all that separates them
        assert {k: first[k] for k in want} == pytest.approx(want, rel=1e-4, abs=1e-4)
        rho = [math.exp(-s) for row in shifts for s in row]
        assert first["rollout_correction/corrected_frac"] == sum(map(corrected, rho)) / len(rho)
    audit = audit_run(result.run_dir)
    (reading,) = audit.facts["rollout_correction"]
    correction = next(o.split("=")[1] for o in overrides if o.startswith("algo.rollout_correction="))
    assert reading.value.startswith(f"rl: {correction} ") and reading.evidence[0].at.startswith("manifest.json:")
