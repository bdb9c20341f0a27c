"""fault.* reproduces the two bugs of arXiv 2604.23747 exactly, the canary catches the first, and
every output says the run had a fault injected on purpose.

The references are written out from what each bug computes, with plain torch on a copy of the
model (never exactrl's loss code): DeepSpeed 0.15.2-0.18.x ZeRO-2 + CPU offload applies
(g_first + g_last)/K, g_k the gradient of micro-batch k's mean token loss (re-measured against
DeepSpeed 0.18.5 itself: exactrl/config/faults.py); OpenRLHF <= 0.10.2 applies the mean over the step's
micro-batches of each one's own token mean.
"""

from __future__ import annotations

import json

import pytest
import torch

from exactrl.algorithms.sft import demonstration, sft_objective
from exactrl.checks.canary import CanaryError
from exactrl.config import SFTConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.aggregation import AGG_MODES, StepNormalizer, micro_batch_normalizer
from exactrl.workers.worker import Worker
from own_audit import DS, ORLHF, A, assert_verdicts
from test_cli_failures import exactrl, one_line_error

LR, MICRO = 0.5, 2
EQUAL = ["abcd", "bcde", "cdef", "defg", "efgh", "fghi", "ghij", "hijk"]  # every micro-batch the same tokens
UNEVEN = ["a", "b", "cdefghijklmnop", "d", "efghijklmnopqrstuvwx", "f", "g", "hi"]


def cfg(*extra):
    return load_config(SFTConfig, None, ["optim.name=sgd", f"optim.lr={LR}", "optim.scheduler=constant",
                                         "train.max_grad_norm=0", "train.global_batch_size=8",
                                         f"train.micro_batch_size={MICRO}", *extra])


def examples(tokenizer, completions):
    rows = [Row(f"t:{i}", {"prompt": f"{i}{'+' * (i % 3)}=", "completion": c}) for i, c in enumerate(completions)]
    return encode_sft(rows, tokenizer, 256)


def exactrl_step(model, tokenizer, completions, config):
    """One optimizer step of exactrl's SFT over the 8 examples, in the micro-batches of the plan."""
    samples = [demonstration(e) for e in examples(tokenizer, completions)]
    worker = Worker("policy", model, build_engine(model, config, 1), pad_id=tokenizer.pad_token_id)
    plan = plan_samples(samples, MICRO, "token-mean")
    return plan, worker.train_step(samples, plan, sft_objective("token-mean", None))


def micro_grads(model, tokenizer, completions, micro_batches):
    """Per micro-batch: (gradient of its summed token NLL, its loss tokens, that sum), by plain torch, one sequence
    at a time."""
    out = []
    for mb in micro_batches:
        total, tokens = 0.0, 0
        for e in (examples(tokenizer, completions)[i] for i in mb):
            ids = torch.tensor(e.input_ids)
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].float(), dim=-1)
            nll = -logp.gather(1, ids[1:, None])[:, 0]
            mask = torch.tensor(e.loss_mask[1:], dtype=nll.dtype)
            total, tokens = total + (nll * mask).sum(), tokens + int(mask.sum())
        out.append(([g.detach() for g in torch.autograd.grad(total, list(model.parameters()))], tokens, total.item()))
    return out


def sgd(model, grads):
    return [p.detach() - LR * g for p, g in zip(model.parameters(), grads)]


def rel_err(got, want, start):
    return max((a - b).abs().max().item() for a, b in zip(got, want)) / max(
        (b - s).abs().max().item() for b, s in zip(want, start))


def test_dropped_micro_batches_apply_first_plus_last_over_k(make_model, tokenizer):
    model, ref = make_model(0), make_model(0)
    start = [p.detach().clone() for p in ref.parameters()]
    plan, result = exactrl_step(model, tokenizer, EQUAL, cfg("fault.dropped_micro_batches=true", "audit.canary=warn"))
    k = len(plan.micro_batches)
    per = micro_grads(ref, tokenizer, EQUAL, plan.micro_batches)
    assert k == 4 and len({t for _, t, _ in per}) == 1  # equal micro-batches: exact shares = DeepSpeed's mean / K
    means = [[g / t for g in gs] for gs, t, _ in per]
    bugged = sgd(ref, [(a + b) / k for a, b in zip(means[0], means[-1])])
    correct = sgd(ref, [sum(gs) / k for gs in zip(*means)])
    got = [p.detach() for p in model.parameters()]
    assert rel_err(got, bugged, start) < 1e-5
    assert rel_err(got, correct, start) > 0.1  # the middle half of the step is gone
    # The canary read what the optimizer saw, two of four equal shares, and the warn policy counted the step.
    assert result.stats["canary"] == pytest.approx(0.5, abs=1e-6) and result.stats["canary_fired"] == 1
    # The loss reported is the whole step's: the real bug's loss curves looked normal too.
    assert result.loss == pytest.approx(sum(v for _, _, v in per) / sum(t for _, t, _ in per), rel=1e-5)


def test_the_canary_stops_dropped_micro_batches_and_nothing_is_applied(make_model, tokenizer):
    model = make_model(0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CanaryError) as err:
        exactrl_step(model, tokenizer, EQUAL, cfg("fault.dropped_micro_batches=true"))
    message = str(err.value)
    assert "carries 0.5 of the step's loss" in message and "over 4 micro-batches" in message
    assert "fault.dropped_micro_batches injected ON PURPOSE" in message
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_mean_of_means_is_the_mean_of_micro_batch_token_means(make_model, tokenizer):
    model, ref = make_model(0), make_model(0)
    start = [p.detach().clone() for p in ref.parameters()]
    plan, result = exactrl_step(model, tokenizer, UNEVEN, cfg("fault.mean_of_means=true"))
    per = micro_grads(ref, tokenizer, UNEVEN, plan.micro_batches)
    tokens = [t for _, t, _ in per]
    assert len(set(tokens)) > 1  # uneven micro-batches: where a mean of means bites
    by_param = list(zip(*(gs for gs, _, _ in per)))
    bugged = sgd(ref, [sum(g / t for g, t in zip(gs, tokens)) / len(per) for gs in by_param])
    full = sgd(ref, [sum(gs) / sum(tokens) for gs in by_param])
    got = [p.detach() for p in model.parameters()]
    assert rel_err(got, bugged, start) < 1e-5
    assert rel_err(got, full, start) > 0.1
    # The canary cannot see it: each micro-batch reached the optimizer once (under audit.canary=error).
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6) and result.stats["canary_fired"] == 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_normalizer_weighs_each_micro_batch_as_its_own_mean_over_m(mode):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # 3 rows, one of them without loss tokens
    norm = micro_batch_normalizer(StepNormalizer(mode, 100, 40, 8.0), mask, 5)
    n = torch.tensor([3.0, 1.0, 0.0])
    own = {"token-mean": 1 / 4 * torch.ones(3), "seq-mean-token-mean": 1 / (2 * n.clamp(min=1)),
           "seq-mean-token-sum": torch.full((3,), 1 / 2), "seq-mean-token-sum-norm": torch.full((3,), 1 / (2 * 8))}
    assert torch.allclose(norm.sequence_weights(n), own[mode].double() / 5, rtol=1e-12)
    assert micro_batch_normalizer(StepNormalizer(mode, 100, 40, 8.0), mask[2:], 5) is None


@pytest.mark.parametrize("extra,says", [
    (["fault.dropped_micro_batches=true", "train.micro_batch_size=4"], "K=2 per rank (the bug needs K >= 3)"),
    (["fault.dropped_micro_batches=true", "audit.canary=off"], "set audit.canary=warn to run through it"),
    (["fault.mean_of_means=true", "train.micro_batch_size=8"], "makes one micro-batch per step"),
])
def test_a_fault_that_would_change_nothing_or_go_unseen_is_refused(extra, says):
    with pytest.raises(ConfigError) as err:
        cfg(*extra)
    assert says in str(err.value)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


RUN = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=2", "train.max_steps=3",
       "train.log_every=1"]


def test_the_canary_stops_a_run_with_the_offload_fault_in_one_line(tmp_path, cache):
    out = tmp_path / "run"
    proc = exactrl(["sft", *RUN, "fault.dropped_micro_batches=true", f"output_dir={out}"], tmp_path, cache)
    line = one_line_error(proc, 3)
    assert line.startswith("stopped by the canary: canary failed at optimizer step 0"), line
    assert "fault.dropped_micro_batches injected ON PURPOSE" in line
    assert "FAULT INJECTED ON PURPOSE (sft starts)" in proc.stderr
    assert json.loads((out / "status.json").read_text())["state"] == "canary"
    assert "fault.dropped_micro_batches" in json.loads((out / "manifest.json").read_text())["faults_injected"]
    assert_verdicts(out, ds=A, says={DS: "The canary stopped the run before applying a step"})


def test_every_output_of_a_faulty_run_says_so(tmp_path, cache):
    out = tmp_path / "run"
    proc = exactrl(["sft", *RUN, "fault.dropped_micro_batches=true", "fault.mean_of_means=true", "audit.canary=warn",
                    f"output_dir={out}"], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for when in ("starts", "ends"):
        assert f"FAULT INJECTED ON PURPOSE (sft {when}) *** fault.dropped_micro_batches:" in proc.stderr
    both = ["fault.dropped_micro_batches", "fault.mean_of_means"]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows and all(r["faults_injected"] == both for r in rows)
    assert [r["canary_fired"] for r in rows if "canary_fired" in r] == [1, 2, 3]
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["faults_injected"]) == both
    assert manifest["checks"]["canary_sft"] == {"policy": "warn", "steps": 3, "steps_flagged": 3}
    audit = assert_verdicts(out, ds=A, orlhf=A, says={DS: "The canary (audit.canary=warn) flagged 3 step(s)"})
    verdicts = {v.bug: v for v in audit.verdicts}
    for bug, key in (("deepspeed-offload-accumulation", both[0]), ("openrlhf-mean-of-means", both[1])):
        assert verdicts[bug].status.value == "AFFECTED" and f"injected this bug ON PURPOSE ({key}=true" in \
            verdicts[bug].reason
        assert verdicts[bug].evidence[0].at.startswith("manifest.json:")
    assert sum(p.kind == "fault-injected" for p in audit.problems) == 2


def test_a_clean_run_carries_no_fault_label(tmp_path, cache):
    out = tmp_path / "run"
    proc = exactrl(["sft", *RUN[:-2], "train.max_steps=1", f"output_dir={out}"], tmp_path, cache)
    assert proc.returncode == 0 and "FAULT" not in proc.stderr
    assert "faults_injected" not in (out / "metrics.jsonl").read_text()
    assert "faults_injected" not in json.loads((out / "manifest.json").read_text())
    assert_verdicts(out)  # read as exactrl's run (issue 34: as OpenRLHF's, two verdicts UNKNOWN, exit 2)


def test_the_demos_summary_and_report_say_so(tmp_path, cache):
    out = tmp_path / "demo"
    proc = exactrl(["demo", f"output_dir={out}", "task.n_sft=256", "task.n_rl=64", "task.n_eval=16",
                    "sft.train.max_steps=2", "sft.data.eval_size=8", "sft.fault.mean_of_means=true",
                    "rl.train.max_steps=1", "rl.data.eval_size=8", "rl.train.global_batch_size=16",
                    "rl.train.micro_batch_size=4", "rl.rollout.max_new_tokens=8", "rl.fault.dropped_micro_batches=true",
                    "rl.audit.canary=warn"], tmp_path, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    both = ["fault.mean_of_means", "fault.dropped_micro_batches"]
    assert list(json.loads((out / "summary.json").read_text())["faults_injected"]) == both
    assert list(json.loads((out / "manifest.json").read_text())["faults_injected"]) == both
    assert "FAULT INJECTED ON PURPOSE (this run) *** fault.mean_of_means:" in (out / "report.md").read_text()
    # the demo is a pipeline: its accuracies in its own metrics.jsonl, each phase's records in its run directory
    rows = [json.loads(line) for path in ("metrics.jsonl", "sft/metrics.jsonl", "rl/metrics.jsonl")
            for line in open(out / path)]
    assert {r["phase"] for r in rows} == {"sft", "rl", "eval"}
    assert all(r["faults_injected"] == {"sft": both[:1], "rl": both[1:], "eval": both}[r["phase"]] for r in rows)
    assert_verdicts(out, ds=A, orlhf=A, facts={"trainer": ["sft", "rl (grpo)"]},
                    says={ORLHF: "fault.mean_of_means=true", DS: "flagged 1 step(s) (rl/metrics.jsonl"})
