"""The ``gezel-trio`` command: ``serve``, ``prepare-model``, ``demo-model``
and ``seed-server-path``."""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs

from .core.config import EngineConfig
from .core.errors import GezelError, ModelLoadError
from .core.settings import build, flag_default, flag_name, flags_of, sections_of, settings_of
from .http.app import HttpSettings
from .mlx import follow_rank, group_rank
from .mlx.model_source import per_layer_embedding_table, resolve_model
from .profiles import PROFILES, SEED, STANDARD
from .server import ServerConfig
from .stdout_protocol import LogFormatter, StdoutSettings

# The one place the package uses its testing module: the demo-model command.
from .testing.demo_models import DemoKind
from .tuning import blas

__all__ = ["main", "seed_server_path", "serve_parser", "server_config", "setting_groups"]

_C = TypeVar("_C")


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default: ``none`` where unset, ``off``
    for a switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:  # a switch
            return f"{text} (default: off)" if action.default is False else text
        shown = "none" if action.default is None else str(action.default)
        # argparse %-formats the help with the action's fields.
        return f"{text} (default: {shown.replace('%', '%%')})"


# The config classes whose settings are serve's flags, with their group's
# title; each section of one (``core.settings.section``) is a group of its own.
_SETTINGS: list[tuple[type, str]] = [
    (EngineConfig, "the model"),
    (HttpSettings, "the HTTP edge"),
    (ServerConfig, "the server"),
    (StdoutSettings, "the stdout lines a supervisor reads"),
]


def _setting_groups(cls: type, title: str) -> list[tuple[type, str]]:
    """``cls`` and its sections, depth first, each with its group's title."""
    groups = [(cls, title)]
    for _, part, heading in sections_of(cls):
        groups += _setting_groups(part, heading)
    return groups


def setting_groups() -> list[tuple[type, str]]:
    """Every settings class of ``serve``'s flags with its group's title,
    in ``serve --help``'s order (``config_reference`` heads its page's
    sections with them)."""
    return [group for cls, title in _SETTINGS for group in _setting_groups(cls, title)]


def _add_setting_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    """One flag per setting of ``cls`` that declares one (``core.settings``)."""
    hints = typing.get_type_hints(cls)
    for field, meta in settings_of(cls):
        if meta.flag is None:
            continue
        default = flag_default(field, meta)
        text = meta.help.replace("%", "%%")
        if meta.on_off:
            group.add_argument(
                meta.flag, nargs="?", const="on", default=default, choices=["on", "off"], help=text
            )
            negative = "--no-" + meta.flag.removeprefix("--")
            group.add_argument(
                negative,
                dest=flag_name(meta),
                action="store_const",
                const="off",
                help=f"same as {meta.flag} off",
            )
        elif isinstance(field.default, bool):
            group.add_argument(meta.flag, action="store_true", help=text)
        elif meta.repeat:
            group.add_argument(
                meta.flag, action="append", type=meta.flag_type or str, default=None, help=text
            )
        else:
            kind = meta.flag_type or _flag_type(hints[field.name])
            group.add_argument(
                meta.flag, type=kind, default=default, choices=meta.choices, help=text
            )


def _flag_type(hint: object) -> Any:
    """``int`` for ``int``, ``Path`` for ``Path | None``: the type a flag parses to."""
    (kind,) = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    return kind


def _flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """What ``args`` holds for each flag of ``cls`` and its sections."""
    return {flag_name(meta): getattr(args, flag_name(meta)) for _, _, meta in flags_of(cls)}


def _from_flags(cls: type[_C], args: argparse.Namespace, **given: Any) -> _C:
    """``cls`` with each setting that has a flag, its sections' too, taken
    from ``args`` (``core.settings.build``), and the fields in ``given``."""
    config = build(cls, _flag_values(cls, args))
    # mypy cannot see that a class with settings is an attrs class.
    return attrs.evolve(config, **given) if given else config  # type: ignore[misc]


def _parser(profile: str = STANDARD) -> argparse.ArgumentParser:
    """The command line, ``serve``'s defaults those of ``profile``
    (``profiles``)."""
    p = argparse.ArgumentParser(
        prog="gezel-trio",
        description=__doc__,
        epilog="Flags with no subcommand (gezel-trio --model DIR --port N ...) mean serve "
        "with the seed profile, as the seed sidecar was started.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve", help="run the OpenAI-compatible server", formatter_class=_HelpFormatter
    )
    _add_serve_flags(s, profile)

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
    d.add_argument("--kind", choices=typing.get_args(DemoKind), default="dense")
    d.add_argument("--size", choices=["tiny", "bench"], default="tiny")

    sub.add_parser(
        "seed-server-path",
        help="print the path of the installed gezel_mlx_server.py, the seed sidecar's "
        "launch form (docs/migrating-from-the-seed.md)",
    )
    return p


def serve_parser(profile: str = STANDARD) -> argparse.ArgumentParser:
    """``serve``'s flags on a parser of their own, grouped and with the
    defaults of ``profile`` as ``gezel-trio serve --help`` shows them."""
    s = argparse.ArgumentParser(prog="gezel-trio serve", formatter_class=_HelpFormatter)
    _add_serve_flags(s, profile)
    return s


def _add_serve_flags(s: argparse.ArgumentParser, profile: str) -> None:
    """``serve``'s flags, a group per settings class (``setting_groups``)
    then the seed's, the defaults those of ``profile``."""
    s.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=profile,
        help="a named set of defaults: 'seed' behaves as the seed sidecar where its client "
        "depends on it (docs/migrating-from-the-seed.md); flags given win",
    )
    groups = {part: s.add_argument_group(heading) for part, heading in setting_groups()}
    for cls, group in groups.items():
        _add_setting_flags(group, cls)
    # The process's own, which main reads: no config holds them.
    groups[ServerConfig].add_argument(
        "--log-level",
        default="INFO",
        help="the stderr log's level: DEBUG, INFO, WARNING, ERROR or CRITICAL",
    )
    _add_seed_flags(s)
    # After every flag exists: the profile's values become their defaults,
    # so --help shows them and a flag given still wins.
    s.set_defaults(**PROFILES[profile])


def seed_server_path() -> Path:
    """The installed ``gezel_mlx_server.py``: ``python <it> <serve's flags>``
    is a seed launch (``serve`` with the seed profile)."""
    script = importlib.resources.files(__package__) / "_seed" / "gezel_mlx_server.py"
    return Path(str(script)).resolve()


# The seed's KV-cache quantization flags beyond --kv-bits and
# --kv-group-size (settings): their types and defaults (a value other than
# the default is noticed).
_KV_FLAGS: dict[str, tuple[Callable[[str], object], object]] = {
    "--kv-quant-scheme": (str, "uniform"),
}
_KV_HELP = {
    "--kv-quant-scheme": "accepted; the KV cache is quantized uniformly (affine), as 'uniform'",
}


def _add_seed_flags(s: argparse.ArgumentParser) -> None:
    """The seed sidecar's flags that set none of our settings directly, so
    that its supervisor's command line starts this server
    (docs/migrating-from-the-seed.md); the seed's ``--wired-limit-mb`` and
    ``--stream-tool-calls`` are settings above. Each is mapped to ours or
    honoured; a feature this build lacks is accepted with a one-line notice
    on stderr (``_seed_notices``)."""
    g = s.add_argument_group("the seed sidecar's flags")
    g.add_argument(
        "--gpu-memory-limit-mb",
        type=int,
        default=0,
        help="the seed's name for --memory-limit-mb (0: unset)",
    )
    # Vision follows the model (a VLM directory serves images), so the
    # seed's switch only parses.
    g.add_argument(
        "--vision", action="store_true", help="accepted; a vision model is served as one anyway"
    )
    for flag, (kind, default) in _KV_FLAGS.items():
        g.add_argument(
            flag,
            type=kind,
            default=default,
            help=_KV_HELP[flag],
        )
    g.add_argument(
        "--spec-draft-model", default=None, help="accepted; no MTP drafter (see --draft-model)"
    )
    g.add_argument(
        "--spec-draft-kind", default=None, help="accepted; no MTP drafter (see --draft-model)"
    )
    g.add_argument(
        "--spec-block-size",
        type=int,
        default=None,
        help="accepted; no MTP drafter (see --draft-model)",
    )
    g.add_argument(
        "--external-ple-dir",
        type=Path,
        default=None,
        help="as --map-per-layer-embeddings: a per-layer embedding table (Gemma 3n, Gemma 4 "
        "E-series) is read from the model's own files; the directory is not used",
    )
    g.add_argument(
        "--allow-resident-ple-fallback",
        action="store_true",
        help="accepted; no effect (a table that cannot be mapped is held in memory, "
        "with a warning)",
    )


def _seed_notices(args: argparse.Namespace) -> list[str]:
    """One line per seed flag that asked for something this build does not
    do, saying what it does instead. Output is never changed by them."""
    notes = []
    start = args.quantized_kv_start
    if start and not args.kv_bits:
        notes.append(
            f"--quantized-kv-start {start}: no effect, the KV cache is not quantized (no --kv-bits)"
        )
    if args.kv_quant_scheme != "uniform":
        notes.append(
            f"--kv-quant-scheme {args.kv_quant_scheme}: no effect, the KV cache is "
            "quantized uniformly (affine)"
        )
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
            f"{' '.join(spec)}: no effect; an MTP drafter is not run (a draft model with "
            "the target's tokenizer is, with --draft-model DIR); requests speculate with "
            "draft-free lookup (--speculation), same output"
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


def _ple_notice(model_dir: Path, args: argparse.Namespace) -> str | None:
    """What ``--external-ple-dir`` does for this model, as a notice (a seed
    supervisor may pass it whatever the model)."""
    if args.external_ple_dir is None:
        return None
    table = per_layer_embedding_table(model_dir)
    if table is None:
        return "--external-ple-dir: not applicable, the model declares no per-layer embedding table"
    # The seed derived a view directory for its loader to map (Qwen4 only;
    # it held Gemma 3n and Gemma 4 E-series tables in memory). Here every
    # such table is mapped where it lies, so the directory is not needed.
    return (
        f"--external-ple-dir: {table}; its rows are read from the model's own files as "
        f"tokens need them (memory-mapped), not held in memory; {args.external_ple_dir} "
        "is not used"
    )


def server_config(
    args: argparse.Namespace, model_dir: Path, watch_parent: int | None = None
) -> ServerConfig:
    """What ``serve``'s flags (ours and the seed's) ask for; ``ValueError``
    names a value out of range."""
    engine = EngineConfig.from_flags(
        **_flag_values(EngineConfig, args)
        | {
            "model": model_dir,
            # The seed's 0 meant its serial path: one sequence at a time.
            "max_concurrency": args.max_concurrency or 1,
            "map_per_layer_embeddings": (
                args.map_per_layer_embeddings or args.external_ple_dir is not None
            ),
            # The seed's name for the ceiling, where ours is not given.
            "memory_limit_mb": (
                args.memory_limit_mb
                if args.memory_limit_mb is not None
                else args.gpu_memory_limit_mb or None
            ),
        }
    )
    return _from_flags(
        ServerConfig,
        args,
        engine=engine,
        http=_from_flags(HttpSettings, args),
        stdout=_from_flags(StdoutSettings, args),
        watch_parent=watch_parent,
    )


def _command_line(argv: list[str], seed_launch: bool) -> tuple[list[str], str]:
    """``argv`` as ``serve`` reads it and the profile it selects. A seed
    launch (the installed ``gezel_mlx_server.py``, or flags with no
    subcommand, as the seed's supervisor starts its sidecar) means
    ``serve`` with the seed profile; ``--profile`` given wins."""
    if seed_launch or (argv and argv[0].startswith("--") and argv[0] != "--help"):
        argv = ["serve", *argv]
        profile = SEED
    else:
        profile = STANDARD
    if argv and argv[0] == "serve":
        probe = argparse.ArgumentParser(add_help=False)
        probe.add_argument("--profile", choices=sorted(PROFILES), default=profile)
        profile = probe.parse_known_args(argv[1:])[0].profile
    return argv, profile


def main(argv: list[str] | None = None, *, seed_launch: bool = False) -> int:
    """The ``gezel-trio`` command; ``seed_launch``: started as the seed's
    ``gezel_mlx_server.py`` (``serve``, the seed profile)."""
    argv, profile = _command_line(sys.argv[1:] if argv is None else list(argv), seed_launch)
    args = _parser(profile).parse_args(argv)
    # MLX's BLAS is bound once, before anything imports mlx (tuning.blas).
    blas.preload(getattr(args, "platform_tuning", "auto") != "off")
    if args.command == "seed-server-path":
        print(seed_server_path())
        return 0
    if args.command == "demo-model":
        # No Trio loop here: the builder runs on this, the only, thread.
        from .testing.demo_models import ensure_demo_model

        print(ensure_demo_model(args.kind, args.size))
        return 0

    watch_parent = None
    if args.command == "serve" and args.exit_with_parent == "on":
        # First: an orphan loads no model (and fetches none) only to drop it.
        from .server import Orphaned, exit_with_parent

        try:
            watch_parent = exit_with_parent()
        except Orphaned as exc:
            print(f"gezel-trio: {exc}", file=sys.stderr)
            return 1  # the seed's status for it
        except OSError as exc:
            print(f"gezel-trio: {exc}", file=sys.stderr)
            return 2
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
    ple = _ple_notice(model_dir, args)
    for note in [*_seed_notices(args), *([ple] if ple else [])]:
        print(f"gezel-trio: {note}", file=sys.stderr)
    if args.profile != STANDARD:
        print(f"gezel-trio: profile {args.profile}", file=sys.stderr)

    from .server import main_serve

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    try:
        config = server_config(args, model_dir, watch_parent)
    except ValueError as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 2
    group = group_rank()
    if group is not None and group[0] != 0:
        return _follow(config)
    return main_serve(config)


def _follow(config: ServerConfig) -> int:
    """A rank other than 0: its shard of every step, until rank 0 closes."""
    try:
        follow_rank(config.engine)
    except GezelError as exc:
        print(f"gezel-trio: {exc}", file=sys.stderr)
        return 1
    return 0
