"""Settings declared once: a config class's field carries its help and its flag.

A field declared with ``setting`` is an ordinary ``attrs`` field (its
default, its validator) with a ``Setting`` in its metadata: the help text
and, where the command line sets it, the flag's name and how a flag value
becomes the field's value. The CLI builds its flags by walking
``attrs.fields`` of the config classes and builds the configs back from the
parsed flags the same way, so a default is written in one place and
``gezel-trio serve --help`` shows it::

    max_queue: int = setting(
        64, flag="--max-queue", help="requests that may wait for a slot; beyond it: 429"
    )

A flag's value maps onto its field's in one of a few declared ways: as it
is; in a larger unit (``per_unit``: a flag in MB over a field in bytes);
with 0 meaning ``None`` (``zero_is_none``: the CLI's word for "unset");
and for a ``bool`` field, a bare switch that turns it on (a field that
defaults off) or off (one that defaults on), or ``on_off``: the flag takes
``on`` or ``off`` and ``--no-<name>`` means off.

A config class may hold settings classes of its parts, each declared with
``section`` and a title: ``EngineConfig.memory`` is the ``MemorySettings``
that ``mlx.memory`` reads, and ``serve --help`` shows its flags under its
title. ``build`` makes a config from flag values named without their dashes
(``kv_bits=4`` for ``--kv-bits 4``), walking the sections: the CLI and the
test factory build the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs

__all__ = [
    "MIB",
    "Setting",
    "build",
    "flag_default",
    "flag_name",
    "flags_of",
    "from_flag",
    "name_of",
    "section",
    "sections_of",
    "setting",
    "settings_of",
]

_T = TypeVar("_T")

MIB = 1024 * 1024
# The metadata keys under which a field carries its Setting, and a section
# its title.
_KEY = "gezel_trio.setting"
_SECTION = "gezel_trio.section"

_Validator = Callable[[Any, Any, Any], Any]


@attrs.frozen
class Setting:
    """What a field says about itself beyond its type and default."""

    help: str
    # The command-line flag (``--max-queue``); ``None``: not settable there.
    flag: str | None = None
    # The flag's type where it differs from the field's (an ``int`` flag
    # over a ``float`` field); ``None``: the field's own.
    flag_type: Callable[[str], Any] | None = None
    # Field units per flag unit: ``MIB`` for a flag in MB over bytes. The
    # flag's value is rounded down to a whole number of field units.
    per_unit: int = 1
    # The least a converted value may be (a positive field stays positive
    # however small the figure in the larger unit).
    at_least: int | None = None
    # The flag's 0 means the field's ``None``.
    zero_is_none: bool = False
    # A ``bool`` field set by ``--name on|off`` (a bare ``--name``: on) and
    # ``--no-name``.
    on_off: bool = False
    # The values the flag accepts (argparse's ``choices``); ``None``: any.
    choices: tuple[str, ...] | None = None
    # A tuple field whose flag may be given several times, each adding one
    # value (absent: the empty tuple).
    repeat: bool = False


def setting(
    default: _T,
    *,
    help: str,
    flag: str | None = None,
    validator: _Validator | Sequence[_Validator] | None = None,
    flag_type: Callable[[str], Any] | None = None,
    per_unit: int = 1,
    at_least: int | None = None,
    zero_is_none: bool = False,
    on_off: bool = False,
    choices: Sequence[str] | None = None,
    repeat: bool = False,
    converter: Callable[[Any], Any] | None = None,
) -> _T:
    """An ``attrs`` field with ``default``, ``validator`` and ``converter``
    that carries a ``Setting``: its help and, with ``flag``, how the CLI
    sets it."""
    meta = Setting(
        help,
        flag,
        flag_type,
        per_unit,
        at_least,
        zero_is_none,
        on_off,
        tuple(choices) if choices is not None else None,
        repeat,
    )
    # attrs.field returns its own placeholder, typed as the default's type.
    field: _T = attrs.field(
        default=default, validator=validator, converter=converter, metadata={_KEY: meta}
    )
    return field


def section(cls: type[_T], *, title: str) -> _T:
    """A field holding the settings class ``cls`` of one part, its defaults
    by default; ``title`` heads its flags in ``serve --help``."""
    field: _T = attrs.field(factory=cls, metadata={_SECTION: (cls, title)})
    return field


def settings_of(cls: type) -> list[tuple[attrs.Attribute[Any], Setting]]:
    """The fields of the attrs class ``cls`` declared with ``setting``, in
    order (a section's are its own: ``flags_of`` walks them)."""
    return [(f, f.metadata[_KEY]) for f in attrs.fields(cls) if _KEY in f.metadata]


def sections_of(cls: type) -> list[tuple[attrs.Attribute[Any], type, str]]:
    """The fields of ``cls`` declared with ``section``: each with its
    settings class and its title, in order."""
    return [(f, *f.metadata[_SECTION]) for f in attrs.fields(cls) if _SECTION in f.metadata]


def flag_name(meta: Setting) -> str:
    """The flag's name without its dashes: ``kv_bits`` for ``--kv-bits``
    (argparse's ``dest``)."""
    assert meta.flag is not None
    return meta.flag.removeprefix("--").replace("-", "_")


def name_of(field: attrs.Attribute[Any]) -> str:
    """What a message calls the setting ``field``: its flag's name where it
    has one (what a user typed), else the field's."""
    meta = field.metadata.get(_KEY)
    return flag_name(meta) if meta is not None and meta.flag is not None else field.name


def flags_of(cls: type) -> Iterator[tuple[type, attrs.Attribute[Any], Setting]]:
    """Every setting with a flag of ``cls`` and of its sections, depth first,
    with the class that declares it."""
    for field, meta in settings_of(cls):
        if meta.flag is not None:
            yield cls, field, meta
    for _, part, _ in sections_of(cls):
        yield from flags_of(part)


def build(cls: type[_T], values: Mapping[str, Any]) -> _T:
    """``cls`` with each setting whose flag ``values`` names (``flag_name``)
    set from that flag value as the command line sets it (``from_flag``),
    in its section; every other setting keeps its default. A name that is
    no flag of ``cls`` is a ``TypeError``."""
    kind: type = cls  # a class is hashable, whatever it builds
    unknown = set(values) - _flag_names(kind)
    if unknown:
        raise TypeError(f"{cls.__name__} has no flag {', '.join(sorted(unknown))}")
    return _build(cls, values)


# Walked once per class: every engine a test opens builds its config, and
# walking the fields each time was a tenth of an empty engine's start.
@functools.cache
def _flag_names(cls: type) -> frozenset[str]:
    return frozenset(flag_name(meta) for _, _, meta in flags_of(cls))


@functools.cache
def _layout(
    cls: type,
) -> tuple[
    tuple[tuple[attrs.Attribute[Any], Setting, str], ...],
    tuple[tuple[str, type], ...],
]:
    """``cls``'s settings with a flag (each with its flag's name) and its sections."""
    flagged = tuple(
        (field, meta, flag_name(meta)) for field, meta in settings_of(cls) if meta.flag is not None
    )
    return flagged, tuple((field.name, part) for field, part, _ in sections_of(cls))


def _build(cls: type[_T], values: Mapping[str, Any]) -> _T:
    kind: type = cls
    flagged, parts = _layout(kind)
    given: dict[str, Any] = {
        field.name: from_flag(field, meta, values[name])
        for field, meta, name in flagged
        if name in values
    }
    for name, part in parts:
        given[name] = _build(part, values)
    return cls(**given)


def flag_default(field: attrs.Attribute[Any], meta: Setting) -> Any:
    """The field's default as its flag says it: the flag shows the field's
    own default, so the two cannot drift."""
    default = field.default
    if meta.on_off:
        return "on" if default else "off"
    if meta.repeat:
        return None  # argparse's append starts from nothing
    if isinstance(default, bool):
        return False  # a bare switch, absent
    if default is None and meta.zero_is_none:
        return (meta.flag_type or int)("0")  # the flag's own "0", parsed as argparse would
    if default is not None and meta.per_unit != 1:
        return default / meta.per_unit
    return default


def from_flag(field: attrs.Attribute[Any], meta: Setting, value: Any) -> Any:
    """The field's value for the flag's ``value``."""
    if meta.on_off:
        # The command line's "on"/"off", or a caller's bool.
        return value if isinstance(value, bool) else value == "on"
    if meta.repeat:
        return tuple(value or ())
    if isinstance(field.default, bool) and field.default:
        return not value  # a bare switch turns off what is on by default
    if meta.zero_is_none and not value:
        return None
    if value is not None and meta.per_unit != 1:
        scaled = int(value * meta.per_unit)
        return scaled if meta.at_least is None else max(meta.at_least, scaled)
    return value
