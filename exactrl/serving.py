"""What exactrl's HTTP servers (rewards/server.py, envs/server.py) and their clients share: a probe, before a run
starts, that a server listens, and the JSON reply a handler sends."""

from __future__ import annotations

import json
import socket
import urllib.parse


class ServerUnreachable(RuntimeError):
    """A server a run needs accepts no connection (or its address is malformed)."""


def check_server(url: str, key: str, timeout: float = 10.0, what: str = "reward server",
                 start: str = "python -m exactrl.rewards.server MODULE:FUNCTION") -> None:
    """Refuse, before anything starts, a ``what`` that accepts no connection (naming ``key`` and the address;
    ``start`` is the command that starts one): a run would find out at its first rollout, after its model loaded.
    A connection is all this asks: servers need not answer anything but their POST."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ServerUnreachable(f"{key}={url}: the port is not a number between 0 and 65535") from None
    if not parts.hostname:
        raise ServerUnreachable(f"{key}={url}: the address names no host (e.g. http://127.0.0.1:8000/)")
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise ServerUnreachable(f"{key}={url}: no {what} answers at {parts.hostname}:{port} ({why}); start it "
                                f"(e.g. {start} --port {port}) or fix {key}") from None


def send_json(handler, code: int, payload) -> None:
    """``payload`` as a JSON reply with status ``code`` from a BaseHTTPRequestHandler."""
    data = json.dumps(payload).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
