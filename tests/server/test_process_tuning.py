"""What the server process does once its engine runs (``server._tune_process``),
seen from outside the real ``gezel-trio serve``: its Trio thread (the main
thread) has the short scheduler slice and the host thread has not; the
objects start-up made are left out of garbage collection, as its log says.
``serve`` run in this process (other tests) changes neither. With
``--platform-tuning off`` it runs the plain path: no OpenBLAS, every
thread at the policy and nice the process started with, the default slice,
and it still answers."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from gezel_trio.tuning.sched import EVENT_LOOP_SLICE_NS, request_slice, slice_ns_of
from tests.support.process import terminate

pytestmark = pytest.mark.slow


def _threads(pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        out.setdefault(name, []).append(int(tid))
    return out


def _slices_here() -> bool:
    """Whether a thread of this machine can take a slice of its own (Linux
    6.12+, no sandbox refusing ``sched_setattr``), asked in a thread of
    this process that then ends."""
    said: list[str | None] = []
    probe = threading.Thread(target=lambda: said.append(request_slice(EVENT_LOOP_SLICE_NS)))
    probe.start()
    probe.join()
    return said == [None]


def test_the_served_process_tunes_its_trio_thread_and_its_garbage_collection(
    dense_model: Path, tmp_path: Path
) -> None:
    log = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "gezel_trio", "serve", "--model", str(dense_model)]
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*command, "--port", "0", "--log-level", "INFO"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith("gezel-trio listening on "):
                break
        else:
            raise AssertionError(f"exited with {proc.wait()} before listening")
        text = log.read_text()
        frozen = re.search(r"start-up's (\d+) objects left out of garbage collection", text)
        assert frozen is not None, text
        assert int(frozen[1]) > 10_000  # the modules, the model, the tokenizer
        if _slices_here():
            assert "the Trio thread: 100 us slices" in text
            assert slice_ns_of(proc.pid) == EVENT_LOOP_SLICE_NS  # the main thread
            (host,) = _threads(proc.pid)["gezel-mlx-host"][:1]
            assert slice_ns_of(host) != EVENT_LOOP_SLICE_NS  # not inherited
    finally:
        assert terminate(proc) == 0
        proc.stdout.close()


def test_serve_called_in_this_process_left_its_garbage_collection_alone() -> None:
    # Every other test that ran serve() here did not freeze this process.
    assert gc.get_freeze_count() == 0


def test_with_the_platform_tuning_off_the_served_process_runs_the_plain_path(
    dense_model: Path, tmp_path: Path
) -> None:
    log = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "gezel_trio", "serve", "--model", str(dense_model)]
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*command, "--port", "0", "--log-level", "INFO", "--platform-tuning", "off"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith("gezel-trio listening on "):
                bind = line.split()[-1]
                break
        else:
            raise AssertionError(f"exited with {proc.wait()} before listening")
        body = {"prompt": "The sky is", "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"{bind}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] == 4
        text = log.read_text()
        assert "platform tuning: off" in text, text
        # No BLAS beyond MLX's own: OpenBLAS was never loaded.
        assert "BLAS MLX's own (platform tuning off)" in text
        assert "libopenblas" not in Path(f"/proc/{proc.pid}/maps").read_text()
        assert "compute threads: normal" in text
        assert "decode threads: all, for every step" in text
        # Every thread at the policy and nice the process started with (its
        # main thread's, which the tuning never changes; the suite's own
        # process may have passed on SCHED_BATCH).
        policy = os.sched_getscheduler(proc.pid)
        nice = os.getpriority(os.PRIO_PROCESS, proc.pid)
        for tids in _threads(proc.pid).values():
            for tid in tids:
                assert os.sched_getscheduler(tid) == policy, tid
                assert os.getpriority(os.PRIO_PROCESS, tid) == nice, tid
        assert "the Trio thread: the default slice (platform tuning off)" in text
        if _slices_here():
            assert slice_ns_of(proc.pid) != EVENT_LOOP_SLICE_NS
    finally:
        assert terminate(proc) == 0
        proc.stdout.close()
