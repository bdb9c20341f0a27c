"""torchrun as exactrl's own launcher runs it (``distributed.nproc_per_node`` > 1): without its log
lines and its ChildFailedError report (about 40 lines after a rank's one-line error), since the
launcher prints how the run ended in one line from what the ranks noted (exactrl/run_dir.py).
A rank that ended without a note (killed, e.g. by the out-of-memory killer) is noted here."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from exactrl.distributed.launch import LAUNCHER_PID, STOP_GRACE, STOP_SIGNALS
from exactrl.run_dir import LAUNCH_DIR, note


def _die_with_launcher() -> None:
    """SIGTERM to this process when the launcher dies, even by SIGKILL (Linux), so torchrun stops the
    ranks rather than leaving them to run on; and the signals the launcher held while starting this
    process are this process's again."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != int(os.environ[LAUNCHER_PID]):  # it died before the line above
            sys.exit(128 + signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def main() -> None:
    _die_with_launcher()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.disable(logging.ERROR)
    # After a rank fails torchrun SIGTERMs the others; one stuck in a collective is killed after as long
    # as the launcher gives after a signal, not torchrun's default 30 s (older torch reads no such variable).
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(STOP_GRACE)))
    try:
        run(parse_args(sys.argv[1:]))
    except ChildFailedError as e:
        notes = Path(os.environ[LAUNCH_DIR])
        for rank, failure in sorted(e.failures.items()):
            # Every way a rank can fail leaves a note but being killed; torchrun's own SIGTERM to the
            # others after the first failure is not a cause. A killed rank (the out-of-memory killer,
            # kill -9) is the cause of its peers' failures (a collective that lost it), so it goes first.
            if failure.exitcode == -signal.SIGTERM or (notes / f"end-rank{rank}.json").exists():
                continue
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            note(f"end-killed-rank{rank}.json", {
                "rank": rank, "state": "error", "label": "error", "code": 1, "time": 0.0,
                "message": f"rank {rank} ended ({how}) without saying why (killed? out of memory?); its output, "
                           "if any, is above"})
        sys.exit(1)
    except SignalException as e:  # the launcher passed on SIGINT/SIGTERM; the ranks have been told
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
