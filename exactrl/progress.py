"""Progress of long work: a tqdm bar on a terminal, plain periodic lines in a log file.

tqdm redraws its bar with carriage returns, which a log file (stderr not a TTY: nohup, a
batch scheduler, CI) keeps as one ever-growing line of frames; there a line is printed
every ``every_s`` seconds and at the end instead, with the same rate and ETA.
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm


class PlainProgress:
    """tqdm's update / set_postfix / write / close, as one line per ``every_s`` seconds."""

    def __init__(self, total: int, desc: str, start: int = 0, every_s: float = 30.0, file=None, unit: str = "step"):
        self.total, self.desc, self.n, self.every_s, self.unit = total, desc, start, every_s, unit
        self.file = file or sys.stderr
        self._start_n, self._t0 = start, time.perf_counter()
        self._last = self._t0
        self._postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self.every_s or self.n >= self.total:
            self._last = now
            self._line(now)

    def _line(self, now: float) -> None:
        rate = (self.n - self._start_n) / max(now - self._t0, 1e-9)
        eta = (self.total - self.n) / rate if rate > 0 else float("inf")
        print(f"{self.desc}: {self.unit} {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%), "
              f"{rate:.3g} {self.unit}/s, "
              f"ETA {eta:.0f} s{self._postfix}", file=self.file, flush=True)

    def set_postfix(self, refresh: bool = False, **values) -> None:
        """tqdm's signature; ``refresh`` is moot here: only update() prints, on its own cadence."""
        self._postfix = "".join(f", {k}={v}" for k, v in values.items())

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, desc: str, start: int = 0, enabled: bool = True, unit: str = "step"):
    """A tqdm bar if stderr is a terminal, else plain periodic lines; nothing if not ``enabled``."""
    if enabled and not sys.stderr.isatty():
        return PlainProgress(total, desc, start, unit=unit)
    return tqdm(total=total, initial=start, desc=desc, unit=unit, dynamic_ncols=True, mininterval=1.0,
                disable=not enabled)
