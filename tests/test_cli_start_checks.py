"""What a new user hit (issue 34, round 3), through the real entry point: a vLLM engine's interpreter
and a reward server are checked before anything starts (no run directory, no model loaded), an
engine that fails later is one line too, and the small ones -- a model without tokenizer files,
JSON errors, RL keys given to sft, resuming a finished run or a missing checkpoint, a note before a
data error -- each end in one line naming the key, file or path."""

from __future__ import annotations

import json
import shutil
import socket
import stat
import sys

import pytest

from conftest import SMALL
from test_cli_failures import exactrl, one_line_error

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "completion": str(a + b)} for a in range(10, 18) for b in (3, 4)]


def script(path, body: str):
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from exactrl.tasks.tiny_model import save_tiny_model
    from exactrl.tasks.tokenizer import save_tokenizer

    root = tmp_path_factory.mktemp("start_checks")
    save_tiny_model(root / "model", save_tokenizer(root / "model"), seed=0, **SMALL)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # Pythons an engine could be given: one without site-packages (so without vllm, wherever the suite runs), and
    # ones whose 'vllm' is found but breaks at import (raises; kills its process).
    script(root / "no-vllm-python", f'exec "{sys.executable}" -S -I "$@"')
    for how, body in {"raises": "raise ImportError('libcudart.so.12: cannot open shared object file')",
                      "exits": "import os, sys\nprint('vLLM needs a newer CUDA driver', file=sys.stderr, flush=True)"
                               "\nos._exit(7)"}.items():
        (root / how / "vllm").mkdir(parents=True)
        (root / how / "vllm" / "__init__.py").write_text(body + "\n")
        script(root / f"vllm-{how}-python", f'PYTHONPATH="{root / how}:$PYTHONPATH" exec "{sys.executable}" "$@"')
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def rl(files, out, *extra) -> list[str]:
    return ["rl", f"model.path={files / 'model'}", f"data.train={files / 'train.jsonl'}", "data.eval=null",
            "train.max_steps=1", "train.global_batch_size=4", "train.micro_batch_size=4", "algo.group_size=2",
            "rollout.max_new_tokens=4", f"output_dir={out}", *extra]


def sft(files, out, *extra) -> list[str]:
    return ["sft", f"model.path={files / 'model'}", f"data.train={files / 'train.jsonl'}", "train.max_steps=2",
            "train.global_batch_size=4", "train.micro_batch_size=4", f"output_dir={out}", *extra]


def free_port() -> int:
    """A port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- checked before anything starts


@pytest.mark.parametrize("python,said", [
    (None, "rollout.engine=vllm with rollout.vllm.python unset (this Python): '{py}' has no vllm module; "
           "on CPU, `make vllm` builds .venv-vllm: then set rollout.vllm.python=.venv-vllm/bin/python"),
    ("/nope/bin/python", "rollout.vllm.python=/nope/bin/python: '/nope/bin/python' does not exist; on CPU"),
    ("{root}", "rollout.vllm.python={root}: '{root}' is a directory, not a Python interpreter (give its bin/python)"),
    ("{root}/train.jsonl", "rollout.vllm.python={root}/train.jsonl: '{root}/train.jsonl' is not executable"),
    ("{root}/no-vllm-python", "rollout.vllm.python={root}/no-vllm-python: '{root}/no-vllm-python' has no vllm module"),
    ("{root}/not-python", "'{root}/not-python' does not run as a Python (exit code 5: no such thing here)"),
], ids=["unset", "missing", "directory", "not-executable", "without-vllm", "not-python"])
def test_a_vllm_engine_without_vllm_is_refused_before_anything_starts(files, cache, tmp_path, monkeypatch, python,
                                                                       said):
    script(files / "not-python", "echo 'no such thing here' >&2; exit 5")
    if python is None:  # this interpreter is the engine's: one without vllm, wherever the suite runs
        monkeypatch.setattr(sys, "executable", str(files / "no-vllm-python"))
    extra = ["rollout.engine=vllm"] + ([f"rollout.vllm.python={python.format(root=files)}"] if python else [])
    line = one_line_error(exactrl(rl(files, tmp_path / "run", *extra), tmp_path, cache), 2)
    assert said.format(root=files, py=files / "no-vllm-python") in line, line
    assert not (tmp_path / "run").exists()  # nothing made, no model loaded


def test_a_pipelines_vllm_engine_is_checked_under_its_own_key(files, cache, tmp_path):
    args = ["pipeline", f"sft.model.path={files / 'model'}", "rl.rollout.engine=vllm",
            "rl.rollout.vllm.python=/nope/bin/python", f"output_dir={tmp_path / 'run'}"]
    line = one_line_error(exactrl(args, tmp_path, cache), 2)
    assert line.startswith("error: rl.rollout.vllm.python=/nope/bin/python: '/nope/bin/python' does not exist; on "
                           "CPU, `make vllm` builds .venv-vllm: then set rl.rollout.vllm.python=.venv-vllm/bin/python")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,key,extra", [
    ("rl", "reward.url", ["reward.url={url}"]),
    ("rl", "reward.fn", ["reward.fn=[exactrl.tasks.arithmetic:reward,{url}]"]),
    ("sft", "eval.reward_fn", ["eval.reward_fn={url}", "data.eval={root}/train.jsonl"]),
])
def test_a_reward_server_that_is_not_there_is_refused_before_anything_starts(files, cache, tmp_path, command, key,
                                                                              extra):
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    make = rl if command == "rl" else sft
    line = one_line_error(exactrl(make(files, tmp_path / "run", *[e.format(url=url, root=files) for e in extra]),
                                  tmp_path, cache), 2)
    assert line == (f"error: {key}={url}: no reward server answers at 127.0.0.1:{port} (Connection refused); start "
                    f"it (e.g. python -m exactrl.rewards.server MODULE:FUNCTION --port {port}) or fix {key}")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- an engine that fails once started


@pytest.mark.parametrize("how,said", [
    ("raises", r"vllm engine 0: start failed in the engine: ImportError: libcudart.so.12: cannot open shared object "
               r"file \(traceback in .*vllm-engine-0-\d+-\d+.log\)"),
    ("exits", r"vllm engine 0 died \(exit code 7\) during start, [\d.]+ s in; its log .*vllm-engine-0-\d+-\d+.log "
              r"ends: vLLM needs a newer CUDA driver"),
])
def test_a_vllm_that_does_not_start_is_one_line(files, cache, tmp_path, how, said):
    """vllm is there (the start check passes) but does not import: the engine's failure, in one line."""
    import re

    out = tmp_path / "run"
    line = one_line_error(exactrl(rl(files, out, "rollout.engine=vllm",
                                     f"rollout.vllm.python={files / f'vllm-{how}-python'}"), tmp_path, cache), 2)
    assert re.fullmatch("error: " + said, line), line
    assert json.loads((out / "status.json").read_text())["state"] == "error"


def test_an_engine_that_dies_mid_run_is_one_line_and_exit_1(files, cache, tmp_path, monkeypatch):
    from exactrl.rollout.generator import GeneratorError
    from exactrl.workers import placement

    def dies(*args, **kwargs):
        raise GeneratorError("vllm engine 0 (pid 123) died (exit code -9) during generate, 2.0 s in; its log x ends: "
                             "Killed")

    monkeypatch.setattr(placement, "vllm_generator", dies)
    out = tmp_path / "run"
    proc = exactrl(rl(files, out, "rollout.engine=vllm", f"rollout.vllm.python={files / 'vllm-raises-python'}"),
                   tmp_path, cache)
    assert one_line_error(proc, 1) == ("error: vllm engine 0 (pid 123) died (exit code -9) during generate, 2.0 s "
                                       "in; its log x ends: Killed")
    assert json.loads((out / "status.json").read_text())["state"] == "error"


def test_a_device_the_machine_lacks_names_the_commands_key(files, cache, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["eval", f"model.path={files / 'model'}", "model.device=cuda", f"data.eval={files / 'train.jsonl'}",
            "eval.reward_fn=exactrl.tasks.arithmetic:reward", f"output_dir={tmp_path / 'run'}"]
    line = one_line_error(exactrl(args, tmp_path, cache), 2)
    assert line.startswith("error: model.device=cuda, but this torch") and line.endswith("or set model.device=auto")


# ---------------------------------------------------------------- the small ones


@pytest.fixture(scope="module")
def finished(files, cache, tmp_path_factory):
    """A finished SFT run of two steps: its checkpoint-1, its final/."""
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = exactrl(sft(files, out, "data.eval=null", "train.save_every=1", "train.save_total_limit=1"), files, cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_a_model_without_tokenizer_files_says_so(files, cache, tmp_path):
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(files / "model" / name, model)
    line = one_line_error(exactrl(sft(files, tmp_path / "run", f"model.path={model}"), tmp_path, cache), 2)
    assert line == (f"error: '{model}' holds no tokenizer files (tokenizer.json, or a slow tokenizer's tokenizer.model "
                    "/ vocab.json and merges.txt / vocab.txt, with tokenizer_config.json): copy them from the model "
                    "it was made from")


@pytest.mark.parametrize("row,said", [
    ('{"prompt": "1+1=", "completion": "2}', "Unterminated string starting at column 34"),
    ('{"prompt": "1+1=\x01", "completion": "2"}', "Invalid control character at column 17"),
    ('{"prompt": "1+1=" "completion": "2"}', "Expecting ',' delimiter at column 19"),
])
def test_a_json_error_reads_as_one_sentence(files, cache, tmp_path, row, said):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n" + row + "\n")
    line = one_line_error(exactrl(sft(files, tmp_path / "run", f"data.train={data}"), tmp_path, cache), 2)
    assert line == f"error: {data}:2: not valid JSON ({said})"


def test_rl_keys_given_to_sft_say_they_are_rls(files, cache, tmp_path):
    line = one_line_error(exactrl(sft(files, tmp_path / "run", "algo.group_size=8"), tmp_path, cache), 2)
    assert line == ("error: override 'algo.group_size=8': unknown key 'algo': algo.* is `exactrl rl`'s, not `exactrl "
                    "sft`'s; run `exactrl rl` for RL, or remove it")


def test_resuming_a_finished_run_refuses_without_saying_it_continues(files, cache, tmp_path, finished):
    before = {p.name: p.stat().st_mtime_ns for p in finished.iterdir()}
    proc = exactrl(sft(files, finished, "data.eval=null", "train.save_every=1", "train.save_total_limit=1",
                       "train.resume_from=latest"), tmp_path, cache)
    assert one_line_error(proc, 2) == (f"error: output_dir '{finished}' holds a run that has written final/ (it ended "
                                       "'success'): nothing is left to resume; choose another output_dir")
    assert "continuing" not in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in finished.iterdir()} == before  # nothing of the run touched


def test_a_checkpoint_that_does_not_exist_is_named_with_the_ones_there(files, cache, tmp_path, finished):
    proc = exactrl(sft(files, tmp_path / "run", "data.eval=null", "train.max_steps=3",
                       f"train.resume_from={finished / 'checkpoint-99'}"), tmp_path, cache)
    assert one_line_error(proc, 2) == (f"error: train.resume_from: '{finished / 'checkpoint-99'}' does not exist; "
                                       f"'{finished}' holds checkpoint-1; point it at a checkpoint-N directory of a "
                                       "run (or train.resume_from=latest)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["bad-row", "bad-resume"])
def test_no_evaluation_note_precedes_an_error(files, cache, tmp_path, finished, case):
    """data.eval left at auto on the user's own data: the note is said when the run starts, never before the error
    that stops it."""
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n{\n")
    extra = [f"data.train={data}"] if case == "bad-row" else [f"train.resume_from={finished / 'checkpoint-99'}"]
    proc = exactrl(sft(files, tmp_path / "run", *extra), tmp_path, cache)
    one_line_error(proc, 2)
    assert "note: no evaluation" not in proc.stderr


def test_the_no_evaluation_note_is_still_said_when_the_run_starts(files, cache, tmp_path):
    proc = exactrl(sft(files, tmp_path / "run", "train.max_steps=1"), tmp_path, cache)
    assert proc.returncode == 0 and "note: no evaluation -- data.train=" in proc.stderr

