"""ZeroMQ sockets, made one way everywhere.

Every process has one inbox (a PULL socket it binds) and reaches a peer by
connecting a PUSH socket to the peer's inbox address. Addresses come from the
command line: `ipc://` paths in a private 0700 run folder by default (one
host), `tcp://` for other hosts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio

from pipeline import protocol

log = logging.getLogger("epd.transport")

# Messages waiting for a slow or absent peer are bounded, so a dead peer costs
# bounded memory; sends past the mark raise instead of blocking the loop.
SEND_HWM = 10_000
RECV_HWM = 100_000
LINGER_MS = 0  # closing never blocks on undelivered messages to a dead peer
DRAIN_BATCH = 256  # messages handled per reader wake-up before yielding to the loop


def install_event_loop() -> None:
    """uvloop for every asyncio process of ours."""
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def private_run_dir(base: str | None = None) -> Path:
    """A 0700 folder for ipc:// socket files (only our user can connect)."""
    root = Path(base or os.environ.get("EPD_RUN_DIR") or tempfile.gettempdir())
    path = root / f"epd-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"run folder {path} must not be accessible to other users (chmod 700)")
    return path


def ipc_address(name: str, run_dir: Path | None = None) -> str:
    return f"ipc://{(run_dir or private_run_dir()) / name}.sock"


def make_socket(ctx: zmq.Context, kind: int, address: str, *, bind: bool) -> zmq.Socket:
    """The one place sockets are made: linger, high-water marks, and the
    bind/connect rule (inboxes bind, senders connect)."""
    if not address.startswith(("ipc://", "tcp://", "inproc://")):
        raise ValueError(f"unsupported socket address {address!r}; use ipc://, tcp:// or inproc://")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    try:
        if bind:
            if address.startswith("ipc://"):
                Path(address[len("ipc://"):]).unlink(missing_ok=True)  # a stale file from a crash
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        sock.close(linger=0)   # an open socket would keep the context from terminating
        raise
    return sock


class Inbox:
    """This process's PULL socket; yields decoded messages. A frame that is
    not a declared message is counted and dropped, never raised into the
    loop (a bad peer must not stop us)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.address = address
        self.socket = make_socket(ctx, zmq.PULL, address, bind=True)
        self.rejected = 0
        self._reader: tuple[asyncio.AbstractEventLoop, int] | None = None

    async def recv(self) -> protocol.Message:
        while True:
            frame = await self.socket.recv(copy=False)
            message = self._decode(frame)
            if message is not None:
                return message

    def listen(self, handle: Callable[[protocol.Message], None]) -> None:
        """Call `handle(message)` for every message, straight from the event
        loop's reader callback. Unlike recv(), no future or task is made per
        message: each costs tens of microseconds, and a proxied token pays
        for two hops. Use either this or recv() on one inbox, not both."""
        plain = zmq.Socket.shadow(self.socket.underlying)
        loop = asyncio.get_running_loop()

        def drain() -> None:
            # The zmq descriptor only signals new arrivals (edge-triggered):
            # everything queued must be read now or it waits for the next one.
            for _ in range(DRAIN_BATCH):
                try:
                    frame = plain.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                message = self._decode(frame)
                if message is None:
                    continue
                try:
                    handle(message)
                except Exception:  # one bad message must not stop the inbox
                    log.exception("handling %s failed", type(message).__name__)
            loop.call_soon(drain)  # a long burst: let other callbacks run, then go on

        loop.add_reader(plain.FD, drain)
        self._reader = (loop, plain.FD)
        drain()  # whatever arrived before the reader was registered

    def _decode(self, frame: zmq.Frame) -> protocol.Message | None:
        try:
            return protocol.decode(frame.buffer)
        except (ValueError, TypeError):  # msgspec's errors derive from these
            self.rejected += 1
            return None

    def close(self) -> None:
        if self._reader is not None:
            loop, fd = self._reader
            loop.remove_reader(fd)
            self._reader = None
        self.socket.close()


class Outbox:
    """PUSH sockets to peers, one per address, made on first use.

    Plain (blocking-API) sockets sharing the process's context: a send with
    NOBLOCK either queues at once or raises, so it needs no awaiting and its
    error cannot be lost in an unawaited future."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = zmq.Context.shadow(ctx.underlying)
        self.sockets: dict[str, zmq.Socket] = {}

    def _socket(self, address: str) -> zmq.Socket:
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = make_socket(self.ctx, zmq.PUSH, address, bind=False)
        return sock

    def send(self, address: str, message: protocol.Message) -> None:
        """Queue a message without waiting; raises zmq.Again when the peer's
        queue is full (it is down or far behind)."""
        self._socket(address).send(protocol.encode(message), flags=zmq.NOBLOCK, copy=False)

    def try_send(self, address: str, message: protocol.Message) -> bool:
        """send(), but a peer that cannot take the message is logged and
        reported as False: a stage never stops because one peer is gone."""
        try:
            self.send(address, message)
            return True
        except (zmq.ZMQError, ValueError) as exc:   # ValueError: no socket address at all (from a peer's message)
            log.warning("cannot send %s to %s: %s", type(message).__name__, address, exc)
            return False

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
