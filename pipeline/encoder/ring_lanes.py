"""The encoder's fast lanes: EmbeddingReady into same-host consumers' rings.

A consumer (a generator) on this host names its ring in its Hello; from then
on its EmbeddingReady messages go into the ring (pipeline/arena/ring.py),
with a socket Wake only when it said it may be blocked on its socket.
Whatever the ring refuses (full, too big, a consumer that stopped reading)
goes by socket as before, so a ring can only make a message faster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pipeline import protocol
from pipeline.arena import ring

log = logging.getLogger("epd.encoder")


class RingLanes:
    def __init__(self, send: Callable[[str, protocol.Message], bool], sender: str, stale_s: float = 0.5) -> None:
        self.send = send
        self.sender = sender
        self.stale_s = stale_s
        self.host = ring.host_id() if ring.supported() else None
        self._rings: dict[str, ring.Producer] = {}   # consumer address -> its ring
        self.wakes = 0     # socket wake-ups sent to consumers blocked on their sockets

    def on_hello(self, hello: protocol.Hello) -> None:
        """(Re)attach the consumer's ring; a Hello without one (another host,
        a restart without rings) detaches it."""
        old = self._rings.pop(hello.reply_to, None)
        if old is not None:
            old.close()
        if not hello.ring or self.host is None or hello.host != self.host:
            return
        try:
            self._rings[hello.reply_to] = ring.attach(hello.ring, self.stale_s)
        except Exception as exc:   # a peer's bad Hello must not stop the encoder's loop
            log.warning("consumer %s: ring %s not usable (%s); using its socket", hello.reply_to, hello.ring, exc)

    def deliver(self, address: str, message: protocol.Message) -> bool:
        """True if `message` went into `address`'s ring; False: send it by socket."""
        lane = self._rings.get(address)
        if lane is None or not lane.push(protocol.encode(message)):
            return False
        if lane.consumer_sleeping():
            self.send(address, protocol.Wake(self.sender))
            self.wakes += 1
        return True

    def close(self) -> None:
        for lane in self._rings.values():
            lane.close()
        self._rings.clear()
