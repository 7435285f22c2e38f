"""A zmq socket on the event loop, message by message without a future each (`Wire`): the loop watches the
socket's file descriptor and, when it signals, every message waiting is read at once and handed to a callback;
sends never wait. zmq.asyncio makes a future, a poller registration and a callback per message, which on a
2-core host cost a front-end and the engine more CPU per small request than the message's own pickling
(docs/benchmarks.md, issue 42).

zmq's descriptor is edge-triggered and shared by sending and receiving: a send may consume the signal of a
message that has just arrived, so after every send the socket is looked at again (soon, on the loop)."""

from __future__ import annotations

import asyncio
from typing import Callable

import zmq

# Messages read per turn of the loop: a burst of arrivals is read in turns, between which the loop serves the rest.
DRAIN_BATCH = 64


class Wire:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[zmq.Frame]], None]):
        """`sock` (no limit on queued messages: what is sent is bounded by admission) read on the running
        loop; `on_message(frames)` for each message, on the loop's thread."""
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        self.sock, self.on_message = sock, on_message
        self.loop = asyncio.get_running_loop()
        self.fd = sock.getsockopt(zmq.FD)
        self._soon = False
        self.loop.add_reader(self.fd, self._drain)
        self._look()  # what came before the reader was added signals nothing more

    def send(self, frames: list) -> None:
        """Queue `frames` as one message; never waits (a ROUTER drops a message to a peer that is gone)."""
        self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        self._look()

    def _look(self) -> None:
        if not self._soon:
            self._soon = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._soon = False
        sock = self.sock
        if sock.closed:
            return
        for _ in range(DRAIN_BATCH):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            self.on_message(sock.recv_multipart(zmq.NOBLOCK, copy=False))
            if sock.closed:  # the callback closed it
                return
        self._look()  # more may be waiting: the next turn

    def close(self) -> None:
        if not self.sock.closed:
            self.loop.remove_reader(self.fd)
            self.sock.close(linger=0)
