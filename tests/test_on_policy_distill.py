"""On-policy distillation inside `exactrl rl` (exactrl/algorithms/distill.py, losses/distill_terms.py,
workers/teacher.py): the teacher's per-token fields line up with the student's tokens, each distill.loss
equals its source's formula written out in float64 (tests/dist/distill_references.py: k1 as Thinking Machines'
negative advantage through the importance ratio, the others differentiated directly), the accumulated update
is the step's whatever the split into micro-batches and ranks, and the config refuses what would do nothing.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from distill_references import BETA, LOSSES, TOPK, fresh_model, make_samples, sgd_reference, step_loss
from equivalence import relative_error

from distributed_harness import TOL, over_bound, run_cases
from exactrl.algorithms.distill import attach_teacher
from exactrl.algorithms.registry import ALGORITHMS
from exactrl.config import RLConfig, SFTConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.config.schema_distill import DistillConfig
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.distill_terms import DistillTerm, distill_term
from exactrl.losses.objective import Objective, PolicyTerm
from exactrl.models.loading import tokenizer_mismatch
from exactrl.workers.teacher import Teacher
from exactrl.workers.worker import Worker

LR = 1.0
SCRIPT = Path(__file__).parent / "dist" / "distill_equivalence.py"


def objective(loss: str) -> Objective:
    return Objective((distill_term(loss, 1.0, temperature=1.0, beta=BETA),))


def scored(tok, loss: str, teacher_model=None, shift: int = 0, topk: int = TOPK):
    """The student's samples with the teacher's fields (and the rollout's old log-probs, as the loop sets them),
    ``shift``: the teacher's fields moved that many positions later (a misaligned teacher)."""
    samples = make_samples(tok)
    teacher = Teacher("teacher", teacher_model or fresh_model(tok, seed=9), pad_id=tok.pad_token_id)
    teacher.topk = topk
    attach_teacher(samples, teacher, [[list(range(len(samples)))]], DistillConfig(teacher="t", loss=loss))
    student = Worker("policy", fresh_model(tok), pad_id=tok.pad_token_id)
    for s, old in zip(samples, student.forward(samples, "logprobs", [[list(range(len(samples)))]])):
        s.old_logprobs = old
        for name in ("teacher_logprobs", "teacher_logits", "teacher_topk_logprobs", "teacher_topk_ids"):
            v = getattr(s, name)
            if v is not None and shift:
                setattr(s, name, torch.cat([v[:shift], v[:-shift]]))
    return samples


def one_step(tok, samples, loss: str, micro: int, micro_means: bool = False):
    """(parameters after one SGD step through Worker.train_step, the step's result)."""
    cfg = load_config(SFTConfig, None, ["train.global_batch_size=7", "train.micro_batch_size=1", "optim.name=sgd",
                                        f"optim.lr={LR}", "optim.scheduler=constant", "train.max_grad_norm=0"])
    model = fresh_model(tok)
    worker = Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=tok.pad_token_id)
    plan = replace(plan_samples(samples, micro, "token-mean"), micro_means=micro_means)
    result = worker.train_step(samples, plan, objective(loss))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result


@pytest.mark.parametrize("loss", LOSSES)
def test_a_teacher_equal_to_the_student_gives_zero_and_no_gradient(tokenizer, loss):
    """Teacher = student, scored by the teacher worker in its own forward: every token's divergence is 0 and so is
    the gradient -- exactly for the sampled-token estimators, to rounding over the vocabulary's sums. (The top-k
    forward KL renormalises the teacher over its top k: 0 only when k is the whole vocabulary.)"""
    samples = scored(tokenizer, loss, teacher_model=fresh_model(tokenizer), topk=len(tokenizer))
    model = fresh_model(tokenizer)
    cfg = load_config(SFTConfig, None, ["optim.name=sgd", "train.max_grad_norm=0"])
    worker = Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=tokenizer.pad_token_id)
    plan = plan_samples(samples, 7, "token-mean")
    result = worker.train_step(samples, plan, objective(loss))
    bound = 0.0 if loss in ("k1", "k3") else 1e-13
    assert abs(result.loss) <= bound, result.loss
    assert abs(result.metrics["distill/reverse_kl_k1"]) == 0.0
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]) if any(
        p.grad is not None for p in model.parameters()) else torch.zeros(1)
    assert float(grads.abs().max()) <= bound * 10, float(grads.abs().max())


@pytest.mark.parametrize("loss", LOSSES)
def test_the_teacher_s_fields_are_its_own_forward_of_each_sample_alone(tokenizer, loss):
    """Packed, in one micro-batch, the teacher's per-token fields equal its padded forward's, position by position."""
    samples = scored(tokenizer, loss)
    teacher = fresh_model(tokenizer, seed=9)
    for s in samples:
        logits = teacher(input_ids=torch.tensor([s.ids])).logits[0, :-1].detach()
        lp = logits.log_softmax(-1)
        assert torch.allclose(s.teacher_logprobs, lp.gather(-1, torch.tensor(s.ids[1:])[:, None])[:, 0], atol=1e-12)
        if loss in ("reverse_kl", "jsd"):
            assert torch.allclose(s.teacher_logits, logits, atol=1e-12)
        if loss == "forward_kl_topk":
            top, ids = lp.topk(TOPK, -1)
            assert torch.equal(s.teacher_topk_ids, ids) and torch.allclose(s.teacher_topk_logprobs, top, atol=1e-12)


@pytest.mark.parametrize("micro", [1, 2, 7])
@pytest.mark.parametrize("loss", LOSSES)
def test_the_update_is_the_formula_s_step_whatever_the_micro_batches(tokenizer, loss, micro):
    got, result = one_step(tokenizer, scored(tokenizer, loss), loss, micro)
    ref, init, first = sgd_reference(tokenizer, make_samples(tokenizer), loss, LR)
    err = relative_error(got, ref, init)
    assert err <= TOL["float64"], err
    assert result.loss == pytest.approx(first, rel=1e-12, abs=1e-14)
    assert result.stats["canary"] == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("loss", ["k1", "reverse_kl"])
def test_a_per_micro_batch_mean_or_a_misaligned_teacher_is_another_update(tokenizer, loss):
    """What the test above catches: each micro-batch's own token mean (fault.mean_of_means, micro-batches of 2
    samples of very different lengths), and the teacher's fields one position late."""
    ref, init, _ = sgd_reference(tokenizer, make_samples(tokenizer), loss, LR)
    means, _ = one_step(tokenizer, scored(tokenizer, loss), loss, 2, micro_means=True)
    late, _ = one_step(tokenizer, scored(tokenizer, loss, shift=1), loss, 7)
    print(f"{loss}: per-micro-batch mean off by {relative_error(means, ref, init):.3g}, "
          f"misaligned teacher by {relative_error(late, ref, init):.3g}")
    assert relative_error(means, ref, init) > 1e-2
    assert relative_error(late, ref, init) > 1e-2


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"], ids=["fsdp2-world2", "deepspeed-zero2-offload-world2"])
def test_world_size_two_matches_the_formula(tmp_path, backend):
    """FSDP2 (float64) or DeepSpeed ZeRO-2 with the optimizer offloaded (fp32 master weights) over two gloo ranks of
    uneven tokens, the teacher scoring each rank's micro-batches: two SGD steps equal the one-pass reference for k1,
    forward_kl_topk and (FSDP2) jsd."""
    from old_deepspeed import ds_env

    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    result = run_cases(backend, 2, tmp_path / "out.json", ds_env() if backend == "deepspeed" else None, script=SCRIPT)
    cases = result["cases"]
    assert [c["loss"] for c in cases] == (["k1", "jsd", "forward_kl_topk"] if backend == "fsdp2" else
                                          ["k1", "forward_kl_topk"])
    assert not over_bound(cases), cases
    print(f"{backend} world 2: " + ", ".join(f"{c['loss']} {c['rel_err']:.2g} ({c['precision']})" for c in cases))
    assert all(abs(c["canary"] - 1) < 1e-12 for c in cases), cases
    assert len(set(cases[0]["tokens_per_rank"])) == 2, cases  # uneven ranks


def test_the_objective_of_each_use():
    """on_policy_distill: the distillation term alone, on the policy's sampled tokens; grpo with a teacher: its
    policy term and the distillation term, sharing the run's aggregation."""
    cfg = load_config(RLConfig, None, ["algo.name=on_policy_distill", "distill.teacher=builtin-sft",
                                       "algo.group_size=1", "train.global_batch_size=8", "train.micro_batch_size=4"])
    terms = ALGORITHMS.lookup("on_policy_distill").objective(cfg).terms
    assert [type(t) for t in terms] == [DistillTerm] and terms[0].loss == "k1"
    assert (terms[0].sources, terms[0].origins) == (("on_policy",), ("policy",))
    cfg = load_config(RLConfig, None, ["distill.teacher=builtin-sft", "distill.loss=jsd", "distill.beta=0.2",
                                       "distill.coef=0.5", "train.loss_agg=seq-mean-token-mean"])
    terms = ALGORITHMS.lookup("grpo").objective(cfg).terms
    assert [type(t) for t in terms] == [PolicyTerm, DistillTerm]
    assert (terms[1].loss, terms[1].beta, terms[1].coef, terms[1].agg) == ("jsd", 0.2, 0.5, "seq-mean-token-mean")
    assert terms[1].fields == ("logprobs", "logits")


def test_a_step_loss_of_a_stand_in_is_not_zero(tokenizer):
    """The reference itself can fail: its teacher differs from its student."""
    assert float(step_loss(fresh_model(tokenizer), fresh_model(tokenizer, seed=9), make_samples(tokenizer),
                           tokenizer.pad_token_id, "reverse_kl").detach()) > 1e-3


@pytest.mark.parametrize("overrides, key", [
    (["algo.name=on_policy_distill"], "distill.teacher"),
    (["distill.coef=2"], "distill.coef"),
    (["distill.teacher=builtin-sft", "distill.topk=4"], "distill.topk"),
    (["distill.teacher=builtin-sft", "distill.loss=k3", "distill.beta=0.1"], "distill.beta"),
    (["algo.name=on_policy_distill", "distill.teacher=builtin-sft", "algo.clip_eps=0.1"], "algo.clip_eps"),
    (["distill.teacher=builtin-sft", "distill.loss=k2"], "distill.loss"),
])
def test_the_cli_refuses_what_would_do_nothing(overrides, key):
    from typer.testing import CliRunner

    from exactrl.cli import app

    result = CliRunner().invoke(app, ["rl", *overrides])
    assert result.exit_code == 2, result.output[-2000:]
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and key in errors[0], result.output[-2000:]


def test_a_teacher_of_another_tokenizer_is_refused(tokenizer, monkeypatch):
    """Before the teacher loads: a tokenizer whose ids mean other tokens stops the run naming distill.teacher."""
    import exactrl.algorithms.distill as distill

    def like(vocab, **ids):
        base = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        return SimpleNamespace(get_vocab=lambda: vocab, **(base | ids))

    vocab = dict(tokenizer.get_vocab())
    assert tokenizer_mismatch(tokenizer, like(vocab)) is None
    renamed = {("@@" if i == 5 else tok): i for tok, i in vocab.items()}
    assert "vocabularies" in tokenizer_mismatch(tokenizer, like(renamed))
    assert "eos_token_id" in tokenizer_mismatch(tokenizer, like(vocab, eos_token_id=tokenizer.eos_token_id + 1))
    monkeypatch.setattr(distill, "load_tokenizer", lambda *a: like(renamed))
    cfg = load_config(RLConfig, None, ["distill.teacher=/some/teacher"])
    with pytest.raises(ConfigError, match=r"^distill.teacher=/some/teacher: its tokenizer is not the student's"):
        distill.build_teacher(None, cfg, tokenizer, None, {})


def moved_teacher(tmp_path: Path, spec) -> Path:
    """The built-in model with its weights moved (seeded), saved with its tokenizer: a teacher of the same
    tokenizer that differs from the student."""
    import shutil

    from transformers import AutoModelForCausalLM

    from exactrl.tasks.builtin import ensure_builtin

    init = ensure_builtin(spec).model
    teacher = AutoModelForCausalLM.from_pretrained(init)
    with torch.no_grad():
        for i, p in enumerate(teacher.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    teacher.save_pretrained(tmp_path / "teacher")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(init) / name, tmp_path / "teacher" / name)
    return tmp_path / "teacher"


RUN = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4", "algo.group_size=4",
       "train.max_steps=2", "train.log_every=1", "rollout.max_new_tokens=8", "reward.fn=reward_fixtures:varied"]


@pytest.mark.parametrize("algo, loss", [("on_policy_distill", "k1"), ("grpo", "jsd")])
def test_exactrl_rl_distils_end_to_end(tmp_path, monkeypatch, algo, loss):
    """Two steps of `exactrl rl` with a teacher (the built-in model with its weights moved, the same tokenizer):
    the canary holds, the teacher's term is in the step (for k1 alone, its first loss is the logged sampled-token
    reverse KL: the ratio is 1), the student moves."""
    import json

    from safetensors.torch import load_file

    from exactrl.algorithms.rl import train_rl
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    spec = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
    teacher = moved_teacher(tmp_path, spec)
    cfg = load_config(RLConfig, None, [*RUN, "optim.lr=1e-3", f"algo.name={algo}", f"distill.teacher={teacher}",
                                       f"distill.loss={loss}", f"output_dir={tmp_path / 'run'}"])
    result = train_rl(cfg, spec=spec)
    steps = [r for r in map(json.loads, open(result.run_dir / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["canary"] == 1.0 for r in steps)
    assert all(r["distill/reverse_kl_k1"] != 0 for r in steps)  # an estimate: a few tokens' mean can be < 0
    if algo == "on_policy_distill":
        assert steps[0]["loss"] == pytest.approx(steps[0]["distill/reverse_kl_k1"], rel=1e-6)
    init = ensure_builtin(spec).model
    before, after = load_file(Path(init) / "model.safetensors"), load_file(result.final_model / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before)


@pytest.mark.slow  # ~1-3 min: two runs and a Ray cluster; the placement of a frozen role is tests/test_ray.py's
def test_a_ray_teacher_group_trains_as_the_in_process_teacher(tmp_path, monkeypatch):
    """ray.placement=split: the teacher is an actor group of its own (beside the policy's and the engine's); the
    run ends with the in-process run's weights (SGD, fp32, as tests/test_ray.py compares placements)."""
    import ray
    from safetensors.torch import load_file

    from exactrl.algorithms.rl import train_rl
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    spec = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
    teacher = moved_teacher(tmp_path, spec)
    common = [*RUN, "algo.name=on_policy_distill", f"distill.teacher={teacher}", "distill.loss=reverse_kl",
              "optim.name=sgd", "optim.lr=0.05", "model.dtype=fp32"]
    weights = {}
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        for name, extra in (("plain", []), ("ray", ["ray.enabled=true", "ray.placement=split", "ray.ranks=1",
                                                    "ray.engines=1"])):
            out = tmp_path / name
            train_rl(load_config(RLConfig, None, [*common, *extra, f"output_dir={out}"]), spec=spec)
            weights[name] = load_file(out / "final" / "model.safetensors")
    finally:
        ray.shutdown()
    diff = max((weights["ray"][k].double() - v.double()).abs().max().item() for k, v in weights["plain"].items())
    start = load_file(ensure_builtin(spec).model / "model.safetensors")
    moved = max((weights["plain"][k] - v).abs().max().item() for k, v in start.items())
    assert diff <= 1e-5 and moved > 1e-4, (diff, moved)
