"""`exactrl eval`: a model directory, an eval set and a reward -> greedy accuracy with its Wilson
95% interval (computed as a run's own evaluation computes it, so the two agree on the same
model and settings), pass@k from n samples per prompt, and a report directory:

    results.json   every figure and the settings that produced it
    report.md      the same as a table
    samples.jsonl  per prompt: the greedy answer, its reward, the correct samples out of n (with env.*: the greedy
                   episode: each turn's text, each observation's text, the rewards; pipelines/evaluate_episodes.py)
    pairs.jsonl, unpaired.jsonl   with pass_at_k.preference: the samples as preference data (right against
                   wrong answers of one prompt; every answer labelled), for exactrl rm, dpo and kto
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from exactrl.algorithms.sft import resolve
from exactrl.audit.manifest import write_manifest
from exactrl.config.loader import ConfigError
from exactrl.config.schema_commands import EvalCommandConfig
from exactrl.data.preference import sampled_sets
from exactrl.device import use_device
from exactrl.models.loading import load_causal_lm, load_tokenizer
from exactrl.models.lora import adapter_base, is_adapter_dir, load_adapted
from exactrl.pipelines.evaluate_episodes import episode_figures, measure_episodes
from exactrl.progress import progress
from exactrl.rollout.hf import HFEngine
from exactrl.run.evaluation import correct_samples, eval_reward_spec, evaluate_accuracy, load_eval_set, pass_at_k
from exactrl.run_dir import create_run_dir
from exactrl.tasks.builtin import BuiltinSpec

BASE_KEY = "model.base=PATH"


def _load(cfg: EvalCommandConfig, path: str, device):
    """The model at ``path`` (a LoRA adapter on its base), and the directory its tokenizer is read from."""
    trust = cfg.model.trust_remote_code
    if not is_adapter_dir(path):
        return (lambda: load_causal_lm(path, trainable=False, device=device, trust_remote_code=trust)), path
    tokenizer_dir = path if (Path(path) / "tokenizer_config.json").is_file() else adapter_base(Path(
        path), cfg.model.base, BASE_KEY)
    return (lambda: load_adapted(path, cfg.model.base, BASE_KEY, device, trust)), tokenizer_dir


def run_eval(cfg: EvalCommandConfig, console: Console | None = None) -> dict:
    console = console or Console()
    if cfg.model.path is None:
        raise ConfigError("model.path: give the model to evaluate, e.g. model.path=runs/sft-20250101-120000/final")
    if cfg.model.base is not None and not is_adapter_dir(cfg.model.path):
        raise ConfigError(f"model.base={cfg.model.base}: '{cfg.model.path}' is not a LoRA adapter directory, so it has "
                          "no base to load; unset model.base")
    device = use_device(cfg.model.device, "model.device")
    spec = BuiltinSpec(**cfg.task.model_dump())  # what builtin / builtin-sft mean
    model_path, data_path = resolve(cfg.model.path, "model", spec), resolve(cfg.data.eval, "eval", spec)
    load, tokenizer_dir = _load(cfg, model_path, device)
    tok = load_tokenizer(tokenizer_dir, cfg.model.trust_remote_code, cfg.data.chat_template)
    # The data and the reward are checked before the model loads: a bad row fails in seconds.
    eval_set = load_eval_set(cfg, tok, data_path)
    try:
        if cfg.env.enabled:  # episodes: the environments start (and the template is checked) before the model loads
            from exactrl.rollout.multiturn import episode_runner

            eval_set.episodes = episode_runner(cfg.env, tok, say=lambda s: console.print(s, highlight=False))
        model = load()
        run_dir = create_run_dir(cfg.output_dir, "eval", cfg)
        write_manifest(run_dir, cfg.pass_at_k.seed, {"eval": data_path}, {"model": str(model_path)})
        measure = measure_episodes if eval_set.episodes is not None else _measure
        results = measure(cfg, model, tok, eval_set, run_dir)
    finally:
        if eval_set.episodes is not None:
            eval_set.episodes.close()
        eval_set.close()
    results |= {"model": str(model_path), "data": str(data_path), "reward": eval_reward_spec(cfg),
                "report": str(run_dir)}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = _table(results)
    (run_dir / "report.md").write_text(_markdown(results))
    console.print(table)
    console.print(f"report: {run_dir}", highlight=False, soft_wrap=True)
    return results


def _measure(cfg: EvalCommandConfig, model, tok, eval_set, run_dir: Path) -> dict:
    e, pk, prompts = cfg.eval, cfg.pass_at_k, eval_set.prompts
    rows = []
    bar = progress(len(prompts), "eval greedy", unit="prompt")

    def greedy_batch(chunk, gens, values):
        rows.extend({"prompt": p.text, "answer": p.answer, "greedy": g.text, "reward": v} for p, g, v in zip(
            chunk, gens, values))
        bar.update(len(chunk))

    acc = evaluate_accuracy(HFEngine(model, tok, e.batch_size).generate, prompts, eval_set.reward,
                            batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                            on_batch=greedy_batch)
    bar.close()
    results = {"prompts": acc.n, "greedy": {"accuracy": acc.value, "ci95": list(acc.ci95), "correct": acc.correct,
                                            "max_new_tokens": e.max_new_tokens, "seconds": round(acc.seconds, 3)},
               "pass_at_k": None}
    if pk.n:
        bar = progress(len(prompts), f"eval {pk.n} samples", unit="prompt")
        sets = {"pairs": [], "unpaired": []}

        def keep(p, samples):  # the samples as preference rows (pass_at_k.preference)
            pairs, unpaired = sampled_sets(p.text, p.answer, [(t, v >= 1.0) for t, v in samples])
            sets["pairs"] += pairs
            sets["unpaired"] += unpaired

        counts = correct_samples(model, tok, prompts, eval_set.reward, pk.n, batch_size=e.batch_size,
                                 max_new_tokens=e.max_new_tokens, temperature=pk.temperature, top_p=pk.top_p,
                                 seed=pk.seed, on_batch=lambda chunk: bar.update(len(chunk)),
                                 on_samples=keep if pk.preference else None)
        bar.close()
        for name, rows_of in sets.items() if pk.preference else ():
            with open(run_dir / f"{name}.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows_of)
            results[f"preference_{name}"] = len(rows_of)
        for row, c in zip(rows, counts):
            row["correct_samples"] = c
        results["pass_at_k"] = {"n": pk.n, "temperature": pk.temperature, "top_p": pk.top_p, "seed": pk.seed,
                                "k": {str(k): sum(pass_at_k(pk.n, c, k) for c in counts) / len(counts)
                                      for k in sorted(set(pk.k))}}
    with open(run_dir / "samples.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return results


def _figures(results: dict) -> list[tuple[str, str]]:
    if results.get("env"):
        return episode_figures(results)
    g = results["greedy"]
    out = [("greedy accuracy [95% CI]",
            f"{100 * g['accuracy']:.1f}% [{100 * g['ci95'][0]:.1f}, {100 * g['ci95'][1]:.1f}]"),
           ("correct / prompts", f"{g['correct']} / {results['prompts']}")]
    p = results["pass_at_k"]
    if p:
        out += [(f"pass@{k} (n={p['n']}, T={p['temperature']:g}, top_p={p['top_p']:g})", f"{100 * v:.1f}%")
                for k, v in p["k"].items()]
    return out


def _table(results: dict) -> Table:
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name in ("model", "data", "reward"):
        table.add_row(name, str(results[name]))
    for name, value in _figures(results):
        table.add_row(name, value)
    return table


def _markdown(results: dict) -> str:
    env = results.get("env")
    lines = ["# Evaluation", "", f"- model: `{results['model']}`",
             f"- data: `{results['data']}` ({results['prompts']} prompts)",
             f"- reward: `{results['reward']}`",
             f"- greedy decoding, up to {results['greedy']['max_new_tokens']} new tokens{' per turn' if env else ''}"]
    if env:
        lines.append(f"- episodes: `{env['source']}`, up to {env['max_turns']} turns and {env['max_tokens']} tokens "
                     "after the prompt")
    lines += ["", "| metric | value |", "|---|---|"]
    return "\n".join([*lines, *(f"| {name} | {value} |" for name, value in _figures(results))]) + "\n"
