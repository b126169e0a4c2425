"""Vision-language models through mlx-vlm, on the engine's host thread.

mlx-vlm loads the model (the directory's ``model_type`` decides: a config
with a ``vision_config`` and the processor's files is a vision model) and its
processor. The language part is then served by mlx-lm's own model class for
the text config, built around the very same weight arrays (nothing is
copied): the engine's ``BatchGenerator``, prompt cache and per-sequence
machinery work on it unchanged, and a text request and an image request
decode in one batch. The seed measured mlx-vlm's language towers under
batched decode at about 3x mlx-lm's per-token slope, which is the other
reason to decode on mlx-lm's class.

What images add is their prefill (``VisionPrefill``): the vision tower and
projector turn the pixels into embeddings that replace the placeholder
tokens (``model.get_input_embeddings``), and the language model prefills
those embeddings chunk by chunk into a plain mlx-lm ``KVCache``. That runs
on the host thread, one chunk per engine step of the sequence's lane,
between the batch's steps, so decoding sequences keep moving while an image
prefills, as they do while text prefills in ``BatchGenerator``. Once the
last image is in the cache, the sequence joins its lane's ``BatchGenerator``
seeded with that cache, and the text after the image prefills and decodes
with the batch.

This needs a language model whose positions are plain token offsets: models
with multimodal rotary positions (Qwen2-VL's M-RoPE and its kin) keep
per-sequence position deltas that mlx-lm's class does not know, so they are
refused at load with a clear error rather than served wrong.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..core.backend import Admission, PrefillOut
from ..core.errors import InvalidRequest, ModelLoadError
from ..core.images import VisionPrompt
from ..core.request import GenerationRequest, Priority
from . import mlx_lm_surface

__all__ = ["ImagePrefills", "VisionModel", "VisionPrefill", "is_vision_model", "load_vision"]

log = logging.getLogger("gezel_trio.mlx")

# Language models with multimodal rotary positions (per-sequence deltas).
_MROPE_TYPES = frozenset(
    {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_omni_moe",
        "glm4v",
        "glm4v_moe",
        "ernie4_5_moe_vl",
        "paddleocr_vl",
        "dots_ocr",
        "kimi_vl",
        "hunyuan_vl",
    }
)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_vision_model(path: Path) -> bool:
    """Whether ``path`` holds a vision-language model: a vision config and
    the image processor's file."""
    cfg = _read_config(path)
    return bool(cfg.get("vision_config")) and (path / "preprocessor_config.json").exists()


class VisionModel:
    """The loaded VLM: ``text`` is the mlx-lm language model the engine
    batches, ``processor`` the mlx-vlm/transformers processor, and
    ``image_token`` the placeholder id one image expands to. Also the
    engine's ``ImagePreparer``."""

    def __init__(self, vlm: Any, processor: Any, text: Any, image_token: int) -> None:
        self.vlm = vlm
        self.processor = processor
        self.text = text
        self._image_token = image_token

    @property
    def image_token(self) -> int:
        return self._image_token

    def prepare(self, text: str, images: Sequence[Any]) -> tuple[tuple[int, ...], Any]:
        """The processor on a worker thread: resizing and normalising are
        numpy/PIL work. mlx-vlm's processors hand back their numpy output
        wrapped as ``mx.array`` (a copy that runs no computation and uses no
        stream); every MLX operation on it runs on the host thread."""
        out = self.processor(images=list(images), text=[text])
        ids = out["input_ids"]
        tokens = tuple(int(t) for t in (ids.tolist()[0] if hasattr(ids, "tolist") else ids[0]))
        features = {k: v for k, v in dict(out).items() if k not in ("input_ids", "attention_mask")}
        return tokens, features


def load_vision(path: Path, adapt: Callable[[Any], str]) -> tuple[VisionModel, Any, str]:
    """Load a VLM on the host thread: ``(VisionModel, its mlx-lm tokenizer,
    the weight format)``; ``adapt`` adapts the weights to the device first
    (``loading``). Raises ``ModelLoadError`` for what cannot be served."""
    try:
        from mlx_vlm.utils import load as vlm_load
    except ImportError as exc:
        raise ModelLoadError(
            f"{path} is a vision model; install the vision extra (mlx-vlm): {exc}"
        ) from exc
    from mlx_lm.utils import load_tokenizer

    cfg = _read_config(path)
    model_type = str(cfg.get("model_type"))
    text_cfg = dict(cfg.get("text_config") or {})
    if model_type in _MROPE_TYPES or "mrope_section" in (text_cfg.get("rope_scaling") or {}):
        raise ModelLoadError(
            f"{path}: {model_type} models use multimodal rotary positions, which this "
            "server does not batch yet; LLaVA-style models (plain positions) are served"
        )
    try:
        vlm, processor = vlm_load(str(path), trust_remote_code=False)
    except Exception as exc:
        raise ModelLoadError(
            f"could not load {path} with mlx-vlm: {type(exc).__name__}: {exc}"
        ) from exc
    weights = adapt(vlm)
    language = vlm.language_model
    # The text config as mlx-vlm completed it (its defaults), then as stored.
    full = {**_asdict(getattr(language, "config", None)), **text_cfg}
    try:
        model_cls, args_cls = mlx_lm_surface.model_classes(full)
        text = model_cls(args_cls.from_dict(full))
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: its language model ({full.get('model_type')}) is not one mlx-lm "
            f"knows: {type(exc).__name__}: {exc}"
        ) from exc
    ours = dict(tree_flatten(text.parameters()))
    theirs = dict(tree_flatten(language.parameters()))
    if set(ours) != set(theirs) or any(ours[k].shape != theirs[k].shape for k in ours):
        missing = sorted(set(ours) ^ set(theirs))[:3]
        raise ModelLoadError(
            f"{path}: mlx-vlm's language model does not map onto mlx-lm's "
            f"{full.get('model_type')} (differs at {missing or 'parameter shapes'})"
        )
    # The same arrays: nothing is copied, the two views stay in step.
    text.update(language.parameters())
    text.eval()
    if any(type(c) is not KVCache for c in make_prompt_cache(text)):
        # An image prefill is cut and saved as plain attention KV.
        raise ModelLoadError(
            f"{path}: vision models with sliding-window or linear-attention layers "
            "are not served yet (every layer must keep plain attention KV)"
        )
    tokenizer = load_tokenizer(
        path, {"local_files_only": True}, eos_token_ids=cfg.get("eos_token_id")
    )
    image_token = _image_token(cfg, processor)
    return VisionModel(vlm, processor, text, image_token), tokenizer, weights


def _asdict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if attrs.has(type(config)):
        return attrs.asdict(config)
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    return {}


def _image_token(cfg: dict[str, Any], processor: Any) -> int:
    for key in ("image_token_index", "image_token_id"):
        value = cfg.get(key)
        if isinstance(value, int):
            return value
    value = getattr(processor, "image_token_id", None)
    if isinstance(value, int):
        return value
    raise ModelLoadError("the vision model names no image token (image_token_index)")


@attrs.define
class VisionPrefill:
    """One sequence's image prefill, advanced a chunk per step of its lane.

    ``cache`` starts as the seed the prompt cache gave (or empty) holding
    ``pos`` tokens; ``end`` is where the last image ends. ``cuts`` are the
    positions where the admission wants a snapshot (segment ends)."""

    rid: int
    prompt: VisionPrompt
    key: tuple[int, ...]  # the prompt as the cache knows it
    cache: list[Any]
    pos: int
    end: int
    seed: int
    total: int
    cuts: frozenset[int]
    embeds: Any = None

    def advance(self, model: VisionModel, chunk: int) -> None:
        """Prefill the next chunk (host thread). The vision tower runs once,
        on the first chunk, over every image of the prompt."""
        ids = mx.array(self.prompt.model_tokens[: self.end])[None]
        if self.embeds is None:
            out = model.vlm.get_input_embeddings(input_ids=ids, **self.prompt.features)
            embeds = getattr(out, "inputs_embeds", out)
            mx.eval(embeds)
            self.embeds = embeds
        stop = min([self.end, self.pos + chunk, *(c for c in self.cuts if c > self.pos)])
        model.text.model(
            ids[:, self.pos : stop],
            cache=self.cache,
            input_embeddings=self.embeds[:, self.pos : stop].astype(_dtype(model)),
        )
        mx.eval([c.state for c in self.cache])
        self.pos = stop

    @property
    def done(self) -> bool:
        return self.pos >= self.end

    def snapshot(self) -> list[Any]:
        """An independent copy of the cache, cut to exactly ``pos`` tokens."""
        out = []
        for c in self.cache:
            copy = KVCache()
            if c.keys is not None:
                copy.keys = mx.array(c.keys[..., : c.offset, :])
                copy.values = mx.array(c.values[..., : c.offset, :])
                copy.offset = c.offset
            out.append(copy)
        mx.eval([c.state for c in out if c.keys is not None])
        return out


def _dtype(model: VisionModel) -> Any:
    return model.text.model.embed_tokens.weight.dtype


def fresh_cache(model: VisionModel) -> list[Any]:
    return list(make_prompt_cache(model.text))


class ImagePrefills:
    """The image prefills waiting for their lanes' steps, oldest first, and
    the sequences with images: their key prompt (the tokens the host and
    the cache see) and how many tokens their image prefill counted before
    the generator took over."""

    def __init__(self, model: VisionModel | None, chunk: int, stream: Any) -> None:
        self._model = model
        self._chunk = chunk
        self._stream = stream
        self._pending: dict[Priority, list[tuple[VisionPrefill, Admission]]] = {}
        self._keys: dict[int, tuple[int, ...]] = {}
        self._offset: dict[int, int] = {}

    def queue(self, adm: Admission, check: Callable[[GenerationRequest], object]) -> bool:
        """Whether ``adm`` waits here for its images to prefill (``check``
        refuses a bad request now, not later); ``False``: it goes to the
        generator as it is."""
        vision = adm.request.vision
        if vision is None:
            return False
        if self._model is None:
            raise InvalidRequest("this model takes no images", param="messages")
        seed = len(adm.seed_tokens)
        if seed < vision.end:
            # The images are not all in the seed: prefill them first.
            check(adm.request)  # refuse a bad grammar now, not later
            cuts, pos = set(), seed
            for segment in adm.segments:
                pos += len(segment)
                cuts.add(pos)
            prefill = VisionPrefill(
                rid=adm.rid,
                prompt=vision,
                key=adm.request.prompt,
                cache=adm.seed_state if adm.seed_state is not None else fresh_cache(self._model),
                pos=seed,
                end=vision.end,
                seed=seed,
                total=len(adm.request.prompt) - seed,
                cuts=frozenset(cuts),
            )
            self._pending.setdefault(adm.request.priority, []).append((prefill, adm))
            return True
        self._keys[adm.rid] = adm.request.prompt
        return False

    def _joined(self, prefill: VisionPrefill, adm: Admission) -> Admission:
        """An image prefill is done: the sequence joins its lane's generator,
        seeded with what the prefill computed; the text after the last image
        prefills and decodes with the batch."""
        rest: list[tuple[int, ...]] = []
        pos = prefill.seed
        for segment in adm.segments:
            lo, hi = pos, pos + len(segment)
            if hi > prefill.end:
                rest.append(segment[max(0, prefill.end - lo) :])
            pos = hi
        self._keys[adm.rid] = adm.request.prompt
        self._offset[adm.rid] = prefill.end - prefill.seed
        return attrs.evolve(
            adm,
            segments=tuple(rest),
            seed_state=prefill.cache,
            seed_tokens=adm.request.prompt[: prefill.end],
        )

    def key(self, rid: int, tokens: Sequence[int]) -> tuple[int, ...]:
        """A sequence's tokens as the cache knows them, each image keyed by its content."""
        key = self._keys.get(rid)
        if key is None:
            return tuple(tokens)
        n = min(len(tokens), len(key))
        return (*key[:n], *tokens[n:])

    def offset(self, rid: int) -> int:
        return self._offset.get(rid, 0)

    def forget(self, rid: int) -> None:
        self._keys.pop(rid, None)
        self._offset.pop(rid, None)

    def take(self, rid: int) -> VisionPrefill | None:
        for pending in self._pending.values():
            for i, (prefill, _) in enumerate(pending):
                if prefill.rid == rid:
                    del pending[i]
                    return prefill
        return None

    def find(self, rid: int) -> VisionPrefill | None:
        for pending in self._pending.values():
            for prefill, _ in pending:
                if prefill.rid == rid:
                    return prefill
        return None

    def waiting(self, lane_name: Priority) -> bool:
        return bool(self._pending.get(lane_name))

    def step(
        self, lane_name: Priority, join: Callable[[Admission], None]
    ) -> tuple[list[PrefillOut], list[tuple[int, Exception]]]:
        """One chunk of the lane's oldest image prefill, inside that
        sequence's own failure boundary; a finished one joins the generator
        first (``join``, so a capture between steps still finds it here)."""
        pending = self._pending.get(lane_name)
        progress: list[PrefillOut] = []
        failed: list[tuple[int, Exception]] = []
        if not pending or self._model is None:
            return progress, failed
        while pending and pending[0][0].done:
            prefill, adm = pending.pop(0)
            try:
                join(self._joined(prefill, adm))
            except Exception as exc:
                self.forget(prefill.rid)
                failed.append((prefill.rid, exc))
        if pending:
            prefill = pending[0][0]
            try:
                with mx.stream(self._stream):
                    prefill.advance(self._model, self._chunk)
            except Exception as exc:
                pending.pop(0)
                failed.append((prefill.rid, exc))
                # Whatever the failed graph left queued on the stream is run
                # now: a stream left with such work aborts the process when
                # it exits (mlx 0.32, seen with a vision tower that raised).
                mx.synchronize(self._stream)
            else:
                progress.append(
                    PrefillOut(
                        prefill.rid,
                        prefill.pos - prefill.seed,
                        prefill.total,
                        prefill.pos in prefill.cuts,
                    )
                )
        return progress, failed

    def reset(self, lane_name: Priority) -> None:
        for prefill, _ in self._pending.pop(lane_name, []):
            self.forget(prefill.rid)

    def clear(self) -> None:
        self._pending.clear()
