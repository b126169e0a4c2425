"""gezel-trio replicas behind an existing router: ``vllm-router`` from the
package index, as docs/scale-out.md sets it up.

- The router adds SGLang's per-request fields to every chat request it
  forwards (``no_stop_trim``, ``separate_reasoning`` ...): they are
  accepted at the values it sends, so its requests are answered.
- With consistent hashing on a session header, turn 2 of each
  conversation lands on the replica that served turn 1 and reads its
  prefix from that replica's prompt cache (each conversation's system
  prompt is its own, so only that replica holds it).
- A killed replica is routed around once the router's health check sees
  it gone: every conversation is answered again, by the live replica.
- With ``--policy kv_aware`` fed by each replica's KV events
  (``--kv-events``), a conversation's later turn goes to the replica whose
  events announced its prefix: its first turn was sent to that replica
  directly, so nothing but the events tells the router where it is.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgpack
import pytest
import zmq

from tests.support.process import start_server, stop_server

pytestmark = pytest.mark.slow

ROUTER = Path(sys.executable).parent / "vllm-router"
HANG = 60
# Conversations spread by consistent hashing over two replicas whose ports
# are random: with 6, all of them landed on one replica in one of six runs
# (1 in 32 if the hash spreads them evenly); with 12, 1 in 2048.
CONVERSATIONS = 12


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _router(workers: list[str], *policy: str) -> tuple[str, subprocess.Popen[bytes]]:
    """vllm-router in front of ``workers``; ``policy``: its flags that choose
    how it routes."""
    port = _port()
    proc = subprocess.Popen(
        [
            str(ROUTER),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            *policy,
            "--health-check-interval-secs",
            "1",
            "--prometheus-port",
            str(_port()),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline:  # the router says nothing when it is up
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "the router exited"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the router did not come up")


def _turn(url: str, conversation: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"x-session-id": f"conversation-{conversation}"},
        json={"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0},
        timeout=HANG,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _opening(conversation: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"agent {conversation}: " + "read the repository. " * 25},
        {"role": "user", "content": f"task {conversation}"},
    ]


def test_replicas_behind_vllm_router_keep_each_conversation_on_its_cache(
    dense_model: Path,
) -> None:
    replicas = [start_server(dense_model), start_server(dense_model)]
    url, router = _router([r.url for r in replicas], "--policy", "consistent_hash")
    try:
        served: dict[str, set[int]] = {r.url: set() for r in replicas}
        for c in range(CONVERSATIONS):
            messages = _opening(c)
            first = _turn(url, c, messages)
            answer = first["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "on"},
            ]
            second = _turn(url, c, messages)
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            # Turn 2 read turn 1's prefix: only the replica of turn 1 holds it.
            assert cached > 0.8 * second["usage"]["prompt_tokens"], second["usage"]
        for r in replicas:
            hits = httpx.get(f"{r.url}/metrics", timeout=HANG).text
            served[r.url] = {
                int(float(line.split()[1]))
                for line in hits.splitlines()
                if line.startswith("gezel_prefix_cache_hits_total ")
            }
        # Both replicas served conversations (the hash spread them).
        assert all(hits and max(hits) > 0 for hits in served.values()), served

        # One replica dies: once the router's health check sees it, every
        # conversation is answered by the other.
        dead = replicas[0]
        dead.proc.kill()
        dead.proc.wait()
        deadline = time.monotonic() + 30
        answered: set[int] = set()
        while len(answered) < CONVERSATIONS:
            assert time.monotonic() < deadline, f"answered {sorted(answered)} only"
            for c in range(CONVERSATIONS):
                r = httpx.post(
                    f"{url}/v1/chat/completions",
                    headers={"x-session-id": f"conversation-{c}"},
                    json={"model": "m", "messages": _opening(c), "max_tokens": 2},
                    timeout=HANG,
                )
                if r.status_code == 200:
                    answered.add(c)
            time.sleep(0.2)  # the router's health check runs every second
    finally:
        router.kill()
        router.wait()
        for r in replicas:
            if r.proc.poll() is None:
                assert stop_server(r) == 0
            elif r.proc.stdout is not None:
                r.proc.stdout.close()


def _stored(sub: zmq.Socket[bytes]) -> None:
    """Wait for a batch that announces blocks stored, on ``sub``."""
    deadline = time.monotonic() + HANG
    while True:
        left = max(0.0, deadline - time.monotonic())
        assert sub.poll(int(left * 1000)), "no BlockStored came"
        _topic, _seq, payload = sub.recv_multipart()
        _ts, events, _rank = msgpack.unpackb(payload)
        if any(e["type"] == "BlockStored" for e in events):
            return


def test_kv_aware_routing_follows_the_replicas_kv_events(dense_model: Path) -> None:
    ports = [_port(), _port()]
    replicas = [start_server(dense_model, "--kv-events", f"tcp://127.0.0.1:{p}") for p in ports]
    sources = [
        flag
        for r, p in zip(replicas, ports, strict=True)
        for flag in ("--kv-event-source", f"{r.url}=tcp://127.0.0.1:{p}")
    ]
    ctx = zmq.Context()
    router = None
    try:
        # vllm-router asks each replica's /tokenize for a request's tokens
        # and matches them against the blocks the events announced (64 tokens).
        url, router = _router(
            [r.url for r in replicas],
            "--policy",
            "kv_aware",
            *sources,
            "--kv-event-block-size",
            "64",
            "--kv-event-model",
            str(dense_model),
        )
        subs = []
        for p in ports:  # the test hears the events as the router does
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{p}")
            subs.append(sub)
        # Not alternating: round robin could not pass by chance.
        for c, i in enumerate((0, 1, 1, 0)):
            home, events = replicas[i], subs[i]
            while events.poll(0):  # what earlier turns announced
                events.recv_multipart()
            messages = _opening(c)
            first = httpx.post(
                f"{home.url}/v1/chat/completions",
                json={"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0},
                timeout=HANG,
            )
            assert first.status_code == 200, first.text
            # The router hears of the turn's blocks when the test does.
            _stored(events)
            messages += [
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "on"},
            ]
            second = _turn(url, c, messages)
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            # Only the replica that served turn 1 holds its prefix.
            assert cached > 0.8 * second["usage"]["prompt_tokens"], (c, second["usage"])
    finally:
        ctx.destroy(linger=0)
        if router is not None:
            router.kill()
            router.wait()
        for r in replicas:
            assert stop_server(r) == 0
