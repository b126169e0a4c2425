"""Fuzz every route of a real gezel-trio server, at length.

Usage (from the repository root)::

    python -m bench fuzz [--examples 50000] [--model DIR] [--size tiny|bench]

The same strategies and invariants as ``tests/http/test_fuzz.py``
(``tests/support/fuzzing.py``), run for ``--examples`` hypothesis examples (default
50,000; 200 with ``--quick``) against one server on the dense demo model of
``--size`` (``--model`` for another; ``--size tiny`` is the model CI fuzzes),
while a healthy greedy stream loops beside the fuzzer. The server runs as it
ships (no ``--keep-quantized``), with ``--max-concurrency 4`` and the fuzzing
flags of ``tests/support/fuzzing.py``. Reported: examples run, responses by status
(and by route: chat, its ``/chat/completions`` alias, cache warm, cache
delete, flush, the GET routes, odd methods and paths), the invariant
violations (status >= 500, a missing error envelope, an engine error frame
in a stream, ``/health`` not ok), the healthy stream's runs and mismatches,
request latency percentiles (the request alone, not the ``/health`` check
after it), the server's resident memory before, during (sampled every
hundredth of the run) and after, and its exit code on SIGTERM. A run with a
violation, a mismatch or an unclean exit says ``FAIL`` in its notes and
``"passed": false`` in its JSON.

Needs the ``test`` extra (hypothesis, openai). Not in the default run (50,000
examples take hours on 2 CPU cores).
"""

from __future__ import annotations

import collections
import math
import signal
import time
from pathlib import Path
from typing import Any

from bench import _servers
from bench._report import percentile
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, table

_ROUTES = ("chat", "alias", "responses", "response", "warm", "delete", "flush", "get", "odd")


def route_of(method: str, path: str) -> str:
    """The route class of a fuzzed request (as ``tests.support.fuzzing.requests`` draws them)."""
    if method == "POST" and path == "/v1/chat/completions":
        return "chat"
    if method == "POST" and path == "/chat/completions":
        return "alias"
    if method == "POST" and path == "/v1/responses":
        return "responses"
    if path.startswith("/v1/responses/"):
        return "response"
    if method == "POST" and path == "/v1/cache/warm":
        return "warm"
    if method == "DELETE" and path.startswith("/v1/cache/"):
        return "delete"
    if method == "POST" and path.startswith("/admin/flush?"):
        return "flush"
    if method == "GET" and path in (
        "/v1/models",
        "/health",
        "/metrics",
        "/openapi.json",
        "/v1/cache/stats",
    ):
        return "get"
    return "odd"


def cumulative(ms: list[float], edges: list[float]) -> list[float]:
    """The share (%) of ``ms`` at or below each edge."""
    return [100 * sum(v <= e for v in ms) / len(ms) for e in edges] if ms else []


def edges_for(ms: list[float]) -> list[float]:
    """Powers of two (ms) from just below the fastest request to just above the slowest."""
    if not ms:
        return []
    lo = math.floor(math.log2(max(min(ms), 0.01)))
    hi = math.ceil(math.log2(max(max(ms), 0.01)))
    return [2.0**k for k in range(lo, max(hi, lo + 1) + 1)]


def run(ctx: Context) -> Result:
    import httpx2 as httpx
    from hypothesis import HealthCheck, given, settings
    from tests.support.fuzzing import (
        FUZZ_SERVER_ARGS,
        HealthyStream,
        Request,
        check,
        health_ok,
        requests,
        send,
    )

    a = ctx.args
    if a.examples < 1:
        raise ValueError("--examples >= 1 required")
    model_dir: Path = a.model if a.model is not None else ctx.demo_model("dense")
    statuses: collections.Counter[int] = collections.Counter()
    by_route: dict[str, collections.Counter[int]] = {r: collections.Counter() for r in _ROUTES}
    latency_ms: dict[str, list[float]] = {r: [] for r in _ROUTES}
    violations: list[str] = []
    violations_by_route: collections.Counter[str] = collections.Counter()
    rss: list[dict[str, float]] = []
    every = max(1, a.examples // 100)  # RSS sample period, in examples
    flags = ["--max-concurrency", "4", *FUZZ_SERVER_ARGS, "--log-level", "WARNING"]
    with ctx.phase("fuzz"):
        with _servers.gezel_server(
            model_dir,
            ctx.workdir / "gezel.log",
            flags,
            stop_signal=signal.SIGTERM,
            stored_weights=False,
        ) as server:
            pid = server.proc.pid
            client = httpx.Client(base_url=server.url, timeout=120)
            healthy = HealthyStream(server.url)
            rss_before = _servers.rss_kb(pid)
            healthy.start()
            started = time.monotonic()
            rss.append({"examples": 0, "seconds": 0.0, "rss_kb": rss_before})

            @settings(
                max_examples=a.examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(req=requests())
            def one(req: Request) -> None:
                route = route_of(req.method, req.path)
                t0 = time.perf_counter()
                try:
                    resp = send(client, req)
                except httpx.HTTPError as exc:
                    violations.append(f"{req.method} {req.path}: {type(exc).__name__}: {exc}")
                    violations_by_route[route] += 1
                    return
                latency_ms[route].append(round((time.perf_counter() - t0) * 1e3, 2))
                statuses[resp.status_code] += 1
                by_route[route][resp.status_code] += 1
                problems = [f"{req.method} {req.path}: {p}" for p in check(resp)]
                trouble = health_ok(client)
                if trouble is not None:
                    problems.append(trouble)
                violations.extend(problems)
                violations_by_route[route] += len(problems)
                n = sum(statuses.values())
                if n % every == 0:
                    now = time.monotonic() - started
                    rss.append(
                        {"examples": n, "seconds": round(now, 1), "rss_kb": _servers.rss_kb(pid)}
                    )
                if n % (every * 10) == 0:
                    ctx.progress(
                        f"{n} examples ({n / (time.monotonic() - started):.0f}/s), "
                        f"{len(violations)} violations"
                    )

            one()
            elapsed = time.monotonic() - started
            runs, mismatches = healthy.stop()
            rss_after = _servers.rss_kb(pid)
            rss.append(
                {
                    "examples": sum(statuses.values()),
                    "seconds": round(elapsed, 1),
                    "rss_kb": rss_after,
                }
            )
            client.close()
        exit_code = server.exit_code
    return _result(
        model_dir,
        elapsed,
        statuses,
        by_route,
        latency_ms,
        violations,
        violations_by_route,
        runs,
        mismatches,
        rss,
        exit_code,
    )


def _result(
    model_dir: Path,
    elapsed: float,
    statuses: collections.Counter[int],
    by_route: dict[str, collections.Counter[int]],
    latency_ms: dict[str, list[float]],
    violations: list[str],
    violations_by_route: collections.Counter[str],
    runs: int,
    mismatches: list[str],
    rss: list[dict[str, float]],
    exit_code: int | None,
) -> Result:
    examples = sum(statuses.values())
    every_ms = sorted(v for vs in latency_ms.values() for v in vs)
    rss_before, rss_after = rss[0]["rss_kb"], rss[-1]["rss_kb"]
    passed = not violations and not mismatches and exit_code == 0
    data: dict[str, Any] = {
        "model": str(model_dir),
        "examples": examples,
        "seconds": round(elapsed, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "statuses_by_route": {
            r: {str(k): v for k, v in sorted(c.items())} for r, c in by_route.items() if c
        },
        "violations": violations[:50],
        "violation_count": len(violations),
        "violations_by_route": dict(violations_by_route),
        "healthy_runs": runs,
        "healthy_mismatches": len(mismatches),
        "healthy_mismatch_samples": [m[:300] for m in mismatches[:10]],
        "latency_ms": {
            k: percentile(every_ms, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))
        }
        | {"max": every_ms[-1] if every_ms else None},
        "rss_kb": {"before": rss_before, "after": rss_after},
        "rss_samples": rss,
        "exit_code": exit_code,
        "passed": passed,
        "latency_ms_by_route": latency_ms,  # every request's, in the order sent
    }
    route_rows = []
    for r in _ROUTES:
        ms = sorted(latency_ms[r])
        if not ms and not violations_by_route[r]:
            continue
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(by_route[r].items()))
        route_rows.append(
            (
                r,
                len(ms),
                codes,
                violations_by_route[r],
                percentile(ms, 50),
                percentile(ms, 99),
                ms[-1] if ms else None,
            )
        )
    rss_mib = (rss_before / 1024, rss_after / 1024)
    tables = [
        table(
            "The run",
            "examples:d | seconds:.0f | examples/s:.1f | violations:d | healthy runs:d"
            " | mismatches:d | RSS before MiB:.0f | RSS after MiB:.0f | exit code",
            [
                (
                    examples,
                    elapsed,
                    examples / elapsed if elapsed else None,
                    len(violations),
                    runs,
                    len(mismatches),
                    *rss_mib,
                    "killed" if exit_code is None else str(exit_code),
                )
            ],
        ),
        table(
            "Responses and latency by route",
            "route | requests:d | statuses | violations:d | p50 ms:.1f | p99 ms:.1f | max ms:.0f",
            route_rows,
            "Latency: the request alone (for a stream, to its last byte), not the /health "
            "check after it.",
        ),
    ]
    notes = [
        ("PASS" if passed else "FAIL") + f": {len(violations)} violations, "
        f"{len(mismatches)} healthy-stream mismatches, exit code {exit_code}."
    ]
    notes += [f"violation: {v[:300]}" for v in violations[:10]]
    notes += [f"healthy mismatch: {m[:200]!r}" for m in mismatches[:5]]
    codes = sorted(statuses)
    edges = edges_for(every_ms)
    rss_mib_curve = [s["rss_kb"] / 1024 for s in rss]
    plots = [
        Plot(
            "Responses by status code",
            "status",
            "responses",
            (Series("responses", [str(c) for c in codes], [statuses[c] for c in codes]),),
            kind="bar",
            logy=True,
        ),
        Plot(
            "Request latency distribution, by route",
            "latency ms",
            "% of the route's requests at or below",
            tuple(
                Series(r, edges, cumulative(latency_ms[r], edges)) for r in _ROUTES if latency_ms[r]
            ),
            logx=True,
        ),
        Plot(
            "Server resident memory",
            "examples",
            "RSS MiB",
            (Series("gezel-trio", [s["examples"] for s in rss], rss_mib_curve),),
        ),
    ]
    return Result(data, tables, plots, notes, title=f"{examples} examples on {model_dir.name}")


SCENARIO = Scenario(
    name="fuzz",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("examples", 50_000, "hypothesis examples", int, quick=200),
        Option("model", None, "a model directory (default: the dense demo model)", Path),
    ),
    in_default_run=False,
)
