"""Issue 38's GPU paths against their references, timed: the first thing a session with a GPU runs.

usage: python scripts/gpu_paths.py [--device cuda|cpu] [--size 1b|tiny] [--out DIR]

* packed attention: the gather path, torch's varlen_attn and flex_attention (exactrl/models/
  varlen_kernels.py) on the same packed rows -- which kernel ran, forward + backward time, the
  log-probs' max |difference| and a gradient's relative difference against the gather path;
* the chunked output head (exactrl/models/head.py): train.logprob_chunk_size=2048 (64 tiny) against
  the full logits -- time, peak device memory, the same differences;
* decoding: the eager loop against the static step captured in a CUDA graph
  (exactrl/rollout/static_decode.py) -- generated tokens/s, identical tokens, log-prob difference.

``--size 1b``: a 4-layer Llama of the 1.1B model's shapes (hidden 2048, 32/8 heads, MLP 8192,
vocab 32k) and ~41k packed tokens under bf16 autocast; ``tiny`` (with ``--device cpu``, what CI
runs): hidden 64, fp32, flex uncompiled with its CPU input check lifted, no capture. Prints one
``PATH ...`` line per measurement and writes them to DIR/gpu-paths.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
import transformers

from exactrl.losses.token_losses import token_logprobs
from exactrl.models import head, packing, varlen_kernels

SIZES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=32000, lengths=(300, 960), rows=64),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=500, lengths=(5, 40), rows=12),
}


CHUNK = {"1b": 2048, "tiny": 64}  # train.logprob_chunk_size: the default, and one that splits the tiny rows


def build(size: str, device):
    s = dict(SIZES[size])
    lengths, rows = s.pop("lengths"), s.pop("rows")
    torch.manual_seed(0)
    model = packing.enable(transformers.LlamaForCausalLM(transformers.LlamaConfig(**s, tie_word_embeddings=False)))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, s["vocab_size"], (int(n),), generator=g).tolist()
            for n in torch.randint(*lengths, (rows,), generator=g)]
    return model.to(device).train(), seqs


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def autocast(device):
    return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def timed(device, fn, reps: int = 2):
    """fn() run ``reps`` times (the first a warm-up: compiles, captures); its last result, the last run's seconds."""
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
    return out, time.perf_counter() - t0


def differences(ref, got) -> dict:
    (lp0, g0), (lp1, g1) = ref, got
    return {"max_abs_logprob": (lp1 - lp0).abs().max().item(), "grad_rel": ((g1 - g0).norm() / g0.norm()).item()}


def packed_kernels(model, seqs, device) -> list[dict]:
    mb = packing.model_batch(model, seqs, 0, packed=True)
    weight = model.model.layers[0].self_attn.q_proj.weight

    def step():
        model.zero_grad()
        with autocast(device):
            lp = mb.repad(token_logprobs(model(**mb.inputs).logits, mb.inputs["input_ids"]))
        lp.sum().backward()
        return lp.detach().float(), weight.grad.clone()

    out, ref = [], None
    for kernel in ("gather", "torch_varlen", "flex"):
        packing.use_kernels(model, setting=kernel)
        before = packing.packed_kernels.copy()
        result, seconds = timed(device, step)
        ran = sorted(packing.packed_kernels - before)
        ref = result if kernel == "gather" else ref
        out.append({"path": f"packed {kernel}", "ran": ran, "seconds": seconds} | differences(ref, result))
    packing.use_kernels(model, setting="auto")
    return out


def chunked_head(model, seqs, device, size: int) -> list[dict]:
    mb = packing.model_batch(model, seqs, 0, packed=True)
    ids, weight = mb.inputs["input_ids"], model.lm_head.weight

    def step(chunk):
        model.zero_grad()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with autocast(device), head.per_token_head(model, ids, ("logprobs",), chunk=chunk):
            lp = mb.repad(model(**mb.inputs).logits[..., 0])
        lp.sum().backward()
        return lp.detach(), weight.grad.clone()

    out, ref = [], None
    for chunk in (0, size):
        result, seconds = timed(device, lambda chunk=chunk: step(chunk))
        ref = result if chunk == 0 else ref
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        out.append({"path": f"head chunk={chunk}", "seconds": seconds, "peak_gb": peak} | differences(ref, result))
    return out


def decoding(device) -> list[dict]:
    from exactrl.rollout.hf import sample
    from exactrl.rollout.static_decode import use_static
    from exactrl.tasks.tiny_model import build_tiny_model
    from exactrl.tasks.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id).to(device).eval()
    g = torch.Generator().manual_seed(0)
    rows, new = (128, 256) if device.type == "cuda" else (8, 16)
    ids = torch.randint(3, len(tok), (rows, 32), generator=g).to(device)
    runs = {}
    for mode in ("eager", "graphs"):
        use_static(model, mode == "graphs")
        (tokens, logps), seconds = timed(device, lambda: sample(
            model, ids, torch.ones_like(ids), max_new_tokens=new, eos=tok.eos_token_id, pad=tok.pad_token_id,
            seeds=list(range(rows))))
        runs[mode] = (tokens, logps, (tokens != tok.pad_token_id).sum().item() / seconds)
    (t0, l0, r0), (t1, l1, r1) = runs["eager"], runs["graphs"]
    return [{"path": "decode eager", "tokens_per_s": r0},
            {"path": "decode graphs", "tokens_per_s": r1, "same_tokens": torch.equal(t0, t1),
             "max_abs_logprob": (l0 - l1).abs().max().item(), "ratio": r1 / r0}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=SIZES, default=None, help="1b on CUDA, tiny on the CPU by default")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    device = torch.device(a.device)
    size = a.size or ("1b" if device.type == "cuda" else "tiny")
    if device.type == "cpu":  # flex uncompiled; torch refuses its backward on the CPU in an input check only
        from torch.nn.attention import flex_attention as torch_flex

        varlen_kernels.FLEX_ON_CPU = True
        torch_flex._validate_device = lambda *args: None
    model, seqs = build(size, device)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"size {size}, {sum(map(len, seqs))} packed tokens in {len(seqs)} rows", flush=True)
    results = []
    for part in (lambda: packed_kernels(model, seqs, device), lambda: chunked_head(model, seqs, device, CHUNK[size]),
                 lambda: decoding(device)):
        try:
            rows = part()
        except Exception as e:  # one path failing is a result; the others still run
            rows = [{"path": "error", "error": f"{type(e).__name__}: {e}"[:500]}]
        for r in rows:
            print("PATH " + json.dumps(r), flush=True)
        results += rows
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-paths.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
