"""Environments run in a process of their own with env.timeout per episode call (exactrl/envs/process.py), over
HTTP (envs/remote.py, envs/server.py), and as the built-in tool-calling environment (envs/tools.py). An
environment that hangs, raises, returns garbage, exits or crashes ends its episode alone, with one line naming
the class, the episode, the turn and what went wrong; the run (this process) goes on. The environments are in
tests/env_fixtures.py and tests/tool_fixtures.py (no torch in the environment process)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from exactrl.config.schema_env import EnvConfig
from exactrl.envs import make_env_pool
from exactrl.envs.base import Action, EnvError, StepResult
from exactrl.envs.process import _GRACE, ProcessEnvPool
from exactrl.envs.remote import RemoteEnvPool
from exactrl.envs.server import make_server
from exactrl.envs.tools import ToolEnv, parse_calls, schemas

T = 1.0  # env.timeout in these tests
SLACK = 0.8  # a timed-out episode ends within T + SLACK: less than _GRACE, so the parent's kill cannot pass for it
S = "environment env_fixtures:Scripted"
ROWS = [{"prompt": "p0"}, {"prompt": "p1", "plain": True}, {"prompt": "p2"}]


def act(text: str, turn: int = 0, ids=(5, 6, 7), finished: bool = True) -> Action:
    return Action(list(ids), text, finished, turn)


@pytest.fixture
def scripted():
    with ProcessEnvPool("env_fixtures:Scripted", {"limit": 5}, timeout=T) as pool:
        assert pool.reset(list(enumerate(ROWS))) == ["start p0", None, "start p2"]
        yield pool


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def pid(pool) -> int:
    return pool._child.proc.pid


def episodes(pool_or_envs, turns: list[list[str]]) -> list:
    """Every result of resetting ROWS and stepping them through ``turns`` (one text per live episode a turn),
    from a pool or, as the reference, from Counter instances called directly."""
    out, live = [], list(range(len(ROWS)))
    if isinstance(pool_or_envs, list):
        envs = pool_or_envs
        out.append([env.reset(row) for env, row in zip(envs, ROWS)])
        call = lambda batch: [envs[e].step(a) for e, a in batch]  # noqa: E731
    else:
        out.append(pool_or_envs.reset(list(enumerate(ROWS))))
        call = pool_or_envs.step
    for turn, texts in enumerate(turns):
        batch = [(e, act(t, turn, ids=range(turn + e + 1), finished=e != 1)) for e, t in zip(live, texts)]
        results = call(batch)
        out.append(results)
        live = [e for (e, _), r in zip(batch, results) if not r.done]
    return out


TURNS = [["a", "b", "stop"], ["c", "d"], ["e", "f"]]


def test_a_good_environment_gives_the_same_results_in_process_in_the_pool_and_over_http():
    from env_fixtures import Counter

    reference = episodes([Counter(limit=3) for _ in ROWS], TURNS)
    assert [len(r) for r in reference] == [3, 3, 2, 2]  # episode 2 said "stop"; the rest hit the turn limit
    assert reference[2][1].observation == [7, 8, 5] and reference[1][0].reward == 1.0
    with ProcessEnvPool("env_fixtures:Counter", {"limit": 3}, timeout=T) as pool:
        assert episodes(pool, TURNS) == reference
    server = make_server("env_fixtures:Counter", {"limit": 3}, port=0, timeout=T)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with RemoteEnvPool(f"http://127.0.0.1:{server.server_port}/", timeout=T) as pool:
            assert episodes(pool, TURNS) == reference
            pool.end([0, 1, 2])
            (error,) = pool.step([(0, act("a", 3))])  # ended: the server holds no instance any more
            assert "no such episode" in str(error)
        with RemoteEnvPool(f"http://127.0.0.1:{server.server_port}", timeout=T) as pool:  # another rank, same ids
            assert episodes(pool, TURNS) == reference
    finally:
        server.shutdown()
        server.pool.close()


def test_a_hanging_episode_ends_within_its_timeout_and_the_others_go_on(scripted):
    first = pid(scripted)
    results, took = timed(scripted.step, [(0, act("a")), (1, act("hang now")), (2, act("b"))])
    assert took < T + SLACK
    assert str(results[1]) == f"{S}, episode 1, turn 0, step took longer than env.timeout=1s (interrupted)"
    assert results[0] == StepResult([{"role": "user", "content": "p0: you said 'a', 3 ids"}], 3.0, False, {"turn": 0})
    assert isinstance(results[2], StepResult) and pid(scripted) == first  # interrupted, not killed
    results, took = timed(scripted.step, [(0, act("a", 1)), (1, act("a", 1)), (2, act("alarm", 1))])
    assert results[0].observation == [7, 8, 6]  # its state went on
    assert str(results[1]) == f"{S}, episode 1, turn 1, step: no such episode (never reset, already done or ended)"
    # an environment that cancels SIGALRM (signal.alarm(0), as math-verify's timer does) is still interrupted
    assert str(results[2]).endswith("turn 1, step took longer than env.timeout=1s (interrupted)") and took < T + SLACK
    results, took = timed(scripted.reset, [(3, {"prompt": "q", "cue": "hang"}), (4, {"prompt": "r"})])
    assert str(results[0]) == f"{S}, episode 3, reset took longer than env.timeout=1s (interrupted)"
    assert results[1] == "start r" and took < T + SLACK and pid(scripted) == first


def test_an_episode_that_ignores_its_interrupt_is_killed_and_the_child_s_episodes_end_with_it(scripted):
    first = pid(scripted)
    scripted.reset([(3, {"prompt": "q"})])
    results, took = timed(scripted.step, [(0, act("stop")), (1, act("stubborn")), (2, act("a"))])
    assert T + _GRACE <= took < T + _GRACE + 2.0
    assert results[0].done  # finished before the kill: its result stands
    assert str(results[1]) == (f"{S}, episode 1, turn 0, step did not return within env.timeout=1s + 2s (it ignored "
                               "the interrupt); the environment process was killed (exit code -9)")
    killed = f"its state was lost: the environment process was killed when {S}, episode 1, turn 0, step failed"
    assert str(results[2]) == f"{S}, episode 2, turn 0, step: {killed}"
    (lost,) = scripted.step([(3, act("a"))])  # live in the killed child, not in that batch
    assert str(lost) == f"{S}, episode 3, turn 0, step: {killed}"
    assert scripted.reset([(5, {"prompt": "s"})]) == ["start s"] and pid(scripted) != first  # a fresh child
    assert scripted.step([(5, act("a"))])[0].observation[0]["content"] == "s: you said 'a', 3 ids"


@pytest.mark.parametrize("text, error", [
    ("raise", "step raised ValueError: the move is illegal"),
    ("exit", "step called sys.exit(3)"),
    ("nan", "step returned reward nan: a finite number or None"),
    ("tuple", "step returned done='yes': True or False"),
    ("garbage", "step returned dict: step returns a StepResult or a tuple (observation, reward, done, info)"),
    ("obs", "step returned list \"[{'role': 'tool'}]\": an observation is None, a str"),
    ("unpicklable", "step returned something that cannot be sent back ("),
])
def test_a_raising_exiting_or_garbage_returning_episode_ends_alone(scripted, text, error):
    first = pid(scripted)
    results = scripted.step([(0, act("a")), (1, act(text)), (2, act("b"))])
    assert isinstance(results[1], EnvError) and str(results[1]).startswith(f"{S}, episode 1, turn 0, {error}")
    assert "\n" not in str(results[1])
    assert isinstance(results[0], StepResult) and isinstance(results[2], StepResult) and pid(scripted) == first
    assert scripted.step([(0, act("a", 1))])[0].observation == [7, 8, 6]


def test_a_crash_kills_the_child_and_the_next_call_works(scripted):
    results = scripted.step([(0, act("a")), (1, act("crash")), (2, act("b"))])
    assert str(results[1]) == (f"{S}, episode 1, turn 0, step ended the environment process (a crash or os._exit in "
                               "the environment) (exit code 9)")
    assert "its state was lost" in str(results[0]) and "its state was lost" in str(results[2])
    (error, ok) = scripted.reset([(6, {"prompt": "q", "cue": "exit"}), (7, {"prompt": "r"})])
    assert str(error) == f"{S}, episode 6, reset called sys.exit(3)" and ok == "start r"


def test_an_environment_that_cannot_start_is_one_clear_line(tmp_path):
    cases = {
        "env_fixtures.Counter": "environment class 'env_fixtures.Counter' must be written module:Class, e.g. "
                                "my_envs:MyEnv",
        "no_such_module:Env": "environment class 'no_such_module:Env': cannot import module 'no_such_module' (No "
                              "module named 'no_such_module')",
        "env_fixtures:Missing": "environment class 'env_fixtures:Missing': module 'env_fixtures' has no callable "
                                "'Missing'",
        "env_fixtures:NoStep": "environment class 'env_fixtures:NoStep' has no reset(row) and step(action) methods",
        "env_fixtures:BrokenInit": "environment class 'env_fixtures:BrokenInit': BrokenInit(**env.args) raised "
                                   "RuntimeError: no board of size 4",
    }
    for spec, error in cases.items():
        with pytest.raises(EnvError) as info:
            make_env_pool(EnvConfig(cls=spec, args={"size": 4} if "Broken" in spec else {}))
        assert str(info.value).startswith(error), spec
    with pytest.raises(EnvError, match="env.url=http://127.0.0.1:9/: no environment server answers at "
                                       r"127.0.0.1:9 \(Connection refused\); start it \(e.g. python -m "
                                       "exactrl.envs.server --cls MODULE:CLASS --port 9\\) or fix env.url"):
        make_env_pool(EnvConfig(url="http://127.0.0.1:9/"))
    (error,) = RemoteEnvPool("http://127.0.0.1:9/", T, check=False).reset([(0, {})])
    assert str(error).startswith("environment server http://127.0.0.1:9, episode 0, reset: the environment server "
                                 "http://127.0.0.1:9 cannot be reached (")
    (tmp_path / "undescribed_tools.py").write_text("def ok(a: int) -> int:\n    '''Fine.\n\n    Args:\n        a: a\n"
                                                   "    '''\n\ndef bare(a, b):\n    return a\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(EnvError, match=r"env.tools=undescribed_tools: tool 'bare' cannot be described \(Cannot "
                                           "generate JSON schema for bare because it has no docstring!\\); give it"):
            make_env_pool(EnvConfig(tools="undescribed_tools"))
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(EnvError, match="env.tools=env_fixtures: the module defines no public function"):
        schemas("env_fixtures")
    server = subprocess.run([sys.executable, "-m", "exactrl.envs.server", "--cls", "env_fixtures:NoStep"],
                            capture_output=True, text=True, cwd=str(tmp_path.parent),
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": ""})
    assert server.returncode == 2 and server.stderr == ("error: environment class 'env_fixtures:NoStep' has no "
                                                        "reset(row) and step(action) methods (exactrl/envs/base.py)\n")


def test_tool_calls_are_parsed_run_and_answered():
    env = ToolEnv("tool_fixtures")
    assert list(env.tools) == ["add", "divide"]  # not the imported sqrt, not _helper
    assert [s["function"]["name"] for s in schemas("tool_fixtures")] == ["add", "divide"]
    assert schemas("tool_fixtures")[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                                         "description": "the first"}
    text = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call> and '
            '<tool_call>[{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}, {"name": "add", "arguments": '
            '{"a": 1, "b": -1}}]</tool_call><tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": {"a": 1}}'
            '</tool_call><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>["add"]</tool_call>'
            '<tool_call>{"name": "add", "arguments"')
    result = env.step(act(text))
    assert result.reward is None and not result.done
    assert result.info == {"tool_calls": 10, "tool_errors": 7}
    assert result.observation == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "divide", "content": "0.25"},
        {"role": "tool", "name": "add", "content": "0"},
        {"role": "tool", "name": "divide", "content": "error: divide raised ZeroDivisionError: division by zero"},
        {"role": "tool", "name": "mul", "content": "error: unknown tool 'mul' (the tools are: add, divide)"},
        {"role": "tool", "name": "add", "content": "error: wrong arguments for 'add': missing a required argument: "
                                                   "'b'"},
        {"role": "tool", "name": "add", "content": "error: wrong arguments for 'add': got an unexpected keyword "
                                                   "argument 'c'"},
        {"role": "tool", "name": "add", "content": "error: the arguments of 'add' must be an object, got [1]"},
        {"role": "tool", "content": "error: a tool call is {\"name\": ..., \"arguments\": {...}}, got \"add\""},
        {"role": "tool", "content": "error: the tool call is not valid JSON (Expecting ':' delimiter: line 1 column "
                                    "28 (char 27)): '{\"name\": \"add\", \"arguments\"'"},
    ]
    assert parse_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}') == [("add", {"a": 1, "b": 2},
                                                                                          None)]  # left open
    assert env.step(act("The answer is 5.")) == StepResult(None, None, True, {"tool_calls": 0, "tool_errors": 0})


def test_the_tool_environment_runs_in_the_pool():
    with make_env_pool(EnvConfig(tools="tool_fixtures", timeout=T)) as pool:
        assert [s["function"]["name"] for s in pool.tools] == ["add", "divide"]
        assert pool.reset([(0, {"prompt": "x"}), (1, {"prompt": "y"})]) == [None, None]
        calls = pool.step([(0, act('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')),
                           (1, act("It is 5."))])
        assert calls == [StepResult([{"role": "tool", "name": "add", "content": "5"}], None, False,
                                    {"tool_calls": 1, "tool_errors": 0}),
                         StepResult(None, None, True, {"tool_calls": 0, "tool_errors": 0})]
