"""One model over the ranks of an ``mlx.distributed`` group (``mlx.launch``).

Under ``mlx.launch`` every rank runs ``gezel-trio serve`` with the same
flags. Each loads the model and keeps its part of it (``shard``: mlx-lm's
tensor-parallel split where the model's class has one and its heads divide
the group, else a run of layers per rank, ``pipeline``). Rank 0 runs
everything else: HTTP, the scheduler, the host
loop and its prompt-cache index. Its backend is a ``GroupBackend``: every
backend call that changes what the ranks hold or computes with the model
(``insert``, ``step``, ``remove``, captures and the cache's block copies)
is first sent to the other ranks as an order, then run on rank 0's own
``MlxBackend``. The other ranks run ``follow``: the same calls, in the same
order, on their own ``MlxBackend``, so every forward pass meets its
collectives on every rank.

**States.** A cache state (a captured sequence, a block, a seed) is one
shard per rank. Rank 0's prompt cache holds ``Held`` handles; each rank
keeps its own shard of the same state under the handle's number (a
``_Table``), numbered in the order calls return them, which is the same on
every rank because every rank ran the same calls. A handle rank 0 lets go
of is dropped on every rank with the next order.

**Agreement.** Greedy tokens agree because every rank computes the same
all-reduced logits. Sampled ones agree because every rank seeds MLX's
random state from rank 0's at start and then draws in the same order.
Speculation is off under a group (its gate decides from each rank's own
wall times, and its rejection sampling draws from numpy). Each order
carries rank 0's count of states made so far and a digest of the tokens
of its last step; a rank whose own differ stops with an error naming the
step, instead of computing on with another text.

**A rank that fails.** A rank that exits closes its sockets, and rank 0's
next collective raises: the group is lost (``GroupLost``, an engine
failure), every live request fails with it, later calls raise it at once,
and the server exits 1; ``mlx.launch`` also stops the group when a rank
exits non-zero. A rank that stalls (alive, not answering) would hold rank
0 in its collective for good, so a watchdog (``--group-timeout``) times
each call sent to the group: past the limit rank 0 fails every request (the
engine's ``die``: ``/health`` answers 503), and exits 1 a few seconds
later, whatever its host thread is blocked in.

**The wire.** An order is pickled and sent over a TCP connection from
each rank to rank 0 (opened at start: rank 0's address from the ring's
hostfile, its port shared with one ``all_sum``), so a rank waiting for
work sleeps in ``recv``: waiting in the ring's ``all_sum`` busy-waits a
whole core. Without a hostfile (another backend) the orders ride
``all_sum``s over a byte array (its size, then its bytes; the other ranks
add zeros), as ``mlx_lm.server`` shares its requests.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from ..core.backend import (
    Admission,
    BackendFigures,
    Captured,
    Detokenizer,
    RankStep,
    StepOutput,
)
from ..core.errors import EngineFailure, ModelLoadError
from ..core.model import ModelInfo
from ..core.request import Priority
from ..core.shared_dir import temp_is_stale, temp_name

__all__ = ["GroupBackend", "GroupLost", "Held", "follow", "rank_group", "shard"]

log = logging.getLogger("gezel_trio.mlx")


def rank_group() -> Any | None:
    """The ``mlx.distributed`` group this process was launched in (by
    ``mlx.launch``), or ``None`` when it runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init(strict=False)
    return group if group.size() > 1 else None


def shard(model: Any, group: Any, name: str, how: str = "auto") -> str:
    """Split ``model`` over ``group`` in place; says how: tensor-parallel
    (mlx-lm's ``shard``) where the class has it and the heads divide, else
    by layers (``pipeline``); ``how`` (``--group-split``) may ask for one.
    A model that cannot be split as asked is refused by name
    (``ModelLoadError``)."""
    n = group.size()
    tensor = _tensor_blocker(model, n) if how != "layers" else "--group-split layers"
    if tensor is None:
        try:
            model.shard(group)
        except AssertionError as exc:  # mlx-lm's own check, past ours
            raise ModelLoadError(
                f"{name}: mlx-lm's tensor-parallel split refused it ({exc}); "
                "try --group-split layers"
            ) from exc
        mx.eval(model.parameters())
        return f"tensor-parallel over {n} ranks"
    layers = _pipeline_blocker(model, n) if how != "tensor" else "--group-split tensor"
    if layers is None:
        split = pipeline(model, group)
        mx.eval(model.parameters())
        return split
    raise ModelLoadError(f"{name}: cannot be split over {n} ranks: {tensor}; {layers}")


def _tensor_blocker(model: Any, n: int) -> str | None:
    if not hasattr(model, "shard"):
        kind = f"{type(model).__module__}.{type(model).__name__}"
        return f"its mlx-lm class {kind} has no tensor-parallel split"
    # A vision-language export keeps its text model's settings apart.
    text = getattr(model, "language_model", model)
    args = getattr(text, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    if heads is not None and (heads % n or (kv_heads or 0) % n):
        return (
            f"its {heads} attention heads and {kv_heads} key/value heads are not "
            f"each a multiple of {n}"
        )
    vocab = getattr(args, "vocab_size", None)
    # Where mlx-lm splits an untied head by vocabulary (the class gathers
    # its logits over a ``sharding_group``), the vocabulary must divide.
    untied = not getattr(args, "tie_word_embeddings", True)
    if hasattr(text, "sharding_group") and untied and vocab and vocab % n:
        return f"its vocabulary of {vocab} tokens (the head's split) is not a multiple of {n}"
    return None


# The inner models whose forward pass ``_pipelined`` reproduces (embed,
# masks, layers, norm), and those mlx-lm splits by layers itself.
_OWN_PIPELINE = {"mlx_lm.models.llama.LlamaModel"}


def _pipeline_blocker(model: Any, n: int) -> str | None:
    inner = getattr(model, "model", None)
    kind = f"{type(inner).__module__}.{type(inner).__name__}"
    if inner is None or (kind not in _OWN_PIPELINE and not hasattr(inner, "pipeline")):
        return f"no split by layers for {kind}"
    if len(inner.layers) < n:
        return f"its {len(inner.layers)} layers are fewer than {n} ranks"
    return None


def pipeline(model: Any, group: Any) -> str:
    """Split ``model`` by layers over ``group``: each rank keeps a run of
    consecutive layers (rank 0 the last ones, as mlx-lm's ``PipelineMixin``
    splits), every rank the embedding, the final norm and the head. A
    forward pass enters at the highest rank, each rank hands its hidden
    state down to the next (``send``/``recv``), and rank 0's output is
    gathered to every rank, so every rank computes the same logits; the
    arithmetic is one process's, layer for layer."""
    inner = model.model
    n, rank = group.size(), group.rank()
    kind = f"{type(inner).__module__}.{type(inner).__name__}"
    if kind not in _OWN_PIPELINE:
        inner.pipeline(group)
        start, end = inner.start_idx, inner.end_idx
        return f"by layers over {n} ranks: rank {rank} runs layers {start}-{end - 1}"
    count = len(inner.layers)
    base, extra = divmod(count, n)
    sizes = [base + (1 if r < extra else 0) for r in range(n)]
    start = sum(sizes[rank + 1 :])
    end = start + sizes[rank]
    inner.layers = inner.layers[start:end]
    inner.fa_idx = next((i for i, la in enumerate(inner.layers) if not la.use_sliding), 0)
    inner.swa_idx = next((i for i, la in enumerate(inner.layers) if la.use_sliding), None)
    inner.group, inner.rank, inner.size = group, rank, n
    inner.__class__ = type(
        f"Pipelined{type(inner).__name__}",
        (type(inner),),
        {
            "__call__": _pipelined,
        },
    )
    return f"by layers over {n} ranks: rank {rank} runs layers {start}-{end - 1}"


def _pipelined(
    self: Any, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
) -> mx.array:
    """A llama-style inner model's forward pass over its run of layers."""
    from mlx_lm.models.base import create_attention_mask

    h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
    if cache is None:
        cache = [None] * len(self.layers)
    fa_mask = create_attention_mask(h, cache[self.fa_idx])
    swa_mask = None
    if self.swa_idx is not None:
        swa_mask = create_attention_mask(h, cache[self.swa_idx], window_size=self.sliding_window)
    if self.rank < self.size - 1:
        h = mx.distributed.recv_like(h, self.rank + 1, group=self.group)
    for layer, c in zip(self.layers, cache, strict=True):
        h = layer(h, swa_mask if layer.use_sliding else fa_mask, cache=c)
    if self.rank != 0:
        h = mx.distributed.send(h, self.rank - 1, group=self.group)
        last = cache[-1]
        if last is not None and last.keys is not None:
            # A prefill evaluates only the caches: the send must be part of
            # what they depend on, or the rank below waits for it forever.
            keys = last.keys
            if isinstance(keys, tuple):
                last.keys = (mx.depends(keys[0], h), *keys[1:])
            else:
                last.keys = mx.depends(keys, h)
    h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
    out: mx.array = self.norm(h)
    return out


# --- states held on every rank ------------------------------------------------------


@attrs.define(eq=False)
class Held:
    """Rank 0's handle on a state each rank holds its shard of: ``local``
    is rank 0's shard, ``number`` names the others'."""

    number: int
    local: Any


@attrs.define
class _Table:
    """The states this rank holds, by number, and the next number: every
    rank numbers the states its calls return in the same order."""

    held: dict[int, Any] = attrs.Factory(dict)
    made: int = 0

    def keep(self, state: Any) -> int:
        number = self.made
        self.made += 1
        self.held[number] = state
        return number


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with each state in it replaced by ``leaf(state)``: the
    states a backend call takes or returns, in one fixed order."""
    if isinstance(value, StepOutput):
        tokens = tuple(
            attrs.evolve(t, state=leaf(t.state)) if t.state is not None else t for t in value.tokens
        )
        return attrs.evolve(value, tokens=tokens)
    if isinstance(value, Captured):
        return attrs.evolve(value, state=leaf(value.state))
    if isinstance(value, Admission):
        seed = value.seed_state
        return attrs.evolve(value, seed_state=leaf(seed)) if seed is not None else value
    raise TypeError(f"no states known in {type(value).__name__}")


# The calls that go to every rank, and how their arguments and results hold
# states. ``args``: "state" an argument that is one, "states" a sequence of
# them, "admissions" Admissions with seeds, "" none. ``result``: how the
# result holds them.
_CALLS: dict[str, tuple[tuple[str, ...], str]] = {
    "insert": (("admissions",), ""),
    "remove": (("",), "captured_by_rid"),
    "capture": (("",), "captured"),
    "state_blocks": (("state", ""), "blocks"),
    "state_rest": (("state",), "rest"),
    "join_state": (("states", "", "state"), "state"),
    "step": (("",), "step"),
    "reset": (("",), ""),
    "reclaim": ((), ""),
}
# Of those, the calls of the backend's state codec (``states``).
_STATE_CALLS = frozenset({"state_blocks", "state_rest", "join_state"})


def _method(local: Any, name: str) -> Any:
    """The local backend's method that runs the call ``name``."""
    return getattr(local.states if name in _STATE_CALLS else local, name)


def _in(kind: str, value: Any, leaf: Callable[[Any], Any]) -> Any:
    if kind == "state":
        return leaf(value) if value is not None else None
    if kind == "states":
        return [leaf(v) for v in value]
    if kind == "admissions":
        return [_walk(a, leaf) for a in value]
    return value


def _out(kind: str, value: Any, leaf: Callable[[Any], Any]) -> Any:
    if kind == "state":
        return leaf(value)
    if kind == "rest":
        state, nbytes = value
        return (leaf(state) if state is not None else None), nbytes
    if kind == "blocks":
        return [(leaf(block), nbytes) for block, nbytes in value]
    if kind == "captured":
        return _walk(value, leaf) if value is not None else None
    if kind == "captured_by_rid":
        return {rid: _walk(c, leaf) for rid, c in value.items()}
    if kind == "step":
        return _walk(value, leaf)
    return value


def _digest(out: StepOutput) -> str:
    """What a step emitted, to compare across ranks."""
    seen = [(t.rid, t.token, t.finish) for t in out.tokens]
    return hashlib.sha256(repr(seen).encode()).hexdigest()[:16]


@attrs.frozen
class _Order:
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


class GroupLost(EngineFailure):
    """A rank of the group stopped answering: nothing more can be computed."""


# How long a stopping rank 0 drains before it exits anyway: its host thread
# may be blocked in a collective that never returns.
_GRACE = 5.0


class _Watchdog:
    """Rank 0's deadline on each backend call sent to the group (its
    order's collectives, which wait for the step in flight, and the call's
    own): past ``limit`` seconds it fails every request through the
    engine (``report``; without one, SIGTERM to this process) and exits 1
    ``_GRACE`` seconds later."""

    def __init__(self, limit: float) -> None:
        self._limit = limit
        self._since: float | None = None
        # The engine's way to fail every request (``FailsFromAfar``).
        self.report: Callable[[EngineFailure], None] | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="gezel-group-watchdog", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def guard(self) -> Any:
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        tick = min(1.0, self._limit / 4)
        while not self._closed.wait(tick):
            since = self._since
            if since is None or time.monotonic() - since <= self._limit:
                continue
            line = (
                f"gezel-trio: the group's other ranks have not answered for {self._limit:g} s "
                "(a rank stalled): stopping"
            )
            log.error("%s", line)
            print(line, file=sys.stderr, flush=True)
            if self.report is not None:
                # Every request fails now, and /health answers 503.
                self.report(GroupLost(line.removeprefix("gezel-trio: ")))
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            # The host thread is blocked in the collective for good: exit
            # once the failed requests have been told.
            if not self._closed.wait(_GRACE):
                os._exit(1)
            return


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


class _Wire:
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


class GroupBackend:
    """Rank 0's backend: each call that changes what the ranks hold is an
    order to every rank first (see the module)."""

    def __init__(self, local: Any, group: Any, stream: Any, timeout: float) -> None:
        self._local = local
        self._group = group
        self._watchdog = _Watchdog(timeout)
        self._wire = _Wire(group, stream)
        # States made so far: the next one's number (each rank counts alike).
        self._made = 0
        self._released: list[int] = []
        self._last_step: str | None = None
        # The time spent pickling and sending each order (the latest ones).
        self._sending: collections.deque[float] = collections.deque(maxlen=100_000)
        # Each rank's last step count and when rank 0 heard of it (/health).
        # Without order connections the other ranks cannot say (only rank 0).
        now = time.monotonic()
        reporting = range(self.world_size) if self._wire.connected else range(1)
        self._ranks = {r: RankStep(r, 0, now) for r in reporting}
        mx.random.seed(self._wire.seed())

    def on_failure(self, report: Callable[[EngineFailure], None]) -> None:
        self._watchdog.report = report

    # Read-only: rank 0 alone.
    @property
    def info(self) -> ModelInfo:
        info: ModelInfo = self._local.info
        return info

    @property
    def renderer(self) -> Any:
        return self._local.renderer

    @property
    def compiler(self) -> Any:
        return self._local.compiler

    @property
    def images(self) -> Any:
        return None

    @property
    def world_size(self) -> int:
        return int(self._group.size())

    def token_text(self, token: int) -> str:
        text: str = self._local.token_text(token)
        return text

    def decode(self, tokens: Sequence[int]) -> str:
        text: str = self._local.decode(tokens)
        return text

    def detokenizer(self, keep_leading_space: bool = False) -> Detokenizer:
        detok: Detokenizer = self._local.detokenizer(keep_leading_space)
        return detok

    def state_offsets(self, state: Any) -> list[int | None]:
        offsets: list[int | None] = self._local.states.state_offsets(_local(state))
        return offsets

    def memory_in_use(self) -> int:
        return int(self._local.memory_in_use())

    @property
    def states(self) -> GroupBackend:
        """Its own state codec: each state is a shard held on every rank."""
        return self

    def figures(self) -> BackendFigures:
        """Rank 0's figures, with each rank's last step."""
        now = time.monotonic()
        for rank, steps in self._wire.acks().items():
            self._ranks[rank] = RankStep(rank, steps, now)
        figures: BackendFigures = self._local.figures()
        return attrs.evolve(figures, ranks=tuple(self._ranks.values()))

    # Cache files: rank 0's shard in the file the disk cache seals, each
    # other rank's in a file of its own beside it (``_ShardFiles``).
    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        with self._watchdog.guard():
            self._send(
                "dump_shard", (_number(state), str(path.parent), metadata["gezel_file"], metadata)
            )
            self._local.states.dump_state(
                _local(state), {**metadata, **_shard_meta(0, self.world_size)}, path
            )

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        with self._watchdog.guard():
            self._send("load_shard", (str(path.parent), path.stem))
            # The check of a loaded state's shapes runs the model once (its
            # collectives with it): on every rank, before any file is read.
            self._local.states.ready_state_checks()
            try:
                state, meta = self._local.states.load_state(payload, path)
                _check_shard(meta, path.stem, 0, self.world_size)
            except Exception:
                self._wire.count(1)
                raise
            # Every rank says whether its shard loaded: all of them, or none.
            missing = self._wire.count(0)
        if missing:
            raise ValueError(f"{missing} of the group's other ranks hold no usable shard of it")
        return self._hold(state), meta

    def forget_state(self, path: Path) -> None:
        with self._watchdog.guard():
            self._send("forget_shard", (str(path.parent), path.stem))

    # Orders: every rank.
    def _call(self, name: str, *args: Any) -> Any:
        # The order's collectives and the call's own (a split layer's
        # all_sum in the step) wait on the other ranks: both are timed.
        with self._watchdog.guard():
            return self._order(name, *args)

    def _send(self, name: str, args: tuple[Any, ...]) -> None:
        start = time.monotonic()
        # Finalizers append as handles die, on whichever thread collects them.
        n = len(self._released)
        released = tuple(self._released[:n])
        del self._released[:n]
        self._wire.send(_Order(name, args, released, self._made, self._last_step, start))
        self._sending.append(time.monotonic() - start)

    def _order(self, name: str, *args: Any) -> Any:
        kinds, result = _CALLS[name]
        self._send(name, tuple(_in(k, a, _number) for k, a in zip(kinds, args, strict=True)))
        mine = tuple(_in(k, a, _local) for k, a in zip(kinds, args, strict=True))
        try:
            out = _method(self._local, name)(*mine)
        except RuntimeError as exc:
            if "[ring]" not in str(exc) and "distributed" not in str(exc):
                raise
            # A split layer's collective: a rank was lost mid-step.
            self._wire.lost = f"a rank of the group was lost: {exc}"
            raise GroupLost(self._wire.lost) from exc
        if name == "step":
            self._last_step = _digest(out)
            self._ranks[0] = RankStep(0, self._ranks[0].steps + 1, time.monotonic())
        return _out(result, out, self._hold)

    def _hold(self, state: Any) -> Held:
        held = Held(self._made, state)
        self._made += 1
        weakref.finalize(held, self._release, held.number)
        return held

    def _release(self, number: int) -> None:
        self._released.append(number)

    def insert(self, admissions: Sequence[Admission]) -> dict[int, Exception]:
        out: dict[int, Exception] = self._call("insert", list(admissions))
        return out

    def remove(self, rids: Sequence[int]) -> dict[int, Captured]:
        out: dict[int, Captured] = self._call("remove", list(rids))
        return out

    def capture(self, rid: int) -> Captured | None:
        out: Captured | None = self._call("capture", rid)
        return out

    def state_blocks(self, state: Any, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        out: list[tuple[Any, int]] = self._call("state_blocks", state, list(ranges))
        return out

    def state_rest(self, state: Any) -> tuple[Any, int]:
        out: tuple[Any, int] = self._call("state_rest", state)
        return out

    def join_state(self, blocks: Sequence[Any], length: int, rest: Any) -> Any:
        return self._call("join_state", list(blocks), length, rest)

    def step(self, lane: Priority) -> StepOutput:
        out: StepOutput = self._call("step", lane)
        return out

    def reset(self, lane: Priority) -> None:
        self._call("reset", lane)

    def reclaim(self) -> None:
        self._call("reclaim")

    def close(self) -> None:
        _log_times(
            "rank 0 sent %d orders, each %.1f us (median) / %.1f us (p90) to pickle and send",
            self._sending,
        )
        try:
            if self._wire.lost is None:
                self._wire.send(None)  # the other ranks close and exit
        finally:
            self._wire.close()
            self._watchdog.close()
            self._local.close()


def _number(state: Any) -> int:
    if not isinstance(state, Held):
        raise TypeError(f"a state from outside the group: {type(state).__name__}")
    return state.number


def _local(state: Any) -> Any:
    return state.local if isinstance(state, Held) else state


def _shard_meta(rank: int, size: int) -> dict[str, str]:
    return {"gezel_rank": str(rank), "gezel_world_size": str(size)}


def _check_shard(meta: dict[str, str], name: str, rank: int, size: int) -> None:
    """Raises unless ``meta`` is of rank ``rank``'s shard, in a group of
    ``size``, of the entry whose file is ``name``."""
    theirs = meta.get("gezel_rank"), meta.get("gezel_world_size")
    if theirs != (str(rank), str(size)):
        raise ValueError(
            f"written by rank {theirs[0]} of a group of {theirs[1]}, not rank {rank} of {size}"
        )
    if meta.get("gezel_file") != name:
        raise ValueError("a shard of another entry")


# A shard's temp file while it is written.
_TMP_SUFFIX = ".tmp.safetensors"


@attrs.define
class _ShardFiles:
    """A rank's own files of the states rank 0 persists: rank ``r`` of ``n``
    keeps its shard of the entry in ``DIR/NAME.gzc`` (rank 0's file, sealed
    by the disk cache) as ``DIR/rank{r}of{n}/NAME.safetensors``. ``DIR`` is
    rank 0's path: on other machines, the same path on theirs (the same
    ``--persist-dir``, as ``mlx.launch`` gives every rank the same flags)."""

    local: Any
    rank: int
    size: int
    swept: set[Path] = attrs.Factory(set)

    def path(self, directory: str, name: str) -> Path:
        return Path(directory) / f"rank{self.rank}of{self.size}" / f"{name}.safetensors"

    def dump(self, state: Any, directory: str, name: str, metadata: dict[str, str]) -> None:
        final = self.path(directory, name)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.parent not in self.swept:
            self.swept.add(final.parent)
            for old in final.parent.glob(".*" + _TMP_SUFFIX):
                if temp_is_stale(old):
                    old.unlink(missing_ok=True)
        tmp = final.with_name(temp_name(name, _TMP_SUFFIX))
        try:
            self.local.states.dump_state(
                state, {**metadata, **_shard_meta(self.rank, self.size)}, tmp
            )
            # No fsync: a shard torn by a crash fails its load, and the
            # entry is a miss on every rank (``load``).
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def load(self, directory: str, name: str) -> Any:
        path = self.path(directory, name)
        state, meta = self.local.states.load_state(path.read_bytes(), path)
        _check_shard(meta, name, self.rank, self.size)
        return state

    def forget(self, directory: str, name: str) -> None:
        self.path(directory, name).unlink(missing_ok=True)


class DivergedError(RuntimeError):
    """A rank computed other tokens (or made other states) than rank 0."""


# The orders of rank 0's disk cache (``GroupBackend.dump_state`` and the rest).
_FILE_ORDERS = frozenset({"dump_shard", "load_shard", "forget_shard"})


def _on_file_order(order: _Order, files: _ShardFiles, table: _Table, wire: _Wire) -> None:
    """A rank's part of rank 0's cache file work. A failed write or delete
    is logged and costs a later miss; a load is agreed: every rank holds
    the loaded state, or none does."""
    if order.name == "load_shard":
        files.local.states.ready_state_checks()  # as rank 0 does: the model runs once
        try:
            state = files.load(*order.args)
        except Exception as exc:
            log.warning("rank %d: no usable shard of %s: %s", files.rank, order.args[1], exc)
            state, failed = None, 1
        else:
            failed = 0
        if wire.count(failed) == 0:
            table.keep(state)
        return
    try:
        if order.name == "dump_shard":
            number, *rest = order.args
            files.dump(table.held[number], *rest)
        else:
            files.forget(*order.args)
    except Exception:
        log.exception(
            "rank %d: %s of %s failed",
            files.rank,
            order.name,
            order.args[2 if order.name == "dump_shard" else 1],
        )


def _log_times(line: str, record: collections.deque[float], *args: Any) -> None:
    """``line`` logged with ``args``, the count, median and p90 of ``record``
    (seconds, shown in microseconds)."""
    if not record:
        return
    times = sorted(record)
    median, p90 = times[len(times) // 2], times[int(len(times) * 0.9)]
    log.info("group orders: " + line, *args, len(times), 1e6 * median, 1e6 * p90)


def follow(local: Any, group: Any, stream: Any) -> None:
    """A rank other than 0: run rank 0's orders on ``local`` (its own
    ``MlxBackend``) until rank 0 closes; raises ``DivergedError`` where its
    own results part from rank 0's."""
    wire = _Wire(group, stream)
    table = _Table()
    mx.random.seed(wire.seed())
    rank = group.rank()
    files = _ShardFiles(local, int(rank), int(group.size()))
    last_step: str | None = None
    steps = 0
    # How long after rank 0 began sending a step's order this rank had it
    # (the latest ones: a long-lived rank keeps a bounded record).
    arrivals: collections.deque[float] = collections.deque(maxlen=100_000)
    try:
        while True:
            order: _Order | None = wire.receive()
            if order is None:
                _log_times(
                    "rank %d received %d step orders, each %.1f us (median) / %.1f us (p90) "
                    "after rank 0 began sending it",
                    arrivals,
                    int(rank),
                )
                return
            if order.name == "step":
                arrivals.append(time.monotonic() - order.sent_at)
            for number in order.released:
                table.held.pop(number, None)
            if order.made != table.made or (
                order.last_step is not None and order.last_step != last_step
            ):
                raise DivergedError(
                    f"rank {rank} parted from rank 0 after step {steps}: "
                    f"{table.made} states made against {order.made}, "
                    f"tokens {last_step} against {order.last_step}"
                )
            if order.name in _FILE_ORDERS:
                _on_file_order(order, files, table, wire)
                continue
            kinds, result = _CALLS[order.name]
            args = tuple(
                _in(k, a, table.held.__getitem__) for k, a in zip(kinds, order.args, strict=True)
            )
            try:
                out = _method(local, order.name)(*args)
            except Exception:
                # Rank 0's call raised too, or the next order says it did not.
                log.exception("rank %d: %s failed", rank, order.name)
                continue
            if order.name == "step":
                last_step = _digest(out)
                steps += 1
                wire.ack(steps)
            _out(result, out, table.keep)
    finally:
        wire.close()
        local.close()
