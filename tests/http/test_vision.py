"""Vision on the demo VLM, through the real server.

The demo VLM is a random-weight LLaVA that mlx-vlm loads (``gezel-trio
demo-model --kind vision``): a CLIP tower over 32x32 pixels in 8x8 patches,
so each image is 16 placeholder tokens. Its words are nonsense, but greedy
decoding makes them a function of the prompt: different pictures give
different words, the same picture the same words - which is what lets these
tests see whether the right image (and the right cached state) was used.

Each test serves the model with hypercorn over the real engine in this Trio
run (``served``) and drives it as users do: the official ``openai`` SDK
(on a worker thread, since it blocks) sending ``image_url`` data: URLs with
no gezel field. A raw socket stands in for a client that disconnects, and
the engine's own state is read to know when something happened (no sleeps).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx2 as httpx
import openai
import pytest
import trio
from PIL import Image, ImageDraw

from gezel_trio.core.settings import MIB
from tests.support.hostile_images import chunk, png_claiming, png_with
from tests.support.inprocess import raw_stream, served
from tests.support.sse_frames import carries_text

pytestmark = pytest.mark.slow

HANG = 120
T = TypeVar("T")
# "<|im_start|>user\n" comes before the image in a first user turn.
IMAGE_START = 3
IMAGE_TOKENS = 16


def picture(kind: str, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A few distinct, deterministic pictures."""
    img = Image.new("RGB", size, {"sun": (250, 200, 40), "sea": (20, 60, 200)}.get(kind, (0, 0, 0)))
    draw = ImageDraw.Draw(img)
    if kind == "sun":
        draw.ellipse((8, 6, 34, 32), fill=(255, 255, 255))
    elif kind == "sea":
        for y in range(0, size[1], 6):
            draw.line((0, y, size[0], y + 3), fill=(230, 240, 255), width=2)
    return img


def encoded(img: Image.Image, fmt: str = "PNG", **save: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(raw).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(url: str, question: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [image_part(url), {"type": "text", "text": question}]}]


SUN = data_url(encoded(picture("sun")))
SEA = data_url(encoded(picture("sea")))


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def complete(c: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return c.chat.completions.create(
        model="demo", messages=messages, max_tokens=kw.pop("max_tokens", 10), temperature=0, **kw
    )


def cached(r: Any) -> int:
    return int(r.usage.prompt_tokens_details.cached_tokens)


async def test_the_picture_decides_the_words_and_the_cache_knows_which(
    vision_model: Path,
) -> None:
    with trio.fail_after(HANG):
        async with served(vision_model) as (_engine, url):
            c = client(url)
            sun = await in_thread(lambda: complete(c, ask(SUN)))
            sea = await in_thread(lambda: complete(c, ask(SEA)))
            sun_again = await in_thread(lambda: complete(c, ask(SUN)))
            c.close()
    assert sun.choices[0].message.content != sea.choices[0].message.content
    assert sun_again.choices[0].message.content == sun.choices[0].message.content
    # The sea's text is the sun's, but reuse stopped at the first image.
    assert cached(sea) == IMAGE_START
    # The same picture again: reused past the image (all but the last token).
    assert cached(sun_again) == sun.usage.prompt_tokens - 1
    assert sun.usage.prompt_tokens == sea.usage.prompt_tokens > IMAGE_START + IMAGE_TOKENS


async def test_the_same_pixels_are_the_same_image_in_any_format(vision_model: Path) -> None:
    """PNG, lossless WebP and the seed's ``images`` extension (raw base64) of
    one picture: one digest, so one answer and a reused cache. JPEG (lossy)
    and a GIF's first frame are decoded too."""
    sun = picture("sun")
    webp = data_url(encoded(sun, "WEBP", lossless=True), "image/webp")
    single, animated = io.BytesIO(), io.BytesIO()
    picture("sea").save(single, "GIF")
    picture("sea").save(animated, "GIF", save_all=True, append_images=[picture("sun")])
    with trio.fail_after(HANG):
        async with served(vision_model) as (_engine, url):
            c = client(url)
            png = await in_thread(lambda: complete(c, ask(SUN)))
            as_webp = await in_thread(lambda: complete(c, ask(webp)))
            raw = base64.b64encode(encoded(sun)).decode()
            extension = await in_thread(
                lambda: complete(
                    c,
                    [{"role": "user", "content": "What is in this picture?", "images": [raw]}],
                )
            )
            jpeg = await in_thread(
                lambda: complete(c, ask(data_url(encoded(sun, "JPEG"), "image/jpeg")))
            )
            still = await in_thread(
                lambda: complete(c, ask(data_url(single.getvalue(), "image/gif")))
            )
            first_frame = await in_thread(
                lambda: complete(c, ask(data_url(animated.getvalue(), "image/gif")))
            )
            c.close()
    text = png.choices[0].message.content
    assert as_webp.choices[0].message.content == text
    assert cached(as_webp) == png.usage.prompt_tokens - 1
    assert extension.choices[0].message.content == text
    assert jpeg.choices[0].finish_reason == "length"
    # An animated GIF is its first frame.
    assert first_frame.choices[0].message.content == still.choices[0].message.content
    assert cached(first_frame) == still.usage.prompt_tokens - 1


async def test_a_conversation_about_a_picture_prefills_only_the_new_turn(
    vision_model: Path, tmp_path: Path
) -> None:
    with trio.fail_after(HANG):
        async with served(vision_model, persist_dir=tmp_path) as (_engine, url):
            c = client(url)
            first = await in_thread(lambda: complete(c, ask(SUN), prompt_cache_key="talk"))

            def turn_two(picture_url: str) -> Any:
                history = [
                    *ask(picture_url),
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And what colour is it?"},
                ]
                return complete(c, history, prompt_cache_key="talk")

            second = await in_thread(lambda: turn_two(SUN))
            # Another picture in the same session: never the sun's state.
            other = await in_thread(lambda: turn_two(SEA))
            c.close()
        # Persistence: a new server on the same directory reuses the session
        # (now the sea's turn, the last one saved under its key).
        async with served(vision_model, persist_dir=tmp_path) as (_engine, url):
            c = client(url)
            again = await in_thread(lambda: turn_two(SEA))
            c.close()
    # Everything up to the assistant's turn (the template's generation prompt
    # opens an empty think block, 4 tokens, that the history does not repeat).
    shared = first.usage.prompt_tokens - 4
    assert cached(second) == shared > IMAGE_START + IMAGE_TOKENS
    assert cached(other) == IMAGE_START
    assert other.choices[0].message.content != second.choices[0].message.content
    assert cached(again) >= shared
    assert again.choices[0].message.content == other.choices[0].message.content


ZTXT_5MB = chunk(b"zTXt", b"Comment\x00\x00" + zlib.compress(b"a" * 5_000_000))
NOISE = encoded(Image.effect_noise((48, 40), 90).convert("RGB"))
BAD = [
    ("https://example.com/cat.png", "image_url.url", "remote image URLs are not fetched"),
    ("data:image/png;base64,@@not base64@@", "image_url.url", "not valid base64"),
    ("data:image/png,rawbytes", "image_url.url", "must be base64"),
    ("data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=", "image_url.url", "unsupported image type"),
    (data_url(encoded(picture("sun"), "BMP")), "image_url.url", "not a PNG, JPEG, WebP or GIF"),
    (data_url(NOISE[: len(NOISE) // 2]), "image_url.url", "could not be decoded"),
    (data_url(encoded(picture("sun", (600, 600)))), "image_url.url", "pixels"),
    (data_url(png_claiming(65_535, 65_535)), "image_url.url", "65535x65535 pixels"),
    (data_url(png_with(ZTXT_5MB)), "image_url.url", "metadata"),
    (data_url(encoded(picture("sun"), "JPEG")[:300], "image/jpeg"), "image_url.url", "cut short"),
    (data_url(b"RIFF\x14\x00\x00\x00WEBPVP8 d\x00\x00\x00", "image/webp"), "image_url.url", "WebP"),
    (data_url(encoded(picture("sun", (1, 5000)))), "image_url.url", "at most 20 to 1"),
    (
        data_url(encoded(Image.effect_noise((160, 160), 90).convert("RGB"))),
        "image_url.url",
        "larger",
    ),
]


async def test_bad_images_get_a_400_naming_the_part(
    vision_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with trio.fail_after(HANG):
        async with served(
            vision_model, max_images=2, max_image_pixels=250_000, max_image_mb=40_000 / MIB
        ) as (engine, url):
            c = client(url)
            for bad, where, says in BAD:
                messages = [
                    {"role": "user", "content": "Look."},
                    {"role": "user", "content": [{"type": "text", "text": "Hm."}, image_part(bad)]},
                ]
                with pytest.raises(openai.BadRequestError) as err:
                    await in_thread(lambda m=messages: complete(c, m))  # type: ignore[misc]
                body: Any = err.value.body
                assert body["code"] == "invalid_image", body
                assert body["param"] == f"messages[1].content[1].{where}", body
                assert says in body["message"], body
            three = [{"role": "user", "content": [image_part(SUN)] * 3}]
            with pytest.raises(openai.BadRequestError) as err:
                await in_thread(lambda: complete(c, three))
            assert "at most 2" in str(err.value)
            # The spelled-out placeholder without pixels is not an image.
            with pytest.raises(openai.BadRequestError) as err:
                await in_thread(lambda: complete(c, [{"role": "user", "content": "<image> hi"}]))
            assert "placeholder" in str(err.value)
            # Nothing ran, and the server still answers.
            assert engine.state().running == ()
            ok = await in_thread(lambda: complete(c, ask(SUN)))
            assert ok.choices[0].finish_reason == "length"
            c.close()
    # A client's bad image is its 400, never a traceback in the log.
    logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in logged] == []


async def test_a_text_only_model_refuses_images(dense_model: Path) -> None:
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url):
            c = client(url)
            with pytest.raises(openai.BadRequestError) as err:
                await in_thread(lambda: complete(c, ask(SUN)))
            c.close()
    body: Any = err.value.body
    assert "text-only" in body["message"]
    assert body["param"] == "messages[0].content"


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        data = await stream.receive_some()
        assert data, "the server closed the stream early"
        buf += data
    return buf


async def test_an_image_request_cancelled_mid_prefill_saves_what_it_computed(
    vision_model: Path,
) -> None:
    """A long text before the picture makes its image prefill (text and image
    as embeddings, 8 tokens a step) take dozens of steps; the client leaves
    after the first, and the state saved at the chunk edge seeds the retry,
    which answers exactly as a server that never saw the prompt does."""
    long_text = "The archive keeps maps of every harbour on the coast. " * 40
    messages = [{"role": "system", "content": long_text}, *ask(SEA)]
    with trio.fail_after(HANG):
        async with served(vision_model) as (_engine, url):
            c = client(url)
            ref = await in_thread(lambda: complete(c, messages, max_tokens=8))
            c.close()
        async with served(vision_model, prefill_step_size=8) as (_engine, url):
            body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
            async with raw_stream(url, body) as stream:
                await read_until(stream, b": prefill")
            # Leaving the block hung up mid-prefill.
            async with httpx.AsyncClient(base_url=url) as h:
                settled = (await h.post("/admin/flush?settle_ms=5000")).json()
                assert settled["settled"] is True
                (entry,) = (await h.get("/v1/cache/stats")).json()["data"]
            c = client(url)
            retry = await in_thread(lambda: complete(c, messages, max_tokens=8))
            c.close()
    assert 8 <= entry["tokens"] < ref.usage.prompt_tokens
    assert cached(retry) == entry["tokens"]
    assert retry.choices[0].message.content == ref.choices[0].message.content


async def test_a_background_image_request_is_parked_and_resumes_byte_identically(
    vision_model: Path,
) -> None:
    body = {
        "messages": ask(SUN),
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
        "priority": "background",
        "stream": True,
    }
    with trio.fail_after(HANG):
        async with served(vision_model) as (engine, url):
            c = client(url)
            alone = await in_thread(
                lambda: complete(
                    c,
                    ask(SUN),
                    max_tokens=200,
                    extra_body={"ignore_eos": True, "priority": "background"},
                )
            )
            frames: list[bytes] = []
            async with httpx.AsyncClient(base_url=url, timeout=60) as h:
                async with h.stream("POST", "/v1/chat/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    async for line in lines:
                        frames.append(line.encode())
                        # Not the opening chunk: the request may still be
                        # queued then, and the person's request would go first.
                        if carries_text(line):
                            break
                    # The background sequence decodes; a person asks something.
                    chat = await in_thread(lambda: complete(c, ask(SEA), max_tokens=4))
                    async for line in lines:
                        frames.append(line.encode())
            c.close()
            assert engine.state().parked == ()
    assert chat.choices[0].finish_reason == "length"
    assert b": parked" in frames
    assert b": resumed" in frames
    text = "".join(
        (json.loads(f[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for f in frames
        if f.startswith(b"data: {")
    )
    assert text == alone.choices[0].message.content


async def test_a_failing_image_prefill_fails_that_request_alone(vision_model: Path) -> None:
    """An embedder hands the engine a picture whose features the vision tower
    cannot take (pixels of the wrong size): the tower raises on the host
    thread inside that sequence's boundary; the request fails alone, while
    an image request and a text request beside it finish."""
    import attrs
    import numpy as np

    from gezel_trio import ChatFinished, EngineConfig, Failed, open_engine
    from gezel_trio.core.images import ImagePart
    from gezel_trio.engine import ChatRequest

    def request(content: Any, parts: tuple[ImagePart, ...] = ()) -> ChatRequest:
        return ChatRequest(
            [{"role": "user", "content": content}], images=parts, max_tokens=6, ignore_eos=True
        )

    sun = ImagePart(base64.b64encode(encoded(picture("sun"))).decode(), "sun")
    image_msg = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    with trio.fail_after(HANG):
        async with open_engine(EngineConfig(model=vision_model)) as engine:
            good = await engine.prepare_chat(request(image_msg, (sun,)))
            text = await engine.prepare_chat(request("Tell me a story."))
            assert good.request.vision is not None
            broken_vision = attrs.evolve(
                good.request.vision, features={"pixel_values": np.zeros((1, 3, 5, 7), "float32")}
            )
            broken = attrs.evolve(good, request=attrs.evolve(good.request, vision=broken_vision))
            ends: dict[str, Any] = {}

            async def run(name: str, prepared: Any) -> None:
                with engine.submit_chat_nowait(prepared) as handle:
                    async for _, event in handle:
                        ends[name] = event

            async with trio.open_nursery() as nursery:
                for name, prepared in (("broken", broken), ("good", good), ("text", text)):
                    nursery.start_soon(run, name, prepared)
            assert engine.state().running == ()
    assert isinstance(ends["broken"], Failed)
    assert "image prefill" in str(ends["broken"].error)
    assert isinstance(ends["good"], ChatFinished)
    assert isinstance(ends["text"], ChatFinished)


async def test_anthropic_image_blocks_are_the_same_image_as_chat_image_urls(
    vision_model: Path,
) -> None:
    """The anthropic SDK sending a base64 ``image`` block: the same prompt
    and the same greedy words as the chat route's ``image_url`` (so the
    prompt cache reuses across protocols), ``count_tokens`` counts the
    image's placeholder tokens, and an image in the wrong place or from a
    remote URL is an Anthropic-shaped 400 naming the block."""
    import anthropic

    raw = base64.b64encode(encoded(picture("sun"))).decode()
    image_block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": raw},
    }
    question = [image_block, {"type": "text", "text": "What is in this picture?"}]
    with trio.fail_after(HANG):
        async with served(vision_model) as (_engine, url):
            c = client(url)
            chat = await in_thread(lambda: complete(c, ask(SUN)))
            c.close()
            a = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)

            def create(content: list[dict[str, Any]], **kw: Any) -> Any:
                return a.messages.create(
                    model="demo",
                    max_tokens=10,
                    messages=[{"role": "user", "content": content}],
                    extra_body={"temperature": 0},
                    **kw,
                )

            msg = await in_thread(lambda: create(question))
            counted = await in_thread(
                lambda: a.messages.count_tokens(
                    model="demo", messages=[{"role": "user", "content": question}]
                )
            )
            remote = {
                "type": "image",
                "source": {"type": "url", "url": "https://example.com/a.png"},
            }
            with pytest.raises(anthropic.BadRequestError) as far:
                await in_thread(lambda: create([remote, {"type": "text", "text": "hi"}]))
            with pytest.raises(anthropic.BadRequestError) as misplaced:
                await in_thread(
                    lambda: a.messages.create(
                        model="demo",
                        max_tokens=5,
                        system=[{"type": "text", "text": "be brief"}],
                        messages=[
                            {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": [image_block]},
                            {"role": "user", "content": "and?"},
                        ],
                    )
                )
            a.close()
    total = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert total == chat.usage.prompt_tokens == counted.input_tokens
    # Served from the chat request's cached prefix, past the image.
    assert msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens - 1
    assert msg.content[0].text == chat.choices[0].message.content
    assert "remote image URLs are not fetched" in str(far.value)
    assert "messages[0].content[0].source.url" in str(far.value)
    assert "only appear in a user message" in str(misplaced.value)
    assert "messages[1].content[0]" in str(misplaced.value)


async def test_responses_input_images_are_the_same_image_and_ride_a_chain(
    vision_model: Path,
) -> None:
    """The openai SDK's Responses API with an ``input_image``: the same
    prompt and greedy words as the chat route's ``image_url``, and a
    ``previous_response_id`` continuation still sees the picture (its
    prefix, image included, comes from the cache). A remote URL is a 400
    naming the part."""
    question = [
        {"type": "input_image", "image_url": SUN},
        {"type": "input_text", "text": "What is in this picture?"},
    ]
    with trio.fail_after(HANG):
        async with served(vision_model) as (_engine, url):
            c = client(url)
            chat = await in_thread(lambda: complete(c, ask(SUN)))

            def respond(content: Any, **kw: Any) -> Any:
                return c.responses.create(
                    model="demo",
                    input=[{"role": "user", "content": content}],
                    max_output_tokens=10,
                    temperature=0,
                    **kw,
                )

            first = await in_thread(lambda: respond(question))
            second = await in_thread(
                lambda: respond("And what colour is it?", previous_response_id=first.id)
            )
            remote = [{"type": "input_image", "image_url": "https://example.com/a.png"}]
            with pytest.raises(openai.BadRequestError) as far:
                await in_thread(lambda: respond(remote))
            c.close()
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.input_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1
    assert first.output_text == chat.choices[0].message.content
    assert second.status in ("completed", "incomplete")
    # The chain's prompt starts with the first turn, picture and all, cached.
    assert second.usage.input_tokens_details.cached_tokens > IMAGE_START + IMAGE_TOKENS
    assert "remote image URLs are not fetched" in str(far.value)
    assert "input[0].content[0].image_url" in str(far.value)
