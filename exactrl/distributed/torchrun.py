"""torchrun as exactrl's own launcher runs it (``distributed.nproc_per_node`` > 1): without its log
lines and its ChildFailedError report (about 40 lines after a rank's one-line error), since the
launcher prints how the run ended in one line from what the ranks noted (exactrl/run_dir.py).
A rank that ended without a note (killed, e.g. by the out-of-memory killer) is noted here."""

from __future__ import annotations

import logging
import sys
import time

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from exactrl.run_dir import note


def main() -> None:
    logging.disable(logging.ERROR)
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
