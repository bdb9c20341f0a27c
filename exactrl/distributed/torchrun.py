"""torchrun as exactrl's own launcher runs it (``distributed.nproc_per_node`` > 1): without its log
lines and its ChildFailedError report (about 40 lines after a rank's one-line error), since the
launcher prints how the run ended in one line from what the ranks noted (exactrl/run_dir.py).
A rank that ended without a note (killed, e.g. by the out-of-memory killer) is noted here."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from exactrl.distributed.launch import LAUNCHER_PID, STOP_GRACE, STOP_SIGNALS
from exactrl.run_dir import note


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
        rank, failure = e.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        note("end-torchrun.json", {"rank": rank, "state": "error", "label": "error", "code": 1, "time": time.time(),
                                   "message": f"rank {rank} ended ({how}) without saying why; its output, if any, is above"})
        sys.exit(1)
    except SignalException as e:  # the launcher passed on SIGINT/SIGTERM; the ranks have been told
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
