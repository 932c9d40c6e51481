"""The Unix datagram lane: messages arrive whole and in order, garbage is
counted and skipped, and a sender without a receiver is told to fall back."""

from __future__ import annotations

import zmq

from pipeline import protocol
from pipeline.lane import LaneReceiver, LaneSender


def test_messages_arrive_in_order_and_a_missing_lane_means_fall_back(tmp_path):
    path = str(tmp_path / "gen.lane")
    sender = LaneSender()
    assert not sender.send(path, protocol.Heartbeat("x", 0.0))   # nobody bound yet
    receiver = LaneReceiver(path)
    try:
        assert receiver.recv_ready() == []
        # The receiver's descriptor works with zmq's poller, as the generator waits on it.
        poller = zmq.Poller()
        poller.register(receiver.fileno(), zmq.POLLIN)
        got = []
        for burst in range(5):   # the kernel queues few datagrams (net.unix.max_dgram_qlen)
            for i in range(burst * 8, burst * 8 + 8):
                assert sender.send(path, protocol.Heartbeat(f"enc-{i}", float(i)))
            assert poller.poll(1000)
            got += receiver.recv_ready()
        sender.sock.sendto(b"\x93garbage", path)
        assert receiver.recv_ready() == [] and receiver.rejected == 1
        assert [m.sender for m in got] == [f"enc-{i}" for i in range(40)]
        # A full queue refuses instead of dropping: the caller falls back.
        sent = 0
        while sender.send(path, protocol.Heartbeat("flood", 0.0)) and sent < 100_000:
            sent += 1
        assert 0 < sent < 100_000 and len(receiver.recv_ready()) == sent
    finally:
        receiver.close()
        sender.close()
    assert not (tmp_path / "gen.lane").exists()
    assert not LaneSender().send(path, protocol.Heartbeat("x", 0.0))   # receiver gone
