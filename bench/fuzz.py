"""Fuzz every route of a real gezel-trio server (issue 9), at length.

Usage (from the repository root)::

    python bench/fuzz.py [--examples 50000] [--model DIR] [--json OUT]

The same strategies and invariants as ``tests/test_fuzz.py``
(``tests/fuzzing.py``), run for ``--examples`` hypothesis examples (default
50,000) against one server on the tiny dense demo model (``--model`` for
another), while a healthy greedy stream loops beside the fuzzer. Reported:
examples run, responses by status, the invariant violations (status >= 500,
a missing error envelope, an engine error frame in a stream, ``/health``
not ok), the healthy stream's runs and mismatches, request latency
percentiles, the server's resident memory before and after, and its exit
code on SIGTERM. Exit status 1 if anything was violated.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx2 as httpx
from hypothesis import HealthCheck, given, settings
from tests.fuzzing import (
    FUZZ_SERVER_ARGS,
    HealthyStream,
    Request,
    check,
    health_ok,
    requests,
    send,
)

from bench._common import gezel_server, write_json


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _tiny_model() -> Path:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "demo-model", "--kind", "dense", "--size", "tiny"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=50_000)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or _tiny_model()
    statuses: collections.Counter[int] = collections.Counter()
    violations: list[str] = []
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        flags = ["--max-concurrency", "4", *FUZZ_SERVER_ARGS, "--log-level", "WARNING"]
        with gezel_server(model, log, flags) as server:
            client = httpx.Client(base_url=server.url, timeout=120)
            healthy = HealthyStream(server.url)
            rss_before = _rss_kb(server.proc.pid)
            healthy.start()
            started = time.monotonic()

            @settings(
                max_examples=args.examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(req=requests())
            def one(req: Request) -> None:
                t0 = time.perf_counter()
                try:
                    resp = send(client, req)
                except httpx.HTTPError as exc:
                    violations.append(f"{req.method} {req.path}: {type(exc).__name__}: {exc}")
                    return
                latencies.append(time.perf_counter() - t0)
                statuses[resp.status_code] += 1
                for problem in check(resp):
                    violations.append(f"{req.method} {req.path}: {problem}")
                trouble = health_ok(client)
                if trouble is not None:
                    violations.append(trouble)
                n = sum(statuses.values())
                if n % 1000 == 0:
                    rate = n / (time.monotonic() - started)
                    print(f"{n} examples ({rate:.0f}/s), {len(violations)} violations", flush=True)

            one()
            elapsed = time.monotonic() - started
            runs, mismatches = healthy.stop()
            rss_after = _rss_kb(server.proc.pid)
            client.close()
        exit_code = server.exit_code
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else 0.0

    report: dict[str, Any] = {
        "examples": sum(statuses.values()),
        "seconds": round(elapsed, 1),
        "statuses": dict(sorted(statuses.items())),
        "violations": violations[:50],
        "violation_count": len(violations),
        "healthy_runs": runs,
        "healthy_mismatches": len(mismatches),
        "latency_ms": {k: round(pct(p) * 1000, 1) for k, p in (("p50", 0.5), ("p99", 0.99))},
        "rss_kb": {"before": rss_before, "after": rss_after},
        "exit_code": exit_code,
    }
    print(
        f"\n{report['examples']} examples in {report['seconds']} s; statuses "
        f"{report['statuses']}\nviolations: {len(violations)}; healthy stream: {runs} runs, "
        f"{len(mismatches)} mismatches\nlatency p50 {report['latency_ms']['p50']} ms, "
        f"p99 {report['latency_ms']['p99']} ms; server RSS {rss_before} -> {rss_after} kB; "
        f"exit code {exit_code}"
    )
    for v in violations[:10]:
        print("  !", v[:300])
    if args.json:
        write_json(args.json, report)
    return 1 if violations or mismatches or exit_code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
