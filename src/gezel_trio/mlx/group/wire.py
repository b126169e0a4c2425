"""The orders rank 0 sends the other ranks, and how they travel: a TCP
connection from each rank to rank 0 over the ring backend, ``all_sum``s
over the group otherwise."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import pickle
import select
import socket
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from ...core.errors import EngineFailure

__all__ = ["GroupLost", "Order", "Wire", "log_times"]

log = logging.getLogger("gezel_trio.mlx")


class GroupLost(EngineFailure):
    """A rank of the group stopped answering: nothing more can be computed."""


@attrs.frozen
class Order:
    """One call for every rank: its name and arguments (states by
    number), the states rank 0 let go of, rank 0's count of states made
    before the call, and the digest of rank 0's last step."""

    name: str
    args: tuple[Any, ...]
    released: tuple[int, ...]
    made: int
    last_step: str | None
    # When rank 0 began sending it (``time.monotonic``: on one machine the
    # other ranks read the same clock, and log how long orders took).
    sent_at: float = 0.0


def _rank0_host() -> str | None:
    """Rank 0's address in the ring's hostfile (``MLX_HOSTFILE``, which
    ``mlx.launch`` writes); ``None`` where there is none (another backend)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        hosts = json.loads(Path(path).read_text())
        host, _, _ = str(hosts[0][0]).rpartition(":")
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None
    return host or None


# How long the ranks wait for each other's control connection at start.
_CONNECT_TIMEOUT = 120.0


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("rank 0 closed the connection")
        data += got
    return bytes(data)


class Wire:
    """Orders from rank 0 to the other ranks.

    Over the ring backend, on a TCP connection of their own from each rank
    to rank 0 (its address from the ring's hostfile, its port shared with
    one ``all_sum`` at start): a rank waiting for an order then sleeps in
    ``recv``, where the ring's ``all_sum`` would busy-wait a whole core
    (measured: 100% of a core for an idle follower). Otherwise the orders
    ride ``all_sum``s over the group (its size, then its bytes; the other
    ranks add zeros), as ``mlx_lm.server`` shares its requests."""

    def __init__(self, group: Any, stream: Any) -> None:
        self._group = group
        self._stream = stream
        self.lost: str | None = None
        self._peers: list[socket.socket] = []  # rank 0: one per other rank
        self._unread: dict[int, bytes] = {}  # rank 0: a part of an ack, by rank
        self._leader: socket.socket | None = None  # the other ranks: to rank 0
        host = _rank0_host()
        if host is not None:
            self._connect(host)

    def _connect(self, host: str) -> None:
        rank, size = int(self._group.rank()), int(self._group.size())
        listener = None
        port = 0
        if rank == 0:
            listener = socket.create_server((host, 0))
            listener.settimeout(_CONNECT_TIMEOUT)
            port = int(listener.getsockname()[1])
        port = int(np.array(self._sum(mx.array([port], dtype=mx.int64)))[0])
        if listener is not None:
            by_rank: dict[int, socket.socket] = {}
            with listener:
                while len(by_rank) < size - 1:
                    conn, _ = listener.accept()
                    conn.settimeout(_CONNECT_TIMEOUT)
                    by_rank[int.from_bytes(_exactly(conn, 4), "big")] = conn
            self._peers = [by_rank[r] for r in sorted(by_rank)]
            for conn in self._peers:
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            conn = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
            conn.sendall(rank.to_bytes(4, "big"))
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._leader = conn

    def _sum(self, a: mx.array) -> mx.array:
        if self.lost is not None:
            raise GroupLost(self.lost)
        try:
            with mx.stream(self._stream):
                out = mx.distributed.all_sum(a, group=self._group)
                mx.eval(out)
        except RuntimeError as exc:
            self.lost = f"a rank of the group was lost: {exc}"
            raise GroupLost(self.lost) from exc
        return out

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._peers:
            array = np.frombuffer(data, np.uint8)
            self._sum(mx.array([array.size], dtype=mx.int64))
            self._sum(mx.array(array))
            return
        if self.lost is not None:
            raise GroupLost(self.lost)
        frame = len(data).to_bytes(8, "big") + data
        try:
            for conn in self._peers:
                conn.sendall(frame)
        except OSError as exc:
            self.lost = f"a rank of the group was lost: {exc}"
            raise GroupLost(self.lost) from exc

    def receive(self) -> Any:
        if self._leader is None:
            size = int(np.array(self._sum(mx.array([0], dtype=mx.int64)))[0])
            data = np.array(self._sum(mx.zeros((size,), dtype=mx.uint8))).tobytes()
        else:
            try:
                size = int.from_bytes(_exactly(self._leader, 8), "big")
                data = _exactly(self._leader, size)
            except OSError as exc:
                self.lost = f"rank 0 was lost: {exc}"
                raise GroupLost(self.lost) from exc
        return pickle.loads(data)  # rank 0's own orders

    @property
    def connected(self) -> bool:
        """Orders travel on TCP connections (not ``all_sum``)."""
        return bool(self._peers) or self._leader is not None

    def ack(self, steps: int) -> None:
        """A rank other than 0: tell rank 0 it finished ``steps`` steps
        (over its connection; nothing without one)."""
        if self._leader is None:
            return
        try:
            self._leader.sendall(steps.to_bytes(8, "big"))
        except OSError as exc:
            self.lost = f"rank 0 was lost: {exc}"
            raise GroupLost(self.lost) from exc

    def acks(self) -> dict[int, int]:
        """Rank 0: the latest step count each other rank acknowledged since
        the last call, read without waiting."""
        out: dict[int, int] = {}
        for rank, conn in enumerate(self._peers, start=1):
            try:
                data = self._unread.get(rank, b"") + conn.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                continue  # a lost rank: the next collective says so
            whole = len(data) - len(data) % 8
            self._unread[rank] = data[whole:]
            if whole:
                out[rank] = int.from_bytes(data[whole - 8 : whole], "big")
        return out

    def closed_peer(self) -> int | None:
        """Rank 0: the first other rank whose order connection its peer
        closed (the rank exited or was killed), read without waiting or
        consuming anything; ``None`` while every one is open. Safe on any
        thread: it only polls."""
        if not self._peers:
            return None
        hangup = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
        poller = select.poll()
        by_fd: dict[int, int] = {}
        try:
            for rank, conn in enumerate(self._peers, start=1):
                fd = conn.fileno()
                if fd < 0:
                    return None  # rank 0 is closing the wire
                by_fd[fd] = rank
                poller.register(fd, hangup | select.POLLIN)
            events = poller.poll(0)
        except (OSError, ValueError):
            return None
        for fd, event in events:
            if event & hangup:
                return by_fd[fd]
            if not hasattr(select, "POLLRDHUP") and self._at_end(self._peers[by_fd[fd] - 1]):
                return by_fd[fd]
        return None

    @staticmethod
    def _at_end(conn: socket.socket) -> bool:
        """Where the kernel has no ``POLLRDHUP``: a readable connection
        with nothing to read is closed (acks still unread hide it until
        the host thread reads them)."""
        try:
            return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def count(self, flag: int) -> int:
        """The sum of every rank's ``flag``: how many ranks raised theirs."""
        return int(np.array(self._sum(mx.array([flag], dtype=mx.int64)))[0])

    def seed(self) -> int:
        """One random seed for every rank: rank 0's."""
        mine = int(np.random.default_rng().integers(1, 2**31)) if self._group.rank() == 0 else 0
        return int(np.array(self._sum(mx.array([mine], dtype=mx.int64)))[0])

    def close(self) -> None:
        for conn in (*self._peers, *([self._leader] if self._leader else [])):
            with contextlib.suppress(OSError):
                conn.close()


def log_times(line: str, record: collections.deque[float], *args: Any) -> None:
    """``line`` logged with ``args``, the count, median and p90 of ``record``
    (seconds, shown in microseconds)."""
    if not record:
        return
    times = sorted(record)
    median, p90 = times[len(times) // 2], times[int(len(times) * 0.9)]
    log.info("group orders: " + line, *args, len(times), 1e6 * median, 1e6 * p90)
