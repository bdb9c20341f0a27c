"""Supervised fine-tuning: next-token loss on completion tokens, exact gradient accumulation.

Per optimizer step:
  1. the sampler draws the global batch (independent of micro-batch size);
  2. the step plan counts its loss tokens and fixes the normaliser before any backward;
  3. each micro-batch backpropagates its exact share of the step loss (the objective: one NLL term);
  4. the worker checks every sample and loss token was seen once; the engine clips the full gradient and steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from exactrl.algorithms.common import check_data_size, check_world, steps_for
from exactrl.algorithms.resume import SFTPosition, prepare_resume
from exactrl.compute import FlopsCounter, count_parameters
from exactrl.config.aggregation import norm_len as loss_agg_norm
from exactrl.config.schema import SFTConfig
from exactrl.config.schema_commands import DemoConfig
from exactrl.data.batch import Sample
from exactrl.data.batching import StepSampler
from exactrl.data.encode import SFTExample, load_sft
from exactrl.distributed.checkpoint import resume
from exactrl.distributed.launch import is_main
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.objective import NLLTerm, Objective
from exactrl.models.loading import load_tokenizer
from exactrl.run.context import RunContext
from exactrl.run.evaluation import eval_data, load_eval_set
from exactrl.run_dir import LAUNCH_DIR
from exactrl.seeding import seed_everything
from exactrl.tasks import builtin
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.workers.load import check_generator
from exactrl.workers.worker import Worker


@dataclass
class SFTResult:
    run_dir: Path
    final_model: Path
    steps: int
    seconds: float
    trained_tokens: int
    compute: dict  # exactrl/compute.py: FLOPs of the whole phase (a resumed one included)


def demonstration(e: SFTExample) -> Sample:
    """An SFT example as a sample of the typed batch: its loss mask is the example's, on the targets."""
    return Sample([], e.input_ids, source="demonstration", mask=tuple(e.loss_mask[1:]))


def sft_objective(loss_agg: str, norm_len: float | None) -> Objective:
    """SFT's loss: the NLL of the completion tokens under the step's one normaliser."""
    return Objective((NLLTerm(agg=loss_agg, norm_len=norm_len),))


def train_sft(cfg: SFTConfig, run_dir: Path | None = None, spec: BuiltinSpec = BuiltinSpec(), phase: str = "sft",
              final_name: str = "final") -> SFTResult:
    check_world(cfg)
    seed_everything(cfg.train.seed)
    t = cfg.train
    model_path = resolve(cfg.model.path, "model", spec)
    train_path, eval_path = resolve(cfg.data.train, "sft_train", spec), resolve(eval_data(cfg), "eval", spec)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.data.chat_template)
    # All data is read and checked before the model loads: a bad row fails in seconds.
    examples, note = load_sft(train_path, tok, cfg.data)
    if note and is_main():
        print(note)
    eval_set = load_eval_set(cfg, tok, eval_path)
    steps = steps_for(t, len(examples), t.global_batch_size)
    check_data_size(len(examples), t.global_batch_size, "samples", train_path)
    continues = prepare_resume(cfg, "sft", steps)
    ctx = RunContext(cfg, "sft", phase, run_dir, {"train": train_path, "eval": eval_path}, tok, eval_set, continues)
    policy = Worker.build(cfg, "policy", model_path, run_dir=ctx.run_dir, phase=phase, longest=cfg.data.max_length,
                          pad_id=tok.pad_token_id, total_steps=steps, checkpoint=t.resume_from)
    model = policy.model
    position = SFTPosition.load(resume(t.resume_from, {"policy": policy}) if t.resume_from else {"step": 0})
    start, flops = position.step, FlopsCounter(count_parameters(model))
    flops.load(position.state())
    if eval_set is not None:  # evaluations decode greedily: checked before training, not after it (and after the
        # resume: FSDP2 leaves a forward-only call's root parameters unsharded, against which no state loads)
        check_generator(cfg, model, tok, ctx.run_dir, phase, sampled=False, synced=policy.engine.synced_decoding)
    sampler = StepSampler(len(examples), t.global_batch_size, t.seed)
    norm_len = loss_agg_norm(cfg)
    objective, samples = sft_objective(t.loss_agg, norm_len), [demonstration(e) for e in examples]

    trained_tokens, t0 = 0, time.perf_counter()
    ctx.start(steps, start)
    for step in range(start + 1, steps + 1):
        # the step's global batch (independent of micro-batch size and ranks), planned, then one verified step
        batch = [samples[i] for i in sampler.batch(step - 1)]
        plan = plan_samples(batch, t.micro_batch_size, t.loss_agg, norm_len, policy.engine.world_size, sort=True)
        result = policy.train_step(batch, plan, objective)
        trained_tokens += sum(len(s.ids) for s in batch)
        flops.trained(batch)
        if ctx.logs(step):
            ctx.write(step, {"loss": result.loss, "epoch": sampler.epoch_of(step),
                             "tokens_per_s": trained_tokens / (time.perf_counter() - t0),
                             "loss_tokens": plan.normalizer.num_tokens, **result.stats, **flops.record(),
                             "wall_seconds": time.perf_counter() - t0})
        ctx.step_done(step, {"policy": policy}, SFTPosition(step, **flops.state()).state(),
                      {"loss": f"{result.loss:.4f}"})
    seconds = time.perf_counter() - t0
    final = ctx.finish({final_name: policy})
    return SFTResult(ctx.run_dir, final, steps, seconds, trained_tokens, flops.record())


# The built-in names of model.path: 'builtin' (exactrl/tasks/builtin.py) and 'builtin-sft', the
# built-in model after the demo's SFT phase, which takes this trainer to build.

def ensure_builtin_sft(spec: BuiltinSpec = BuiltinSpec(), cache: Path | None = None) -> Path:
    """The built-in model after the demo's SFT phase: the starting point of RL examples (built once)."""
    root = ensure_builtin(spec, cache).root
    final = root / "sft-model"
    if (final / "config.json").exists():
        return final
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank under torchrun: build it in a process of its own
        return _build_sft_elsewhere(spec, root)
    with FileLock(root / ".sft-lock"):
        if (final / "config.json").exists():
            return final
        print(f"building the built-in SFT starting point once, into {final} (a few minutes) ...")
        cfg = DemoConfig().sft.model_copy(update={"output_dir": str(root / f".sft-run-{os.getpid()}")})
        result = train_sft(cfg, spec=spec)
        os.replace(result.final_model, final)
    return final


def _build_sft_elsewhere(spec: BuiltinSpec, root: Path) -> Path:
    """Build the SFT starting point in a one-process child (the SFT run must not join this
    rank's process group, nor tell exactrl's launcher its run directory); every rank waits for it on the
    same file lock."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR",
                                                            "MASTER_PORT", "GROUP_RANK", "ROLE_RANK",
                                                            "TORCHELASTIC_RUN_ID",
                                                            LAUNCH_DIR)}
    env["EXACTRL_CACHE"] = str(root.parent)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per rank; the one builder may use every core
    code = ("from exactrl.algorithms.sft import ensure_builtin_sft; from exactrl.tasks.builtin import BuiltinSpec; "
            f"ensure_builtin_sft(BuiltinSpec(**{asdict(spec)!r}))")
    if subprocess.run([sys.executable, "-c", code], env=env).returncode != 0:
        raise RuntimeError(f"building the built-in SFT model into {root / 'sft-model'} failed (see the output above)")
    return root / "sft-model"


def resolve(path: str | None, kind: str, spec: BuiltinSpec = BuiltinSpec()) -> str | None:
    """'builtin-sft' in model.path -> the built-in model after SFT (built once); else as
    exactrl.tasks.builtin.resolve."""
    if path == "builtin-sft" and kind == "model":
        return str(ensure_builtin_sft(spec))
    return builtin.resolve(path, kind, spec)
