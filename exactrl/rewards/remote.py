"""Rewards from a server: ``reward.fn=http://host:port/`` posts each batch as JSON
``{"prompts": [...], "completions": [...], "answers": [...]}`` and expects
``{"rewards": [float, ...]}`` back (OpenRLHF's --remote_rm_url works the same way). Connection
errors, timeouts and 5xx answers are retried ``retries`` times with exponential backoff; a
4xx answer is the server refusing the request and fails at once with its message. The
reference server is exactrl/rewards/server.py."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, or refused or garbled the batch."""


class RemoteReward:
    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
        body = json.dumps({"prompts": prompts, "completions": completions, "answers": answers}).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:300]
                if e.code < 500:
                    raise RemoteRewardError(f"{self.url} refused the batch: HTTP {e.code} {detail}") from None
                last = f"HTTP {e.code} {detail}"
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            except json.JSONDecodeError as e:
                raise RemoteRewardError(f"{self.url} answered with something that is not JSON ({e})") from None
            if not isinstance(answer, dict) or not isinstance(answer.get("rewards"), list):
                raise RemoteRewardError(f"{self.url} answered {str(answer)[:200]!r}; expected "
                                        f"{{\"rewards\": [float, ...]}}")
            return answer["rewards"]
        times = "once" if self.retries == 0 else f"{self.retries + 1} times"
        raise RemoteRewardError(f"{self.url} failed {times}; last: {last}")
