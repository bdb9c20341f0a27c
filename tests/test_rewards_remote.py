"""The reward server client against the shipped reference server and against misbehaving
servers: same values as calling the function, retries with backoff on 5xx and dropped
connections, an immediate clear error on 4xx, and a run that trains on a remote reward."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from exactrl.algorithms.rl import train_rl
from exactrl.config import ConfigError, RLConfig, load_config
from exactrl.rewards import load_reward_fn
from exactrl.rewards.remote import RemoteReward, RemoteRewardError
from exactrl.rewards.server import make_server
from exactrl.tasks.arithmetic import reward as arithmetic_reward
from exactrl.tasks.builtin import BuiltinSpec


def serve(server):
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/"


@pytest.fixture
def reference_server():
    server = make_server("exactrl.tasks.arithmetic:reward", port=0)
    yield serve(server)
    server.shutdown()


def test_reference_server_gives_the_functions_own_values(reference_server):
    completions = ["3+4+0=07 #### 007", "#### 12", "nonsense"]
    answers = ["7", "13", "1"]
    remote = load_reward_fn(reference_server)
    assert remote(["p"] * 3, completions, answers) == arithmetic_reward(["p"] * 3, completions, answers)


class Flaky(BaseHTTPRequestHandler):
    """Fails the first ``fail`` requests with ``code``, then answers 0.5 per completion."""

    fail, code, seen = 2, 503, []

    def do_POST(self):
        batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Flaky.seen.append(len(batch["completions"]))
        if len(Flaky.seen) <= Flaky.fail:
            self.send_response(Flaky.code)
            self.end_headers()
            self.wfile.write(b"busy")
            return
        data = json.dumps({"rewards": [0.5] * len(batch["completions"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def flaky_server(fail: int, code: int):
    Flaky.fail, Flaky.code, Flaky.seen = fail, code, []
    return ThreadingHTTPServer(("127.0.0.1", 0), Flaky)


def test_server_errors_are_retried_with_backoff():
    server = flaky_server(fail=2, code=503)
    url = serve(server)
    assert RemoteReward(url, retries=2, backoff=0.01)(["p", "q"], ["a", "b"], [None, None]) == [0.5, 0.5]
    assert Flaky.seen == [2, 2, 2]  # two refusals, then the answer
    server.shutdown()


def test_client_errors_fail_at_once_and_retries_run_out():
    server = flaky_server(fail=10, code=400)
    url = serve(server)
    with pytest.raises(RemoteRewardError, match=r"refused the batch: HTTP 400 busy"):
        RemoteReward(url, retries=3, backoff=0.01)(["p"], ["a"], [None])
    assert Flaky.seen == [1]  # not retried
    server.shutdown()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteRewardError, match=r"failed 3 times; last: URLError"):
        RemoteReward(f"http://127.0.0.1:{port}/", retries=2, backoff=0.01)(["p"], ["a"], [None])


@pytest.mark.parametrize("key", ["reward.url", "reward.fn"])
def test_rl_trains_on_a_remote_reward(reference_server, tmp_path, monkeypatch, key):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                       "algo.group_size=4",
                                       "train.max_steps=1", "train.log_every=1", "rollout.max_new_tokens=8",
                                       f"{key}={reference_server}", f"output_dir={tmp_path / 'run'}"])
    assert cfg.reward.specs() == [reference_server]
    result = train_rl(cfg, spec=BuiltinSpec(n_sft=20, n_rl=40, n_eval=10))
    (row,) = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert row["reward_failures"] == 0 and 0.0 <= row["reward_mean"] <= 1.0


def test_reward_url_must_be_an_http_address():
    with pytest.raises(ConfigError, match="reward.url='localhost:8000' is not an http"):
        load_config(RLConfig, None, ["reward.url=localhost:8000"])


def test_reference_server_times_out_hung_rewards_and_refuses_missing_answers(reference_server):
    with pytest.raises(RemoteRewardError,
                       match=r"refused the batch: HTTP 400 .*needs an answer for every prompt; got null at position 1"):
        RemoteReward(reference_server, retries=0)(["p", "q"], ["#### 3", "#### 4"], ["3", None])
    server = make_server("reward_fixtures:hangs", port=0, timeout=1.0)
    url = serve(server)
    try:
        with pytest.raises(RemoteRewardError,
                           match=r"failed once; last: HTTP 500 .*no result within reward.timeout=1s"):
            RemoteReward(url, timeout=30, retries=0)(["p"], ["a"], ["1"])
    finally:
        server.shutdown()


def test_the_start_check_passes_a_live_server_and_names_the_key_of_one_that_is_not(reference_server):
    from exactrl.serving import ServerUnreachable, check_server

    check_server(reference_server, "reward.url")  # a server that listens passes (only a connection is asked)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerUnreachable, match=rf"^reward.fn=http://127.0.0.1:{port}/x: no reward server answers at "
                                          rf"127.0.0.1:{port} \(Connection refused\)"):
        check_server(f"http://127.0.0.1:{port}/x", "reward.fn")
    with pytest.raises(ServerUnreachable, match=r"^eval.reward_fn=http://127.0.0.1:99999/: the port is not a number"):
        check_server("http://127.0.0.1:99999/", "eval.reward_fn")
