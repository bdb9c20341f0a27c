"""`exactrl kd`: the step's loss (1 - alpha) NLL + alpha D(p_T, p_S) over the step's loss tokens, against a
one-pass reference written here with plain torch (padded forwards of both models, each divergence from its
formula, one sum over every loss token divided by their count: no exactrl loss, term, plan or aggregation code),
for micro-batches of 1, 2 and the whole step in float64; the teacher aligned token by token with the student;
bad configs refused; and the command end to end on the built-in task."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from equivalence import relative_error
from kd_references import ALPHA, BETA, LOSSES, LR, K, T, make_samples, reference_loss, sgd_reference
from pair_references import fresh_model

from distributed_harness import TOL, over_bound, run_cases
from exactrl.algorithms.kd import kd_step, train_kd
from exactrl.config import SFTConfig, load_config
from exactrl.config.schema_kd import KDConfig
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.kd import TEACHER_FIELDS, kd_objective
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.workers.teacher import Teacher
from exactrl.workers.worker import Worker

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
SCRIPT = Path(__file__).parent / "dist" / "kd_layouts.py"


@pytest.fixture(scope="module")
def samples(tokenizer):
    """Ten SFT samples whose completions run from 1 to ~60 tokens: micro-batches of very different token counts."""
    return make_samples(tokenizer)


def one_step(tok, samples, micro: int, loss: str, teacher_seed=9, alpha=ALPHA):
    """(parameters after one SGD step, the step's result) through kd_step, as `exactrl kd` runs it."""
    cfg = load_config(SFTConfig, None, ["train.global_batch_size=10", "train.micro_batch_size=1", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant", "train.max_grad_norm=0"])
    model = fresh_model(tok)
    policy = Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=tok.pad_token_id)
    teacher = Teacher("teacher", fresh_model(tok, seed=teacher_seed), pad_id=tok.pad_token_id, temperature=T)
    teacher.topk = K
    objective = kd_objective(loss, alpha, temperature=T, beta=BETA, agg="token-mean", norm_len=None)
    plan = plan_samples(samples, micro, "token-mean")
    result = kd_step(policy, teacher, samples, plan, objective, TEACHER_FIELDS[loss])
    assert all(getattr(s, "teacher_" + f) is None for s in samples for f in TEACHER_FIELDS[loss])  # not kept
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("micro", [1, 2, 10])
def test_the_update_is_the_reference_s_for_every_split(tokenizer, samples, loss, micro):
    got, result = one_step(tokenizer, samples, micro, loss)
    ref, value, div = sgd_reference(tokenizer, samples, loss)
    err = relative_error(got, ref, fresh_model(tokenizer).state_dict())
    assert err <= TOL["float64"], err
    assert result.loss == pytest.approx(value, rel=1e-12)
    assert result.metrics["kd_divergence"] == pytest.approx(div, rel=1e-12) and div > 0
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-6)  # an fp32 parameter: its shares round


def test_a_teacher_that_is_the_student_gives_zero_divergence_and_the_nll_gradient(tokenizer, samples):
    """Teacher and student align token by token: the same model on both sides gives a divergence of exactly 0 at
    every token, and the update is the NLL's alone (a teacher read one position off would give neither)."""
    got, result = one_step(tokenizer, samples, 2, "forward_kl", teacher_seed=3)
    assert result.metrics["kd_divergence"] == 0.0
    student = fresh_model(tokenizer)
    nll_only, _ = reference_loss(student, student, samples, tokenizer.pad_token_id, "forward_kl", alpha=ALPHA)
    nll_only.backward()  # alpha * D contributes 0: the loss is (1 - alpha) NLL
    with torch.no_grad():
        want = {k: v - LR * v.grad for k, v in student.named_parameters()}
    err = relative_error({k: got[k] for k in want}, want, fresh_model(tokenizer).state_dict())
    assert err <= TOL["float64"], err


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"], ids=["fsdp2-world2", "deepspeed-zero2-offload-world2"])
def test_world_size_two_applies_the_reference_update_on_uneven_ranks(tmp_path, backend):
    """Every kd.loss through kd_step on two gloo ranks of 5 and 4 samples (FSDP2 in float64; DeepSpeed ZeRO-2 with
    the optimizer offloaded: a float64 model stepped through fp32 master weights): one SGD step is the one-pass
    reference's. The peers' per-micro-batch mean is another update."""
    from old_deepspeed import ds_env

    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    r = run_cases(backend, 2, tmp_path / "out.json", ds_env() if backend == "deepspeed" else None, script=SCRIPT)
    cases = r["cases"]
    assert [c["loss"] for c in cases] == list(LOSSES)
    assert all(c["samples_per_rank"] == [5, 4] and len(set(c["samples_per_micro_batch"])) > 1 for c in cases), cases
    assert not over_bound(cases), cases
    assert all(abs(c["canary"] - 1) < 1e-6 for c in cases), cases
    print(f"{backend} world 2: " + ", ".join(f"{c['loss']} {c['rel_err']:.2g} ({c['precision']})" for c in cases)
          + f"; the peers' per-micro-batch mean {r['peers'][0]['rel_err']:.3g}")
    assert r["peers"][0]["rel_err"] > 1e-3, r["peers"]


def _exit(tmp_path, *overrides):
    from exactrl.cli import app

    return CliRunner().invoke(app, ["kd", *overrides, f"output_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("overrides, says", [
    (["kd.beta=0.2"], "kd.beta=0.2 is set, but kd.loss=forward_kl does not read it"),
    (["kd.loss=jsd", "kd.top_k=4"], "kd.top_k=4 is set, but kd.loss=jsd does not read it"),
    (["kd.alpha=0"], "kd.alpha"),
    (["kd.loss=tvd"], "kd.loss"),
])
def test_a_bad_config_exits_2(tmp_path, overrides, says):
    result = _exit(tmp_path, *overrides)
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())


def test_a_teacher_of_another_tokenizer_exits_2(tmp_path, tokenizer):
    other = tmp_path / "teacher"
    tok = build_tokenizer_with_extra_token(tokenizer)
    tok.save_pretrained(other)
    result = _exit(tmp_path, "model.path=builtin", f"kd.teacher={other}", "data.eval=null")
    assert result.exit_code == 2, result.output
    assert "its tokenizer is not the student's" in " ".join(result.output.split())


def build_tokenizer_with_extra_token(tokenizer):
    from exactrl.tasks.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens(["<extra>"])
    assert len(tok) == len(tokenizer) + 1
    return tok


def test_kd_end_to_end_on_the_builtin_task(tmp_path):
    """Student: the built-in untrained model; teacher: another one (the built-in model after 3 SFT steps, made
    here: a different distribution over the same tokenizer). Held-out accuracy before and after, with CIs."""
    from exactrl.algorithms.sft import train_sft

    sft = train_sft(load_config(SFTConfig, None, ["model.path=builtin", "data.eval=null", "train.max_steps=3",
                                                  "train.global_batch_size=8", "train.micro_batch_size=4",
                                                  f"output_dir={tmp_path / 'teacher'}"]), spec=SPEC)
    cfg = load_config(KDConfig, None, ["model.path=builtin", f"kd.teacher={sft.final_model}", "train.max_steps=2",
                                       "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every=1",
                                       "data.eval_size=10", "eval.max_new_tokens=8", f"output_dir={tmp_path / 'kd'}"])
    result = train_kd(cfg, spec=SPEC)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["canary"] == 1.0 for r in steps)
    assert all(r["kd_divergence"] > 0 for r in steps)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(len(r["eval_ci95"]) == 2 for r in evals)
    assert any("teacher_eval_accuracy" in r for r in records)
    assert (result.final_model / "config.json").exists()
