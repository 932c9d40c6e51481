"""Telling systemd how the launcher is doing (sd_notify's protocol, without
libsystemd): READY=1 once the proxy's /health answers, STATUS= lines while
loading and on each stage restart, STOPPING=1 when a stop begins, and
WATCHDOG=1 pings from the supervisor's own loop, so that a hung launcher
stops pinging and systemd restarts it (WatchdogSec=).

Outside systemd (no NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None, clock=time.monotonic) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET", "")
        if self.address.startswith("@"):   # an abstract socket
            self.address = "\0" + self.address[1:]
        self.clock = clock
        self.interval = _watchdog_interval(env)
        self._next_ping = 0.0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def status(self, text: str) -> None:
        self._send(f"STATUS={text}")

    def stopping(self, status: str) -> None:
        self._send(f"STOPPING=1\nSTATUS={status}")

    def tick(self) -> None:
        """Call from the supervisor's loop: a WATCHDOG=1 every half interval."""
        if self.interval is None:
            return
        now = self.clock()
        if now >= self._next_ping:
            self._send("WATCHDOG=1")
            self._next_ping = now + self.interval / 2

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, message: str) -> None:
        if not self.address:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message.encode(), self.address)
        except OSError:
            pass   # systemd gone or the socket unreachable: serving goes on regardless


def _watchdog_interval(env) -> float | None:
    """Seconds between systemd's watchdog deadlines, if it watches this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6
