"""Equivalence cases for one backend, run by tests/test_fsdp2.py and tests/test_deepspeed.py
(under torchrun for world size 2, or as one process); writes one JSON result file.

usage: python equivalence.py {fsdp2,deepspeed} WORLD OUT.json

For each case: two optimizer steps of SFT through the real path (plan_step, each rank its part,
sft_micro_batch_loss, the backend's engine) from the same initial model, then the full
parameters are compared on rank 0 with an independent single-process reference: one
padded forward per step over the whole global batch, the loss written out by its
definition, plain torch SGD or AdamW. One process group serves every case.

Both sides train a float64 model wherever the layout allows it (``precision``): the comparison
then measures the layout's accumulation, not fp32 rounding, whose summation order differs
between CPUs (AVX2 and AVX-512 kernels) and which two SGD steps can amplify past 1e-5.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

from exactrl.checks.canary import CanaryError
from exactrl.config import SFTConfig, load_config
from exactrl.data.encode import encode_sft
from exactrl.data.jsonl import Row
from exactrl.distributed.deepspeed_engine import ds_config
from exactrl.distributed.engine import build_engine
from exactrl.distributed.launch import end_rank, shutdown
from exactrl.distributed.step_plan import plan_step
from exactrl.distributed import compile as compile_mod
from exactrl.tasks.arithmetic import Problem, worked_solution
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.tasks.tokenizer import build_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from rl_helpers import sft_micro_batch_loss

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
COMPLETIONS = ["1", "#### 15", worked_solution(Problem(347, 285)), "ab", worked_solution(Problem(123456, 654321)),
               "#### 10", "x" * 40, worked_solution(Problem(7, 8))]
NORM_LEN = 64.0


def precision(cfg) -> str:
    """What the layout of ``cfg`` computes its update in; each has its bound (distributed_harness.TOL)."""
    if cfg.distributed.backend != "deepspeed":
        return "float64"
    # ZeRO-0 all-reduces gradients only in its accelerator's dtypes (fp32, bf16, fp16). ZeRO 1-3 accumulate a float64
    # model's gradients in float64, then step fp32 master copies of the weights (DeepSpeed's stage_1_and_2.py and
    # stage3.py), rounding each update once, in the same way on every CPU.
    return "float32" if ds_config(cfg, 1)["zero_optimization"]["stage"] == 0 else "fp32 master weights"


def dtype_of(cfg) -> torch.dtype:
    return torch.float32 if precision(cfg) == "float32" else torch.float64


def _rms_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def in_dtype(model, dtype: torch.dtype):
    """``model`` in ``dtype``. In float64 its RMSNorms compute in float64 too: Hugging Face's computes in fp32 whatever
    its input (to upcast half precision), which would round every normalised activation and its gradient to fp32."""
    if dtype == torch.float64:
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.forward = types.MethodType(_rms_norm, m)
    return model.to(dtype)


def definition_loss(logits, ids, mask, mode):
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    seq = (nll * mask).sum(1)
    n = mask.sum(1)
    return {"token-mean": seq.sum() / mask.sum(), "seq-mean-token-mean": (seq / n).mean(),
            "seq-mean-token-sum": seq.mean(), "seq-mean-token-sum-norm": seq.sum() / (len(seq) * NORM_LEN)}[mode]


def reference(model, steps, tok, mode, optim, eps=1e-8, lr=None):
    opt = (torch.optim.SGD(model.parameters(), lr=lr or 0.5) if optim == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr or 1e-2, eps=eps, weight_decay=0.0))
    for exs in steps:
        width = max(len(e.input_ids) for e in exs)
        ids = torch.tensor([e.input_ids + [tok.pad_token_id] * (width - len(e.input_ids)) for e in exs])
        attn = torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids)) for e in exs])
        mask = torch.tensor([e.loss_mask + [0] * (width - len(e.loss_mask)) for e in exs])[:, 1:].to(model.dtype)
        opt.zero_grad()
        definition_loss(model(input_ids=ids, attention_mask=attn).logits, ids, mask, mode).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def exactrl_run(model, steps, tok, cfg, fault=None):
    """Two optimizer steps through the real path. ``fault`` injects what a backend bug does:
    ``drop`` loses micro-batch 1's gradient on every rank, ``duplicate`` accumulates micro-batch
    0's twice (both by scaling that micro-batch's whole contribution, canary term included, by
    0 or 2 -- the gradient a lost or doubled accumulation leaves), ``rank_local_normalizer``
    normalises each micro-batch by its own tokens (the mean-of-means bug)."""
    engine = build_engine(model, cfg, total_steps=len(steps))
    t = cfg.train
    for exs in steps:
        plan = plan_step([e.loss_tokens for e in exs], t.micro_batch_size, t.loss_agg, NORM_LEN,
                         lengths=[len(e.input_ids) for e in exs], world_size=engine.world_size)
        mine = plan.for_rank(engine.rank)
        engine.begin_step(len(mine.micro_batches))
        for i, mb in enumerate(mine.micro_batches):
            batch = [exs[j] for j in mb]
            norm = plan.normalizer
            if fault == "rank_local_normalizer":
                norm = plan_step([e.loss_tokens for e in batch], len(batch), t.loss_agg, NORM_LEN).normalizer
            loss, share = sft_micro_batch_loss(model, engine, batch, tok.pad_token_id, norm)
            scale = {("drop", 1): 0.0, ("duplicate", 0): 2.0}.get((fault, i), 1.0)
            engine.backward(loss * scale, share * scale, len(mb))
        engine.step(mine)
    return full_state(engine, model)


def relative_error(got: dict, ref: dict, init: dict) -> float:
    """|got - ref| / |ref - init| over all parameters as one vector: the error relative to the update."""
    num = sum(((got[k].double() - ref[k].double()).norm() ** 2).item() for k in ref)
    den = sum(((ref[k].double() - init[k].double()).norm() ** 2).item() for k in ref)
    return (num / den) ** 0.5


def full_state(engine, model) -> dict:
    if engine.backend == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if engine.backend == "deepspeed" and engine.stage == 3:
        state = engine.ds._zero3_consolidated_16bit_state_dict() or {}
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ZERO2_CPU = ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=cpu"]
# A user's own DeepSpeed JSON, as Hugging Face and OpenRLHF users write them ("auto" batch
# sizes), with buckets small enough that every step reduces in several pieces.
USER_JSON = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                                   "contiguous_gradients": True, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000}}
FAULTS = ("drop", "duplicate", "rank_local_normalizer")


def cases(backend: str, world: int) -> list[dict]:
    """One dict per case. K = batch / (micro x world) micro-batches per rank: K in {1, 2, 4}
    (and 8 at world size 1) from a batch of 8, K = 3 from a batch of 6."""
    micros = [m for m in (4, 2, 1) if 8 % (m * world) == 0] if world == 2 else [8, 4, 2, 1]
    k3 = dict(mode="token-mean", micro=2 // world, optim="sgd", batch=6)
    # AdamW at torch's default eps and at eps=1e-6: Adam divides each gradient element by its own
    # magnitude, which magnifies rounding on the smallest elements (see tests/test_fsdp2.py).
    adamw = [dict(mode="token-mean", micro=2, optim="adamw", eps=eps) for eps in (1e-8, 1e-6)]
    if backend == "fsdp2":
        out = [dict(mode=m, micro=mi, optim="sgd", extra=[]) for m in MODES for mi in micros]
        # Recomputed activations must not change the update (FSDP2's CPU offload needs a GPU: make gpu-check).
        knobs = [dict(mode="token-mean", micro=2 // world, optim="sgd", extra=[x]) for x in
                 ["train.gradient_checkpointing=true"] + (["distributed.fsdp_cpu_offload=true"] if os.environ.get("EXACTRL_TEST_DEVICE") == "cuda" else [])]
        # The output head in chunks of 3 tokens (exactrl/models/head.py), alone and with recomputed layers.
        chunked = [dict(mode="token-mean", micro=2 // world, optim="sgd", extra=x) for x in (
            ["train.logprob_chunk_size=3"], ["train.logprob_chunk_size=3", "train.gradient_checkpointing=true"])]
        # Decoder layers compiled after fully_shard (distributed/compile.py; aot_eager, set in main), alone and
        # around recomputed layers.
        compiled = [dict(mode="token-mean", micro=2 // world, optim="sgd", extra=x) for x in (
            ["train.compile=true"], ["train.compile=true", "train.gradient_checkpointing=true"])]
        return out + [dict(k3, extra=[])] + [dict(a, extra=[]) for a in adamw] + knobs + chunked + compiled
    out = []
    for stage in (0, 1, 2, 3):
        for offload in (("none", "cpu") if stage else ("none",)):
            extra = [f"deepspeed.zero_stage={stage}", f"deepspeed.offload_optimizer={offload}"]
            out += [dict(mode="token-mean", micro=mi, optim="sgd", extra=extra) for mi in micros] + [dict(k3, extra=extra)]
    out += [dict(mode="token-mean", micro=mi, optim="sgd", extra=["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu",
                                                                   "deepspeed.offload_param=cpu"]) for mi in micros[1:]]
    out += [dict(mode=m, micro=2, optim="sgd", extra=ZERO2_CPU) for m in MODES[1:]]
    # The output head in chunks of 3 tokens, its weight gathered by ZeRO-3 for forward and backward.
    out += [dict(mode="token-mean", micro=2, optim="sgd", extra=[f"deepspeed.zero_stage={stage}",
                                                                 "train.logprob_chunk_size=3"]) for stage in (2, 3)]
    out += [dict(mode="token-mean", micro=mi, optim="sgd", extra=["deepspeed.config=USER_JSON"]) for mi in micros[1:]]
    return out + [dict(a, extra=x) for a in adamw for x in (ZERO2_CPU, ["deepspeed.zero_stage=3"])]


def select(items: list, stages: str | None) -> list:
    """The cases (dicts with "extra") or fault layouts (lists of overrides) whose ZeRO stage is one of ``stages``."""
    if stages is None:
        return items
    wanted = {f"deepspeed.zero_stage={s}" for s in stages.split(",")}
    return [i for i in items if wanted & set(i["extra"] if isinstance(i, dict) else i)]


def fault_layouts(backend: str) -> list[list[str]]:
    if backend == "fsdp2":
        return [[]]
    return [["deepspeed.zero_stage=0"], ["deepspeed.zero_stage=1", "deepspeed.offload_optimizer=cpu"], ZERO2_CPU,
            ["deepspeed.zero_stage=3"], ["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"]]


def simulate_fp16_accelerator() -> None:
    """What DeepSpeed's CPU accelerator reports where oneDNN has fp16 (Intel Sapphire Rapids: AVX512-FP16, AMX) and
    what every CUDA accelerator reports: fp16 supported. DeepSpeed takes other branches there (zero.Init's dtype)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True


def main(backend: str, world: int, out_path: str) -> None:
    if os.environ.get("EXACTRL_TEST_FP16_ACCELERATOR") == "1":
        simulate_fp16_accelerator()
    stages = os.environ.get("EXACTRL_TEST_ZERO_STAGES")  # e.g. "3": only the cases and faults of those stages
    compile_mod.BACKEND = "aot_eager"  # Dynamo's capture, AOT autograd; inductor's: tests/test_compile.py -m slow
    tok = build_tokenizer()
    rows = [Row(f"t:{i}", {"prompt": f"{i}+{i}=", "completion": c}) for i, c in enumerate(COMPLETIONS)]
    exs = encode_sft(rows, tok, 256)
    fresh = lambda dtype: in_dtype(  # noqa: E731
        build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=3, **SMALL), dtype)
    # EXACTRL_TEST_DEVICE=cuda: the backend runs on GPUs over NCCL (tests/test_gpu.py); the reference stays on the CPU.
    layout = [f"distributed.backend={backend}", f"distributed.nproc_per_node={world}",
              f"distributed.device={os.environ.get('EXACTRL_TEST_DEVICE', 'auto')}"]
    user_json = Path(out_path).with_name("user_ds_config.json")
    user_json.write_text(json.dumps(USER_JSON))
    results = []
    for case in select(cases(backend, world), stages):
        n = case.get("batch", 8)
        steps = [exs[:n], exs[:n][::-1]]
        extra = [e.replace("USER_JSON", str(user_json)) for e in case["extra"]]
        cfg = load_config(SFTConfig, None, [*layout, *extra, f"train.loss_agg={case['mode']}", f"train.global_batch_size={n}",
                                            f"train.micro_batch_size={case['micro']}", "train.max_grad_norm=0", f"optim.name={case['optim']}",
                                            f"optim.lr={0.5 if case['optim'] == 'sgd' else 1e-2}", "optim.scheduler=constant",
                                            f"optim.eps={case.get('eps', 1e-8)}"])
        dtype = dtype_of(cfg)
        got = exactrl_run(fresh(dtype), steps, tok, cfg)
        if dist.get_rank() == 0:
            ref = reference(fresh(dtype), steps, tok, case["mode"], case["optim"], case.get("eps", 1e-8))
            results.append({**{k: v for k, v in case.items() if k != "extra"}, "config": " ".join(case["extra"]),
                            "K": n // (case["micro"] * world), "precision": precision(cfg),
                            "rel_err": relative_error(got, ref, fresh(dtype).state_dict())})
    faults = []
    for extra in select(fault_layouts(backend), stages):
        for fault in FAULTS:
            cfg = load_config(SFTConfig, None, [*layout, *extra, "train.global_batch_size=8", "train.micro_batch_size=2", "optim.name=sgd"])
            try:
                exactrl_run(fresh(dtype_of(cfg)), [exs, exs], tok, cfg, fault=fault)
                message = "not raised"
            except CanaryError as e:
                message = str(e)
            faults.append({"config": " ".join(extra), "fault": fault, "message": message})
    if dist.get_rank() == 0:
        json.dump({"cases": results, "faults": faults}, open(out_path, "w"))
    shutdown()
    end_rank()


def rank0() -> bool:
    """Whether this is rank 0 (torchrun's RANK: known before the first engine starts the process group too)."""
    return int(os.environ.get("RANK", "0")) == 0


def finish(out_path: str, cases: list, peers) -> None:
    """Rank 0 writes a layout script's results ({"cases", "peers"}); every rank then ends as exactrl's commands do."""
    if rank0():
        with open(out_path, "w") as f:
            json.dump({"cases": cases, "peers": peers}, f)
    shutdown()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

