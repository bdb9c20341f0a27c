"""model.trust_remote_code: a local model directory with its own modeling code (auto_map in
config.json) is refused in one line without it -- never a question on the terminal -- and loads
and trains with it; the saved model keeps its code."""

from __future__ import annotations

import json
import time

import pytest

from conftest import SMALL
from exactrl.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from exactrl.tasks.tiny_model import save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer
from test_cli_failures import TINY, exactrl, one_line_error

CONFIG_PY = '''from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
'''
MODELING_PY = '''from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
'''


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("remote") / "model"
    save_tiny_model(d, save_tokenizer(d), **SMALL)
    (d / "configuration_tiny.py").write_text(CONFIG_PY)
    (d / "modeling_tiny.py").write_text(MODELING_PY)
    config = json.loads((d / "config.json").read_text())
    config |= {"model_type": "tiny_custom", "architectures": ["TinyCustomForCausalLM"],
               "auto_map": {"AutoConfig": "configuration_tiny.TinyCustomConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"}}
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_custom_code_is_refused_in_one_line_without_the_flag(custom_dir, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load_causal_lm(custom_dir)
    assert time.perf_counter() - t0 < 10  # transformers' question on the terminal waits 15 s for an answer
    assert str(info.value) == (f"'{custom_dir}' holds its own model code (configuration_tiny.py, modeling_tiny.py), "
                               "which loading it runs: set model.trust_remote_code=true if you trust that code")
    args = ["sft", *TINY, f"model.path={custom_dir}", "train.max_steps=1", f"output_dir={tmp_path / 'a'}"]
    assert "set model.trust_remote_code=true" in one_line_error(exactrl(args, tmp_path, tmp_path / "cache"), 2)


def test_with_the_flag_it_loads_trains_and_saves_its_code(custom_dir, tmp_path):
    args = ["sft", *TINY, f"model.path={custom_dir}", "train.max_steps=1", "model.trust_remote_code=true",
            f"output_dir={tmp_path / 'run'}"]
    run = exactrl(args, tmp_path, tmp_path / "cache")
    assert run.returncode == 0, run.stderr[-2000:]
    final = tmp_path / "run" / "final"
    assert {"configuration_tiny.py", "modeling_tiny.py"} <= {p.name for p in final.iterdir()}
    assert type(load_causal_lm(final, trust_remote_code=True)).__name__ == "TinyCustomForCausalLM"
    assert load_tokenizer(final, trust_remote_code=True).eos_token == "<eos>"
