"""Image prompts: time to first token and decode speed, gezel-trio against mlx_vlm.server.

Both servers load the same demo VLM (``gezel-trio demo-model --kind
vision`` at ``--size``: a LLaVA whose CLIP tower makes 16 tokens of an image
at tiny, 64 at bench) on the same BLAS, one after the other, and get the
same streamed OpenAI chat requests, one at a time: a picture (a different
one each time, so no system can reuse anything) and a question, greedy,
``--tokens`` tokens. Per system:

* ``ttft``: time to the first generated token (decoding the image, the
  vision tower, the prefill), median of ``--requests``;
* ``decode tok/s``: ``(tokens - 1) / (last token - first token)`` per
  stream, median;
* ``same image again``: TTFT of the first request repeated (gezel-trio's
  prompt cache knows the image and reuses the prefix; mlx-vlm's server keeps
  no KV across requests with images) and the ``cached_tokens`` it reports.

Then, gezel-trio only (mlx_vlm.server has no shared batch for this):
``--batch`` image streams and ``--batch`` text streams released together
against ``2 x --batch`` text streams, aggregate decode tok/s (bench/_sse.py's
metric): image sequences decode in the same batch as text, so the two should
be close; their image prefills run between the batch's steps.

mlx-vlm 0.7.10's server needs one fix to serve a LLaVA model at all with
transformers 5 (``bench/_mlx_vlm_server.py`` says which and why).
"""

from __future__ import annotations

import base64
import io
import random
import statistics
import threading
from pathlib import Path
from typing import Any

from bench import _servers
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, table
from bench._sse import StreamLog, StreamTiming, aggregate, released_together, stream_once

SYSTEMS = ("gezel", "mlx_vlm.server")
QUESTION = "Describe this picture in a few words."


def _picture(seed: int) -> str:
    """A distinct 64x48 PNG as a data: URL (random blocks, seeded)."""
    from PIL import Image

    rng = random.Random(seed)
    img = Image.new("RGB", (64, 48))
    for x in range(0, 64, 8):
        for y in range(0, 48, 8):
            img.paste(
                (rng.randrange(256), rng.randrange(256), rng.randrange(256)), (x, y, x + 8, y + 8)
            )
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(model: str, tokens: int, image: str | None, text: str = QUESTION) -> dict[str, Any]:
    content: Any = text
    if image is not None:
        content = [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": text},
        ]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _decode_tps(log: StreamLog) -> float | None:
    n = log.usage_int("completion_tokens") or len(log.content)
    if not log.content or log.last is None or n < 2 or log.last <= log.content[0]:
        return None
    return (n - 1) / (log.last - log.content[0])


def _cached(log: StreamLog) -> int | None:
    details = (log.usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens", (log.usage or {}).get("cached_tokens"))
    return int(value) if value is not None else None


def _singles(url: str, model: str, ctx: Context) -> dict[str, Any]:
    a = ctx.args
    stream_once(url, _body(model, 4, _picture(10_000)))  # warm-up: imports, first compile
    logs = [stream_once(url, _body(model, a.tokens, _picture(i))) for i in range(a.requests)]
    again = stream_once(url, _body(model, a.tokens, _picture(0)))
    return {
        "ttft_s": [log.ttft for log in logs],
        "decode_tps": [_decode_tps(log) for log in logs],
        "prompt_tokens": [log.usage_int("prompt_tokens") for log in logs],
        "again_ttft_s": again.ttft,
        "again_cached_tokens": _cached(again),
        "again_same_text": again.text == logs[0].text,
    }


def _together(url: str, bodies: list[dict[str, Any]], what: str) -> float:
    lock = threading.Lock()
    queue = list(bodies)

    def one(barrier: threading.Barrier) -> StreamLog:
        with lock:
            body = queue.pop()
        return stream_once(url, body, barrier=barrier)

    logs = released_together(len(bodies), one, what)
    return aggregate("gezel", bodies[0]["max_tokens"], [StreamTiming.of(x) for x in logs]).tok_s


def _median(values: list[Any]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def run(ctx: Context) -> Result:
    a = ctx.args
    model_dir: Path = ctx.demo_model("vision")
    systems = a.systems or list(SYSTEMS)
    data: dict[str, Any] = {"model": str(model_dir), "options": dict(ctx.options), "systems": {}}
    for system in systems:
        log = ctx.workdir / f"vision-{system}.log"
        with ctx.phase(system):
            if system == "gezel":
                flags = ["--max-concurrency", str(2 * a.batch), "--log-level", "WARNING"]
                with _servers.gezel_server(model_dir, log, flags) as server:
                    got = _singles(server.url, "demo", ctx)
                    n = a.batch
                    got["text_only_batch_tps"] = _together(
                        server.url,
                        [_body("demo", a.tokens, None, f"Tell me {i}.") for i in range(2 * n)],
                        "text batch",
                    )
                    got["mixed_batch_tps"] = _together(
                        server.url,
                        [_body("demo", a.tokens, _picture(100 + i)) for i in range(n)]
                        + [_body("demo", a.tokens, None, f"Tell me {i}.") for i in range(n)],
                        "mixed batch",
                    )
            else:
                flags = ["--max-tokens", str(a.tokens), "--log-level", "WARNING"]
                with _servers.mlx_vlm_server(model_dir, log, flags) as server:
                    got = _singles(server.url, str(model_dir), ctx)
        data["systems"][system] = got
    rows = []
    for system, got in data["systems"].items():
        ttft = _median(got["ttft_s"])
        rows.append(
            (
                system,
                _median(got["prompt_tokens"]),
                None if ttft is None else ttft * 1000,
                _median(got["decode_tps"]),
                got["again_ttft_s"] * 1000,
                got["again_cached_tokens"],
            )
        )
    tables = [
        table(
            f"One image request at a time ({a.requests} distinct pictures, {a.tokens} tokens)",
            "system | prompt tokens:.0f | TTFT ms:.1f | decode tok/s:.1f"
            " | same image again TTFT ms:.1f | cached tokens",
            rows,
            "TTFT and decode tok/s are medians; 'same image again' repeats the first request.",
        )
    ]
    gezel = data["systems"].get("gezel")
    if gezel is not None:
        tables.append(
            table(
                f"gezel-trio: {2 * a.batch} streams decoding together",
                "batch | aggregate decode tok/s:.1f",
                [
                    (f"{2 * a.batch} text", gezel["text_only_batch_tps"]),
                    (f"{a.batch} image + {a.batch} text", gezel["mixed_batch_tps"]),
                ],
            )
        )
    plots = [
        Plot(
            "Time to first token, image prompts",
            "request",
            "ms",
            tuple(
                Series(system, list(range(len(got["ttft_s"]))), [t * 1000 for t in got["ttft_s"]])
                for system, got in data["systems"].items()
            ),
        )
    ]
    return Result(data, tables, plots, title=f"vision on {model_dir.name}")


SCENARIO = Scenario(
    name="vision",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("requests", 8, "distinct image requests per system", int, quick=3),
        Option("tokens", 64, "max_tokens per request", int, quick=16),
        Option("batch", 2, "image streams (and as many text) in the mixed batch", int, quick=1),
        Option("systems", None, "systems to run (default: both)", str, "+", SYSTEMS),
    ),
)
