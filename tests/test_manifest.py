"""The run manifest under several writers: every update lands, none is lost or half-written."""

from __future__ import annotations

import json
import multiprocessing

from exactrl.audit.manifest import record_check, write_manifest

WRITERS, CHECKS = 4, 25


def _writer(run_dir, who: int, start) -> None:
    start.wait()
    for i in range(CHECKS):
        record_check(run_dir, f"w{who}/{i}", {"i": i})


def test_concurrent_check_records_all_land(tmp_path):
    """Four processes each record 25 checks at once (as ranks and phases do): a read-modify-write
    through one shared temporary name lost updates or crashed on a vanished temporary file."""
    write_manifest(tmp_path, 0, {})
    ctx = multiprocessing.get_context("fork")  # the module is imported already: no second torch import per writer
    start = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_writer, args=(tmp_path, w, start)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    checks = json.loads((tmp_path / "manifest.json").read_text())["checks"]
    assert set(checks) == {f"w{w}/{i}" for w in range(WRITERS) for i in range(CHECKS)}
    assert not list(tmp_path.glob("*.tmp"))
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == 0
