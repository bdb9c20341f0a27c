"""The calculator task's first policy turn, measured with the model's own Hugging Face ``generate``: how often it
is a well-formed tool call, and how often the turns without one answer right, greedy and sampled at T=1, with
Wilson 95% intervals. Then, for the calls, the tool's result shown (calc run here, the chat template rendering the
conversation) and a second turn drawn the same way: the whole two-turn episode's accuracy, the reward RL starts
from. No environment of exactrl's runs here.

    .venv/bin/python scripts/calculator_first_turn.py                 # builtin-sft of task calculator (built once)
    .venv/bin/python scripts/calculator_first_turn.py --model DIR --n 500
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exactrl.run.evaluation import wilson_interval
from exactrl.tasks.arithmetic import is_correct
from exactrl.tasks.calculator_tools import calc

CALL_RE = re.compile(r"<tool_call>(.*)</tool_call>", re.DOTALL)


def is_tool_call(text: str) -> bool:
    """The turn is one Hermes-style call of calc with a string expr, and nothing else."""
    m = CALL_RE.fullmatch(text.strip())
    if not m:
        return False
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return False
    args = call.get("arguments") if isinstance(call, dict) else None
    return call.get("name") == "calc" and isinstance(args, dict) and set(args) == {"expr"} and isinstance(
        args["expr"], str)


def tool_result(call: str) -> str:
    try:
        return calc(json.loads(CALL_RE.fullmatch(call.strip()).group(1))["arguments"]["expr"])
    except ValueError as e:
        return f"error: {e}"


def turns(model, tok, prompts: list[str], sampled: bool, batch: int, max_new_tokens: int) -> list[str]:
    out = []
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id, **kw)
        for row in ids[:, enc["input_ids"].shape[1] :].tolist():
            row = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
            out.append(tok.decode(row, skip_special_tokens=True))
    return out


def rate(k: int, n: int) -> str:
    lo, hi = wilson_interval(k, n)
    return f"{100 * k / max(n, 1):.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] ({k}/{n})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: builtin-sft of task calculator)")
    ap.add_argument("--n", type=int, default=2000, help="held-out problems (the first n)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=250)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="a tool call is 74 tokens with its <eos>")
    args = ap.parse_args()
    from exactrl.algorithms.sft import ensure_builtin_sft
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    spec = BuiltinSpec(name="calculator")
    model_dir = args.model or str(ensure_builtin_sft(spec))
    rows = [json.loads(line) for line in open(ensure_builtin(spec).eval)][: args.n]
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    torch.manual_seed(args.seed)
    print(f"model {model_dir}, {len(rows)} held-out problems")
    for sampled in (False, True):
        first = turns(model, tok, prompts, sampled, args.batch, args.max_new_tokens)
        calls = [is_tool_call(t) for t in first]
        plain = [(t, r["answer"]) for t, r, c in zip(first, rows, calls) if not c]
        right = sum(is_correct(t, a) for t, a in plain)
        called = [(r, t) for t, r, c in zip(first, rows, calls) if c]
        chats = [r["prompt"] + [{"role": "assistant", "content": t}, {"role": "tool", "content": tool_result(t)}]
                 for r, t in called]
        second = turns(model, tok, [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                                    for c in chats], sampled, args.batch, args.max_new_tokens)
        after = sum(is_correct(t, r["answer"]) for t, (r, _) in zip(second, called))
        print(f"{'sampled T=1' if sampled else 'greedy':>11}: tool-call rate {rate(sum(calls), len(first))}; "
              f"one-turn accuracy without a call {rate(right, len(plain))}; after a call {rate(after, len(called))}; "
              f"episode accuracy {rate(right + after, len(rows))}; "
              f"malformed tool-call text {sum('<tool_call>' in t for t, _ in plain)}")


if __name__ == "__main__":
    main()
