"""docs/configuration.md and docs/exit-codes.md are generated (`exactrl config docs`): the committed pages equal
what the schema and the exits table generate now, and the configuration page documents every key of every
command, read back from the page itself."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from exactrl.cli import COMMANDS, app, generated_pages
from exactrl.config.loader import valid_keys
from exactrl.config.reference import CONFIGURATION, render, write_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_committed_pages_equal_the_generated_ones():
    code, line = write_docs(generated_pages(), DOCS, check=True)
    assert code == 0, line  # the line says: run `exactrl config docs`


def _documented(page: str) -> dict[str, set[str]]:
    """Each command's keys as the page gives them: the rows of the tables whose 'Used by' names the command, and
    for each `X.*` section of a command, X. before every key of the command it says it nests."""
    rows: dict[str, set[str]] = {name: set() for name in COMMANDS}
    nested: dict[str, list[tuple[str, str]]] = {name: [] for name in COMMANDS}
    command = None
    for block in re.split(r"\n(?=##+ )", page):
        heading = block.split("\n", 1)[0]
        if m := re.fullmatch(r"## `exactrl (\w+)`", heading):
            command = m.group(1)
        elif m := re.fullmatch(r"### `(\w+)\.\*`", heading):
            nested[command].append((m.group(1), re.search(r"Every key of \[`exactrl (\w+)`\]", block).group(1)))
        elif heading.startswith("### "):
            users = re.search(r"\bUsed by (.*)$", block, re.M).group(1)
            keys = set(re.findall(r"^\| `([\w.]+)` \|", block, re.M))
            for name in re.findall(r"`exactrl (\w+)`", users.split(", and by the phases")[0]):
                rows[name] |= keys
    return {name: rows[name] | {f"{prefix}.{k}" for prefix, of in nested[name] for k in rows[of]}
            for name in COMMANDS}


def test_every_key_of_every_command_is_documented():
    documented = _documented((DOCS / CONFIGURATION).read_text(encoding="utf-8"))
    for name, cls in COMMANDS.items():
        assert documented[name] == set(valid_keys(cls)), (name, set(valid_keys(cls)) ^ documented[name])


def test_an_edited_description_fails_until_regenerated(monkeypatch, tmp_path):
    from exactrl.config.schema import LoraConfig

    assert write_docs(generated_pages(), tmp_path, check=False)[0] == 0
    monkeypatch.setattr(LoraConfig.model_fields["alpha"], "description", "An edited meaning.")
    code, line = write_docs(generated_pages(), tmp_path, check=True)
    assert code == 1 and "configuration.md" in line and "`exactrl config docs`" in line
    assert "| An edited meaning.<br>**Other names:** `lora_alpha` |" in render(COMMANDS)


def test_config_docs_command(tmp_path):
    runner = CliRunner()
    stale = runner.invoke(app, ["config", "docs", "--out", str(tmp_path), "--check"])
    assert stale.exit_code == 1 and "exactrl config docs" in stale.output
    assert len(stale.output.strip().splitlines()) == 1
    assert runner.invoke(app, ["config", "docs", "--out", str(tmp_path)]).exit_code == 0
    assert runner.invoke(app, ["config", "docs", "--out", str(tmp_path), "--check"]).exit_code == 0
    assert (tmp_path / CONFIGURATION).read_text(encoding="utf-8") == render(COMMANDS)


def test_types_and_defaults_read_as_typed():
    page = render(COMMANDS)
    for row in ("| `model.dtype` | `fp32 \\| bf16` | `fp32` |", "| `train.micro_batch_size` | `int > 0` | `16` |",
                "| `model.lora.dropout` | `float in [0, 1)` | `0.0` |",
                "| `rollout.probe_tol` | `float > 0`, optional | `null` |",
                "| `optim.betas` | `[float, float]` | `[0.9,0.999]` |",
                "| `task.model` | `tiny \\| small` | `tiny` (rl); `tiny` (demo); `tiny` (eval); `small` (study) |"):
        assert row in page, row
    assert "**Former name:** `algo.lam`" in page and "**Other names:** `learning_rate`" in page
    assert "{c." not in page
