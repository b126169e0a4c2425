"""``gezel-trio serve`` as a group: one model split over two ranks on
loopback (the ring backend), rank 0 serving HTTP (``mlx.group``). The ranks
are started as ``mlx.launch`` starts them; the tests about the launch (the
hybrid model's split, a killed or stalled rank) run ``mlx.launch`` itself.

- Greedy answers are the ones a single process gives, one stream and
  several at once, and a request that reuses the prompt cache (its
  blocks held on both ranks) answers the same again, after a background
  wave parked and resumed beside an interactive request and a stream whose
  client disconnected was withdrawn on every rank.
- A sampled request's tokens agree across the ranks (each order carries
  rank 0's digest of its last step; a rank that parted exits non-zero).
- SIGTERM to rank 0 drains it, and it stops every rank: all exit 0.
- ``/health`` names the group.
- A rank killed mid-stream fails the live stream and ends the group in
  bounded time: rank 0 sees the rank's order connection close even while
  its host thread still waits in a collective; a rank that stalls
  (SIGSTOP) makes rank 0 answer 503 and exit 1 after ``--group-timeout``.
- Rank 0 killed (SIGKILL): the other rank's order connection closes and
  it exits 1 on its own (without the launcher, which would stop it anyway).
- A model that cannot be split is refused by name (an image model too,
  and rank 0's backend outside a group); the split by layers
  keeps the model's weights and output as they were, on a group of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.support.process import FIXED, Server

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
HANG = 120


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
        return base
    raise AssertionError("no free ports")


class Group(Server):
    """Rank 0's server, and each rank's process: its own (``ranks``), or
    ``mlx.launch``'s descendants (``proc`` is then the launcher)."""

    def __init__(
        self,
        url: str,
        proc: subprocess.Popen[str],
        ranks: list[subprocess.Popen[str]],
        hostfile: Path | None,
    ) -> None:
        super().__init__(url, proc)
        self.ranks = ranks
        self._hostfile = hostfile

    def pid(self, rank: int) -> int:
        return self.ranks[rank].pid if self.ranks else _rank_pid(self.proc.pid, rank)

    def wait(self, timeout: float) -> int:
        """The group's exit status once every rank has exited: the
        launcher's, or the first non-zero one of the ranks'."""
        if not self.ranks:
            return self.proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in self.ranks]
        return next((c for c in codes if c != 0), 0)

    def close(self) -> None:
        """Kill what still runs: each rank, and under ``mlx.launch`` first the
        ranks it started (killing the launcher alone would orphan them)."""
        self.client.close()
        if not self.ranks:
            for rank in (0, 1):
                with contextlib.suppress(AssertionError, ProcessLookupError):
                    os.kill(_rank_pid(self.proc.pid, rank), signal.SIGKILL)
        for p in self.ranks or [self.proc]:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        if self._hostfile is not None:
            self._hostfile.unlink(missing_ok=True)


def _launch(
    model: Path, *args: str, stderr: Any = subprocess.DEVNULL, launcher: bool = False
) -> Group:
    """Two ranks on loopback (on a free port range for the ring): started
    as ``mlx.launch`` starts them (a hostfile, ``MLX_HOSTFILE`` and
    ``MLX_RANK``), or with ``launcher`` by ``mlx.launch`` itself as the
    README does. The launcher's relay spins on each rank's stdin, which
    made a group on these 2 cores 3x slower to answer (docs/scale-out.md),
    so only the tests that are about the launch use it."""
    base = _free_ports(2)
    serve = [str(BIN / "gezel-trio"), "serve", "--model", str(model), "--port", "0", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ranks: list[subprocess.Popen[str]] = []
    hostfile = None
    if launcher:
        ring = ["--backend", "ring", "--hosts", "127.0.0.1", "-n", "2"]
        command = [str(BIN / "mlx.launch"), *ring, "--starting-port", str(base), *serve]
        procs = [_popen(command, env, stderr)]
    else:
        fd, name = tempfile.mkstemp(prefix="gezel-group-", suffix=".json")
        os.close(fd)
        hostfile = Path(name)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(2)]))
        ranks = procs = [
            _popen(serve, {**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)}, stderr)
            for r in range(2)
        ]
    proc = procs[0]
    assert proc.stdout is not None
    for line in proc.stdout:
        if "gezel-trio listening on " in line:
            return Group(line.split()[-1], proc, ranks, hostfile)
    for p in procs:
        p.kill()
    if hostfile is not None:
        hostfile.unlink()
    raise AssertionError(f"rank 0 exited with {proc.wait()} before listening")


def _popen(command: list[str], env: dict[str, str], stderr: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        start_new_session=True,
    )


def _answer(server: Server, content: str, **extra: object) -> str:
    # 12 tokens: each one is a step's argmax compared with one process's; a
    # group's step costs 60-300 ms of both cores here (tensor, SmolLM2).
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 12,
            "temperature": 0,
            **FIXED,
            **extra,
        },
        timeout=HANG,
    )
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["message"]["content"]
    return text


PROMPTS = ["the group splits the heads", "two ranks on loopback", "every rank steps " * 20]


def _streamed(content: str, max_tokens: int, **extra: object) -> dict[str, object]:
    """A greedy streamed chat request's body."""
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **FIXED,
        **extra,
    }


def _walk_away(server: Server) -> None:
    """A streamed request whose client reads a few chunks and disconnects:
    rank 0 withdraws it (a ``remove`` order to every rank)."""
    body = _streamed("a long answer, then a disconnect", 400)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=HANG) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break


def _background(server: Server, decoding: threading.Event) -> tuple[str, bool]:
    """A background-priority stream: its text, and whether the server said
    it was parked and resumed (its ``: parked`` and ``: resumed`` frames);
    ``decoding`` is set once it has written a few tokens."""
    # 240 tokens: on one process (1.4 ms a step here) the interactive
    # request arrived 9-117 steps in over 8 tries; each step under the
    # tensor split costs ~60 ms on the loaded 2-core machine.
    body = _streamed(PROMPTS[2], 240, priority="background")
    pieces: list[str] = []
    comments: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=HANG) as r:
        for line in r.iter_lines():
            if line.startswith(": "):
                comments.append(line[2:])
            elif line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices:
                    pieces.append(choices[0]["delta"].get("content") or "")
                if len(pieces) == 4:
                    decoding.set()
    decoding.set()
    return "".join(pieces), "parked" in comments and "resumed" in comments


def _answers(server: Server) -> list[str]:
    alone = [_answer(server, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _answer(server, p), PROMPTS))
    # A background wave parked while an interactive request runs, then
    # resumed: on every rank the lane stops and resumes at the same step.
    decoding = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        background = pool.submit(_background, server, decoding)
        assert decoding.wait(HANG)
        interactive = _answer(server, PROMPTS[1])
        text, parked = background.result()
    assert parked  # the wave really was parked and resumed
    waves = [text, interactive]
    # A withdrawn stream leaves every rank as it left rank 0: the next
    # answers still agree (a rank that parted would stop the group).
    _walk_away(server)
    again = _answer(server, PROMPTS[-1])  # from the prompt cache
    return [*alone, *together, *waves, again, _answer(server, PROMPTS[0])]


def test_split_by_layers_two_ranks_answer_as_one_process_does(
    smollm2_model: Path, smollm2_server: Server
) -> None:
    """SmolLM2's 9 heads do not divide between 2 ranks: each rank runs
    half its layers (``auto`` chooses it), and the arithmetic is one
    process's, layer for layer (two answers at once; the dense model's
    tests also answer one at a time)."""
    want = [_answer(smollm2_server, p) for p in PROMPTS[:2]]
    group = _launch(smollm2_model)
    try:
        health = httpx.get(f"{group.url}/health", timeout=HANG).json()
        assert health["group"]["split"].startswith("by layers over 2 ranks"), health
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda p: _answer(group, p), PROMPTS[:2])) == want
    finally:
        _stop(group)


def test_the_hybrid_model_split_by_layers_answers_as_one_process_does(
    hybrid_model: Path, hybrid_server: Server
) -> None:
    """The Qwen 3.5-style hybrid demo model (linear-attention layers, whose
    state cannot be cut into blocks): mlx-lm's tensor split would cut its
    untied head by vocabulary (2,173 tokens, odd), so ``auto`` splits it by
    layers with mlx-lm's own pipeline. Answers alone, together, and from
    the prompt cache (an entry's linear-attention state, held on each rank
    for its own layers) are one process's."""
    want = [_answer(hybrid_server, p) for p in PROMPTS]
    group = _launch(hybrid_model, launcher=True)  # as the README starts a group
    try:
        health = httpx.get(f"{group.url}/health", timeout=HANG).json()
        assert health["group"]["split"].startswith("by layers over 2 ranks"), health
        assert [_answer(group, p) for p in PROMPTS] == want
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda p: _answer(group, p), PROMPTS)) == want
        text, cached = _turn(group, PROMPTS[-1], max_tokens=12)
        assert cached > 0
        assert text == want[-1]
    finally:
        _stop(group)


def _stop(group: Group) -> None:
    # SIGTERM to rank 0: it drains, then closes the other rank.
    try:
        os.kill(group.pid(0), signal.SIGTERM)
        assert group.wait(HANG) == 0
    finally:
        group.close()


@pytest.fixture(scope="module")
def one_process_answers(dense_server: Server) -> list[str]:
    """``_answers`` from one process: what each split's group must answer."""
    return _answers(dense_server)


@pytest.mark.parametrize("split", ["tensor", "layers"])
def test_two_ranks_answer_as_one_process_does(
    dense_model: Path, one_process_answers: list[str], split: str
) -> None:
    want = one_process_answers
    group = _launch(dense_model, "--group-split", split)
    try:
        health = httpx.get(f"{group.url}/health", timeout=HANG).json()
        assert health["group"]["world_size"] == 2, health
        assert health["group"]["split"].startswith(
            "tensor-parallel" if split == "tensor" else "by layers"
        ), health
        assert _answers(group) == want
        # Each rank's last step, as it told rank 0 (the last one's word may
        # still be on its way when rank 0 goes idle).
        ranks = httpx.get(f"{group.url}/health", timeout=HANG).json()["group"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1], ranks
        assert ranks[0]["steps"] > 100, ranks
        assert ranks[0]["steps"] - 1 <= ranks[1]["steps"] <= ranks[0]["steps"], ranks
        # Sampled: the ranks draw alike, or a rank exits non-zero below.
        for _ in range(2):
            _answer(group, "sample me", temperature=1.0)
    finally:
        _stop(group)


def _turn(server: Server, content: str, max_tokens: int = 12) -> tuple[str, int]:
    """A greedy answer and how many of its prompt's tokens were cached."""
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **FIXED,
        },
        timeout=HANG,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


def _safetensors_metadata(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    header: dict[str, Any] = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    # mlx-lm's prompt-cache file: the caller's metadata is tree 0 of three.
    return {k[2:]: v for k, v in header["__metadata__"].items() if k.startswith("0.")}


def test_a_restarted_group_reads_each_ranks_cache_files(dense_model: Path, tmp_path: Path) -> None:
    """``--persist-dir`` under a group: rank 0's file holds its shard, and
    the other rank's shard is a file of its own beside it, naming its rank
    and the group's size. The same group restarted reads them back (the
    answer from them is the same); where one rank's shard is missing, the
    entry is a miss on every rank and the answer is still the same."""
    persist = tmp_path / "cache"
    prompt = "a conversation the group keeps on disk " * 12
    group = _launch(dense_model, "--persist-dir", str(persist))
    try:
        first, cached = _turn(group, prompt)
        assert cached == 0
    finally:
        _stop(group)  # SIGTERM: rank 0 writes its entries, every rank its shards
    (entry_dir,) = persist.glob("*-v*")
    entries = sorted(entry_dir.glob("*.gzc"))
    shards = sorted((entry_dir / "rank1of2").glob("*.safetensors"))
    assert entries
    assert [p.stem for p in shards] == [p.stem for p in entries]
    for path, rank in ((entries[0], "0"), (shards[0], "1")):
        meta = _safetensors_metadata(path)  # a sealed file begins with its payload
        assert (meta["gezel_rank"], meta["gezel_world_size"]) == (rank, "2"), meta

    group = _launch(dense_model, "--persist-dir", str(persist))
    try:
        again, cached = _turn(group, prompt)
        assert cached > 0
        assert again == first
    finally:
        _stop(group)

    for shard_file in (entry_dir / "rank1of2").glob("*.safetensors"):
        shard_file.unlink()
    group = _launch(dense_model, "--persist-dir", str(persist))
    try:
        # Rank 0 loads its own shard, rank 1 has none: neither keeps it.
        again, cached = _turn(group, prompt)
        assert cached == 0
        assert again == first
    finally:
        _stop(group)


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the launcher's descendant that runs ``rank``
    (``mlx.launch`` sets ``MLX_RANK`` in each rank's environment)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    todo = list(children.get(launcher, []))
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in env and b"gezel-trio" in cmdline:
            return pid
        todo += children.get(pid, [])
    raise AssertionError(f"no rank {rank} under {launcher}")


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_a_model_that_cannot_split_is_refused_by_name(
    dense_model: Path, hybrid_model: Path
) -> None:
    from mlx_lm.utils import load

    from gezel_trio.core.errors import ModelLoadError
    from gezel_trio.mlx.group import shard

    model, _ = load(str(dense_model))  # 4 heads, 2 key/value heads, 4 layers
    with pytest.raises(
        ModelLoadError,
        match=r"dense-tiny: cannot be split over 5 ranks: its 4 attention heads and 2 "
        r"key/value heads are not each a multiple of 5; its 4 layers are fewer than 5 ranks",
    ):
        shard(model, _Group(5), "dense-tiny")
    with pytest.raises(ModelLoadError, match=r"multiple of 3; --group-split tensor"):
        shard(model, _Group(3), "dense-tiny", "tensor")
    with pytest.raises(
        ModelLoadError, match=r"has no tensor-parallel split; no split by layers for"
    ):
        shard(object(), _Group(2), "thing")
    hybrid, _ = load(str(hybrid_model))
    with pytest.raises(
        ModelLoadError,
        match=r"its vocabulary of 2173 tokens \(the head's split\) is not a multiple of 2",
    ):
        shard(hybrid, _Group(2), "hybrid-tiny", "tensor")


def test_the_group_backend_wants_a_group_and_a_text_model(
    dense_model: Path, vision_model: Path
) -> None:
    """Rank 0's backend outside ``mlx.launch`` is refused before a model
    loads, and an image model is refused by name before it is split."""
    from gezel_trio.core.config import EngineConfig
    from gezel_trio.core.errors import ModelLoadError
    from gezel_trio.mlx import group_backend
    from gezel_trio.mlx.group import Sharding
    from gezel_trio.mlx.loading import load_model

    with pytest.raises(ModelLoadError, match=r"not started by mlx\.launch in a group"):
        group_backend(EngineConfig(model=dense_model))
    loaded = load_model(EngineConfig(model=vision_model))
    with pytest.raises(
        ModelLoadError, match=rf"{vision_model.name}: an image model is not split over ranks"
    ):
        Sharding(_Group(2))(loaded)


def test_the_split_by_layers_keeps_the_model_as_it_was(dense_model: Path) -> None:
    """``pipeline`` on a group of one: the outer model's inner model is
    replaced, none of the loaded objects changes its class, the weights keep
    their paths, and a prefill and a step give the unsplit model's logits."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from gezel_trio.mlx.group import pipeline

    plain, _ = load(str(dense_model))
    split, _ = load(str(dense_model))
    inner = split.model
    kinds = {id(m): type(m) for _, m in split.named_modules()}
    said = pipeline(split, mx.distributed.init(strict=False))
    assert said == "by layers over 1 ranks: rank 0 runs layers 0-3"
    assert split.model is not inner
    assert all(type(m) is kinds[id(m)] for _, m in inner.named_modules())
    assert [k for k, _ in tree_flatten(split.parameters())] == [
        k for k, _ in tree_flatten(plain.parameters())
    ]
    plain_cache, split_cache = make_prompt_cache(plain), make_prompt_cache(split)
    for tokens in ([5, 7, 9, 11, 13], [3]):
        want = plain(mx.array([tokens]), cache=plain_cache)
        assert mx.array_equal(split(mx.array([tokens]), cache=split_cache), want)


def _stream_until_it_ends(server: Server, started: threading.Event) -> str:
    """A long streamed answer; how it ended: ``done``, ``error`` (an error
    frame) or ``cut`` (the connection closed without either)."""
    body = _streamed("go on and on", 4000)
    try:
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, timeout=HANG
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if '"error"' in line:
                        return "error"
                    started.set()
                if line == "data: [DONE]":
                    return "done"
    except httpx.HTTPError:
        return "cut"
    return "cut"


def _ended(server: Server, stderr: Path, within: float) -> str:
    """Wait for the launcher to exit; what it said of rank 0."""
    server.client.close()
    try:
        server.proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the group still ran {within:g} s later; it said:\n{stderr.read_text()}"
        ) from None
    finally:
        assert server.proc.stdout is not None
        server.proc.stdout.close()
    return stderr.read_text()


def test_a_killed_rank_fails_the_live_stream_and_ends_the_group(
    dense_model: Path, tmp_path: Path
) -> None:
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        group = _launch(dense_model, stderr=err, launcher=True)
    started = threading.Event()
    try:
        with ThreadPoolExecutor(1) as pool:
            ending = pool.submit(_stream_until_it_ends, group, started)
            assert started.wait(HANG)
            os.kill(group.pid(1), signal.SIGKILL)
            t0 = time.monotonic()
            assert ending.result(timeout=30) == "error"
        said = _ended(group, stderr, within=30)
    except BaseException:
        group.close()  # no rank outlives a failed test into the next one
        raise
    assert time.monotonic() - t0 < 30
    assert "rank 1" in said


def test_a_stalled_rank_makes_rank_0_answer_503_and_exit(dense_model: Path, tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        group = _launch(dense_model, "--group-timeout", "3", stderr=err, launcher=True)
    follower = group.pid(1)
    started = threading.Event()
    try:
        with ThreadPoolExecutor(1) as pool:
            ending = pool.submit(_stream_until_it_ends, group, started)
            assert started.wait(HANG)
            os.kill(follower, signal.SIGSTOP)
            t0 = time.monotonic()
            codes = set()
            while time.monotonic() - t0 < 20:
                try:
                    r = httpx.get(f"{group.url}/health", timeout=2)
                except httpx.HTTPError:
                    break  # rank 0 has exited
                codes.add(r.status_code)
                if r.status_code == 503:
                    break
                time.sleep(0.2)  # polling a probe, as a load balancer does
            # Between the watchdog and the exit (5 s): draining, 503.
            assert 503 in codes, codes
            assert ending.result(timeout=30) == "error"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower, signal.SIGCONT)
            os.kill(follower, signal.SIGKILL)
    said = _ended(group, stderr, within=30)
    assert "have not answered for 3 s" in said
    assert time.monotonic() - t0 < 30


def test_a_rank_whose_rank_0_was_killed_exits_on_its_own(dense_model: Path) -> None:
    group = _launch(dense_model)
    try:
        group.ranks[0].kill()
        group.ranks[0].wait()
        assert group.ranks[1].wait(timeout=30) == 1
    finally:
        group.close()


class _OneRank:
    """A group of one, for a ``Wire`` whose connections a test makes."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def test_rank_0_sees_a_rank_close_its_connection_while_its_host_thread_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gezel_trio.mlx.group.rank0 import _Watchdog
    from gezel_trio.mlx.group.wire import GroupLost, Wire

    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    wire = Wire(_OneRank(), stream=None)
    pairs = [socket.socketpair() for _ in range(2)]
    wire._peers = [mine for mine, _ in pairs]
    try:
        assert wire.closed_peer() is None
        pairs[0][1].sendall((7).to_bytes(8, "big"))  # an ack, not read yet
        assert wire.closed_peer() is None
        pairs[0][1].close()  # rank 1 dies with its last ack unread
        assert wire.closed_peer() == 1

        told: list[BaseException] = []
        reported = threading.Event()
        watchdog = _Watchdog(limit=600.0, gone=wire.closed_peer)
        watchdog.report = lambda failure: (told.append(failure), reported.set())
        try:
            with watchdog.guard():  # the host thread waits in a collective
                assert reported.wait(HANG)
        finally:
            watchdog.close()  # before its grace ends in os._exit
        assert isinstance(told[0], GroupLost)
        assert "rank 1 of the group closed its connection" in str(told[0])
    finally:
        for mine, theirs in pairs:
            mine.close()
            theirs.close()
