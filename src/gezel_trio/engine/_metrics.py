"""Prometheus metrics of one engine, through ``prometheus-client``.

Each engine has its own ``CollectorRegistry`` - never the process-global one -
so several engines (tests, an embedder running two models) never share or
clash over a metric. Names follow vLLM's where they mean the same thing, in
the ``gezel_`` namespace (``vllm:time_to_first_token_seconds`` is
``gezel_time_to_first_token_seconds``), so existing dashboards translate by
prefix.

The engine records request timings in the Trio thread as it delivers
events (``trio.current_time``, so ``MockClock`` tests see virtual time);
gauges are read from the engine's state when ``/metrics`` is scraped.

Every byte the process holds has a gauge: the prompt cache's KV
(``gezel_cache_bytes``), MLX's live memory, its peak, its buffer cache and
that cache's cap (read on the host thread after each step, so a scrape
shows the last step's figures), the process's resident set, and the sizes
of the bounded per-process caches (``gezel_bookkeeping``, one label per
cache; the HTTP layer adds its stored responses and request checks).
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable, Iterator, Mapping

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.figures import BackendFigures, published

__all__ = ["EngineMetrics", "Snapshot", "resident_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Seconds; vLLM's TTFT buckets, trimmed to what a local sidecar sees.
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_RATE_BUCKETS = (10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 50000.0)


def resident_bytes() -> int:
    """The process's resident set now (Linux: ``/proc/self/statm``; elsewhere
    the peak, which is what ``getrusage`` knows)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


@attrs.frozen
class Snapshot:
    """The engine's state as gauges show it, read at scrape time."""

    running: int
    waiting: int
    parked: int
    steps: int
    cache_entries: int
    cache_bytes: int
    memory_bytes: int
    cache_blocks: int = 0
    cache_lookups: int = 0
    cache_hits: int = 0
    rss_bytes: int = 0
    # What the backend measured: each figure that declares a metric
    # (``core.figures.metric``) is shown under its own name.
    backend: BackendFigures = attrs.field(factory=BackendFigures)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], Snapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        s = self._read()
        for name, doc, value in (
            ("gezel_num_requests_running", "Requests in the batch (both lanes).", s.running),
            ("gezel_num_requests_waiting", "Requests queued for a slot.", s.waiting),
            ("gezel_num_requests_parked", "Background requests parked for interactive.", s.parked),
            ("gezel_cache_entries", "Prompt-cache entries in memory.", s.cache_entries),
            (
                "gezel_cache_bytes",
                "Bytes of prompt-cache state in memory (shared blocks once).",
                s.cache_bytes,
            ),
            ("gezel_cache_blocks", "Shared KV blocks in the prompt cache.", s.cache_blocks),
            ("gezel_mlx_active_memory_bytes", "Live MLX memory.", s.memory_bytes),
            ("gezel_process_resident_memory_bytes", "The process's resident set.", s.rss_bytes),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("gezel_engine_steps", "Engine steps taken.", value=s.steps)
        yield CounterMetricFamily(
            "gezel_prefix_cache_queries", "Requests that looked up the cache.", s.cache_lookups
        )
        yield CounterMetricFamily(
            "gezel_prefix_cache_hits", "Requests that reused a cached prefix.", s.cache_hits
        )
        for declared, value in published(s.backend):
            family = CounterMetricFamily if declared.kind == "counter" else GaugeMetricFamily
            yield family(declared.name, declared.help, value=value)


class _SizesCollector(Collector):
    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], Mapping[str, int]]] = {}

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gezel_bookkeeping",
            "Sizes of the bounded per-process caches (entries, or bytes/chars as the name says).",
            labels=["what"],
        )
        for read in self.sources.values():
            for what, value in read().items():
                family.add_metric([what], value)
        yield family


class _Declared(Collector):
    """The engine's own counters and histograms, collected in one go."""

    def __init__(self, metrics: tuple[Counter | Histogram, ...]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.collect()


class EngineMetrics:
    """The metrics of one engine; ``exposition()`` is the ``/metrics`` body."""

    def __init__(self) -> None:
        # The metrics below join the registry as one collector, in this
        # order: registering each (a name check per metric) was a third of
        # the 0.5 ms every engine's start paid for its metrics.
        self.registry = CollectorRegistry()
        self._sizes: _SizesCollector | None = None
        self.ttft = Histogram(
            "gezel_time_to_first_token_seconds",
            "Time from submission to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.itl = Histogram(
            "gezel_time_per_output_token_seconds",
            "Time between two generated tokens of one request (inter-token latency).",
            buckets=_TOKEN_BUCKETS,
            registry=None,
        )
        self.queue = Histogram(
            "gezel_request_queue_time_seconds",
            "Time a request waited for a slot.",
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.e2e = Histogram(
            "gezel_e2e_request_latency_seconds",
            "Time from submission to the request's last event.",
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.prefill_rate = Histogram(
            "gezel_request_prefill_tokens_per_second",
            "Prompt tokens computed (not served from cache) per second of prefill.",
            buckets=_RATE_BUCKETS,
            registry=None,
        )
        self.requests = Counter(
            "gezel_requests",
            "Requests that ended, by outcome (stop, length, failed, withdrawn) and error code.",
            ["outcome", "error"],
            registry=None,
        )
        self.http_errors = Counter(
            "gezel_http_errors",
            "Error responses the HTTP layer sent, by status and error code.",
            ["status", "code"],
            registry=None,
        )
        self.ignored_fields = Counter(
            "gezel_ignored_fields",
            "Requests that held a field this server does not implement (ignored, named in "
            "the x-gezel-ignored-fields header), by the field's name; past 64 names, 'other'.",
            ["field"],
            registry=None,
        )
        self.preemptions = Counter(
            "gezel_num_preemptions",
            "Background sequences parked for interactive work.",
            registry=None,
        )
        self.prompt_tokens = Counter(
            "gezel_prompt_tokens", "Prompt tokens of finished requests.", registry=None
        )
        self.cached_tokens = Counter(
            "gezel_prompt_tokens_cached",
            "Prompt tokens served from the prompt cache.",
            registry=None,
        )
        self.prefilled_tokens = Counter(
            "gezel_prompt_tokens_prefilled", "Prompt tokens computed by prefill.", registry=None
        )
        self.generation_tokens = Counter(
            "gezel_generation_tokens", "Tokens generated by finished requests.", registry=None
        )
        self.cache_misses = Counter(
            "gezel_prompt_cache_misses",
            "Finished requests by where their prompt left the prompt cache: full (it reused "
            "all the cache held for it), cold, diverged, checkpoint, evicted.",
            ["reason"],
            registry=None,
        )
        self.billing_lines = Counter(
            "gezel_billing_header_lines_dropped",
            "Claude Code billing-header lines taken out of system prompts before rendering.",
            registry=None,
        )
        self.step_failures = Counter(
            "gezel_step_failures", "Model steps that failed (their lane's sequences failed).",
            registry=None,
        )  # fmt: skip
        self.registry.register(
            _Declared(
                (
                    self.ttft,
                    self.itl,
                    self.queue,
                    self.e2e,
                    self.prefill_rate,
                    self.requests,
                    self.http_errors,
                    self.ignored_fields,
                    self.preemptions,
                    self.prompt_tokens,
                    self.cached_tokens,
                    self.prefilled_tokens,
                    self.generation_tokens,
                    self.cache_misses,
                    self.billing_lines,
                    self.step_failures,
                )
            )
        )

    def sizes(self, owner: str, read: Callable[[], Mapping[str, int]]) -> None:
        """``gezel_bookkeeping`` shows ``read()``'s sizes at every scrape
        (read on the Trio thread: they must be safe to read there); a later
        call for the same ``owner`` replaces its source."""
        if self._sizes is None:
            self._sizes = _SizesCollector()
            self.registry.register(self._sizes)
        self._sizes.sources[owner] = read

    def watch(self, read: Callable[[], Snapshot]) -> None:
        """Gauges read ``read()`` at every scrape."""
        self.registry.register(_StateCollector(read))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
