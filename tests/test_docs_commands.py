"""Every command in README.md and docs/ is run by a test or by CI, or loaded as the CLI would load it.

A command is a line of a fenced shell block (```bash, ```sh, ```shell; in ```console only the lines after a
`$ ` prompt), with its `\\` continuations joined and its comment cut. Each takes one route:
- `make X`: X is a Makefile target that CI runs (.ci/run) or that a named test runs (MAKE_TESTS);
- `exactrl CMD ...` (also behind .venv/bin/, `python -m exactrl.cli`, torchrun, the deepspeed launcher and
  `ray job submit`): a training command's config is loaded exactly as the CLI loads it (COMMANDS and
  load_config: the file must exist, every override be a key the command takes); `config` and `audit run`
  run for real; what is too slow to run here (`audit stack`, `merge`, `study`) names the test that runs it;
- torchrun, deepspeed and ray: every flag is one the installed tool's --help lists;
- `pip install`: every extra is declared in pyproject.toml, every file it names exists;
- `python -m MODULE`, benchmarks and pytest: the test that runs them (MODULE_TESTS), or --help for a
  measurement run by hand.
A command no route covers fails, naming its file and line.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = {"bash", "sh", "shell", "console", "zsh"}

# Tests that run what CI does not run by itself; each node must exist (test_every_named_test_exists).
MAKE_TESTS = {
    "demo": "tests/test_e2e.py::test_demo_smoke_writes_complete_run_directory",  # `exactrl demo`, what make demo runs
    "gpu-check": "tests/test_gpu_check.py::test_dry_run_passes_and_prints_the_table",  # scripts/gpu_check.py
    "vllm": "tests/test_vllm_real.py::test_the_engine_holds_and_computes_what_the_trainer_sent",  # builds .venv-vllm
}
# `exactrl <sub>` commands too slow or too large to run here, each run by a test.
EXACTRL_TESTS = {
    "audit stack": "tests/test_audit_stack.py::test_installed_stack_is_exact_everywhere",
    "merge": "tests/test_merge.py::test_merged_model_has_the_adapted_logits_and_loads_without_peft",
}
MODULE_TESTS = {
    "exactrl.models.smollm2":
        "tests/test_smollm2_build.py::test_the_build_is_a_plain_tied_llama_with_the_chat_template",
    "exactrl.rewards.server": "tests/test_rewards_remote.py::test_reference_server_gives_the_functions_own_values",
    "pytest": "tests/test_docs_commands.py::test_the_slow_marker_is_declared",
}
# Measurements run by hand (never in the suite: they time the machine); their scripts must parse their flags.
# benchmarks/gpu_bench.py's --dry-run is in the suite (tests/test_gpu_bench.py); its GPU run is by hand.
MEASUREMENTS = {"benchmarks/examples_table.py", "benchmarks/gpu_bench.py"}
# Names the docs use for a config the reader brings, and the stand-in each is loaded as: an example, with
# micro-batches of one so that any world size the command asks for divides its batch, as the reader's would.
STAND_INS = {"my.yaml": {"sft": "examples/sft_tiny.yaml", "rl": "examples/grpo_tiny.yaml"},
             "my_rl.yaml": {"rl": "examples/grpo_tiny.yaml"}}
STAND_IN_OVERRIDES = ["train.micro_batch_size=1"]
PATH_STAND_INS = {"/path/to/old/run": "tests/fixtures/runs/openrlhf_old_flags_affected"}
FLAGS = {"study": {"--with-bugs"}}  # a command's own flags besides --config
LAUNCHERS = {"torchrun": ["torchrun", "--help"], "deepspeed": ["deepspeed", "--help"],
             "ray start": ["ray", "start", "--help"], "ray job submit": ["ray", "job", "submit", "--help"]}


def commands(pages=PAGES):
    """(page, line number, command) for every command line of every fenced shell block."""
    for page in pages:
        lines, lang, i = page.read_text().split("\n"), None, 0
        while i < len(lines):
            text, start = lines[i], i + 1
            fence = re.match(r"\s*```\s*(\w*)", text)
            if fence:
                lang = None if lang is not None else (fence.group(1) or "")
            elif lang in SHELL and text.strip():
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                if lang != "console" or text.startswith("$ "):
                    words = shlex.split(text.removeprefix("$ "), comments=True)
                    for part in filter(None, " ".join(words).split(" && ")):
                        yield (page.relative_to(ROOT) if page.is_relative_to(ROOT) else page), start, \
                            part.strip().removesuffix(" &")
            i += 1


def node_exists(node: str) -> bool:
    path, name = node.split("::")
    return re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M) is not None


def ci_targets() -> set[str]:
    return set(re.findall(r"\bmake\s+([\w-]+)", (ROOT / ".ci" / "run").read_text()))


def makefile_targets() -> dict[str, list[str]]:
    """target -> its prerequisites."""
    text = (ROOT / "Makefile").read_text()
    return {t: deps.split() for t, deps in re.findall(r"^([\w-]+):(?!=)\s*(.*)$", text, re.M)}


def exactrl_argv(argv: list[str]) -> list[str] | None:
    """The arguments exactrl receives, behind whichever launcher the command uses; None if it runs no exactrl."""
    for i, word in enumerate(argv):
        if word.endswith("exactrl") and "/" not in word.removeprefix(".venv/bin/"):
            return argv[i + 1:]
        if word in ("exactrl.cli",) and i and argv[i - 1] in ("-m", "--module"):
            return argv[i + 1:]
    return None


def launcher(argv: list[str]) -> str | None:
    name = Path(argv[0]).name
    if name == "ray" and argv[1:3] == ["job", "submit"]:
        return "ray job submit"
    if name == "ray" and argv[1:2] == ["start"]:
        return "ray start"
    return {"torchrun": "torchrun", "deepspeed": "deepspeed"}.get(name)


def launcher_flags(argv: list[str]) -> list[str]:
    """The launcher's own flags: those before the exactrl module or the `--` of ray job submit."""
    end = next((i for i, w in enumerate(argv) if w in ("-m", "--module", "--")), len(argv))
    return [w.split("=")[0] for w in argv[:end] if w.startswith("-")]


def load_as_cli(args: list[str]) -> None:
    """`exactrl sft|rl|... --config FILE key=value...` loaded as exactrl/cli.py loads it."""
    from exactrl.cli import COMMANDS
    from exactrl.config import load_config

    sub, rest, config, overrides = args[0], args[1:], None, []
    while rest:
        word = rest.pop(0)
        if word in FLAGS.get(sub, ()):
            continue
        if word == "--config":
            config = rest.pop(0)
            if config in STAND_INS:
                config, overrides = STAND_INS[config][sub], [*STAND_IN_OVERRIDES, *overrides]
            assert (ROOT / config).is_file(), f"--config {config}: no such file"
        else:
            assert "=" in word and not word.startswith("-"), f"{word!r} is neither --config nor key=value"
            overrides.append(word)
    load_config(COMMANDS[sub], ROOT / config if config else None, overrides)


def run_exactrl(args: list[str]) -> None:
    from typer.testing import CliRunner

    from exactrl.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1) if args[:2] == ["audit", "run"] else result.exit_code == 0, result.output


def check(page, line, command: str, tools: dict[str, str]) -> str:
    """Validate one command; return the route it took. A command no route covers raises AssertionError."""
    argv = [PATH_STAND_INS.get(w, w).replace("$PWD", str(ROOT)) for w in shlex.split(command)]
    where = f"{page}:{line}: {command}"
    if argv[0] == "make":
        target = argv[1]
        assert target in makefile_targets(), f"{where}: no Makefile target '{target}'"
        assert target in ci_targets() or target in MAKE_TESTS, f"{where}: neither CI nor a test runs make {target}"
        return "make (CI)" if target in ci_targets() else "make (test)"
    if (tool := launcher(argv)) is not None:
        missing = [f for f in launcher_flags(argv) if f not in tools[tool]]
        assert not missing, f"{where}: {tool} has no {missing} (its --help)"
    args = exactrl_argv(argv)
    if args is not None:
        sub = " ".join(args[:2]) if args[0] == "audit" else args[0]
        if "--help" in args or sub in ("config", "audit run"):
            run_exactrl([w for w in args if w != "--json"] if sub == "audit run" else args)
            return "exactrl (run)"
        if sub in EXACTRL_TESTS:
            return "exactrl (test)"
        from exactrl.cli import COMMANDS

        assert sub in COMMANDS, f"{where}: no route for exactrl {sub}"
        load_as_cli(args)
        return f"{tool} flags + exactrl (loaded)" if tool else "exactrl (loaded)"
    if tool is not None:
        return f"{tool} (flags)"
    if argv[:2] == ["pip", "install"]:
        return check_pip(where, argv[2:])
    if "-m" in argv and Path(argv[0]).name.startswith("python"):
        module = argv[argv.index("-m") + 1]
        assert module in MODULE_TESTS, f"{where}: no test runs python -m {module}"
        return "python -m (test)"
    if len(argv) > 1 and argv[1] in MEASUREMENTS:
        proc = subprocess.run([sys.executable, argv[1], "--help", *argv[2:]], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, f"{where}: {proc.stderr[-500:]}"
        return "measurement (--help)"
    raise AssertionError(f"{where}: no test or CI runs this command; add it to a route in {Path(__file__).name}")


def check_pip(where: str, args: list[str]) -> str:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    tested = (ROOT / "requirements-test.txt").read_text()
    for i, word in enumerate(args):
        if word in ("-c", "-r"):
            assert (ROOT / args[i + 1]).is_file(), f"{where}: no file {args[i + 1]}"
        elif (m := re.fullmatch(r"\.\[([\w,-]+)\]", word)) is not None:
            unknown = set(m.group(1).split(",")) - extras
            assert not unknown, f"{where}: pyproject.toml declares no extra {sorted(unknown)}"
        elif not word.startswith("-") and (i == 0 or args[i - 1] not in ("-c", "-r", "-e")):
            assert re.search(rf"^{re.escape(word)}\b", tested, re.M), f"{where}: {word} is not a pinned test tool"
    return "pip install (extras)"


@pytest.fixture(scope="module")
def tools():
    """Each launcher's --help, asked once and side by side (each takes seconds to import its package)."""
    bin_dir = Path(sys.executable).parent
    procs = {name: subprocess.Popen([str(bin_dir / argv[0]), *argv[1:]], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for name, argv in LAUNCHERS.items()}
    return {name: proc.communicate(timeout=120)[0] for name, proc in procs.items()}


def test_every_documented_command_is_run_or_validated(tools):
    routes: dict[str, int] = {}
    failures = []
    for page, line, command in commands():
        try:
            route = check(page, line, command, tools)
            routes[route] = routes.get(route, 0) + 1
        except Exception as e:  # every failing command at once, each with its file and line
            failures.append(f"{page}:{line}: {command}\n    {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)
    assert sum(routes.values()) >= 40 and {"make (CI)", "exactrl (loaded)", "exactrl (run)"} <= set(routes), routes
    print(routes)


def test_every_named_test_exists():
    for node in [*MAKE_TESTS.values(), *EXACTRL_TESTS.values(), *MODULE_TESTS.values()]:
        assert node_exists(node), node
    assert {"demo", "gpu-check", "vllm"} <= set(makefile_targets()) and "test" in ci_targets()


def test_the_slow_marker_is_declared():
    """`python -m pytest -m slow` selects the tests marked slow: the marker is declared, not a typo."""
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers)


@pytest.mark.parametrize("text, says", [
    ("```bash\n.venv/bin/exactrl sft --config examples/sft_tiny.yaml optim.lrr=1e-4\n```\n", "optim.lrr"),
    ("```bash\nexactrl rl --config examples/no_such.yaml\n```\n", "no such file"),
    ("```sh\nmake no-such-target\n```\n", "no Makefile target"),
    ("```console\n$ make bench\n```\n", "neither CI nor a test"),
    ("```bash\ntorchrun --nnodes 2 --no-such-flag 1 -m exactrl.cli sft --config examples/sft_tiny.yaml\n```\n",
     "--no-such-flag"),
    ("```bash\npip install -e '.[deepspeed,loraa]'\n```\n", "loraa"),
    ("```bash\ncurl https://example.com | sh\n```\n", "no test or CI runs"),
])
def test_a_wrong_command_fails_naming_its_file_and_line(tmp_path, tools, text, says):
    page = tmp_path / "page.md"
    page.write_text("intro\n\n" + text)
    ((path, line, command),) = list(commands([page]))
    with pytest.raises(Exception, match=re.escape(says)):
        check(path, line, command, tools)
    assert (path, line) == (page, 4)
