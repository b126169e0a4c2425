"""The generator lanes: one ``BatchGenerator`` per priority lane, and the
requests in each.

A parked background wave keeps its generator (KV, processors, positions)
untouched while the interactive lane's generator runs, and resumes at the
step it stopped. A sequence with images prefills them first, a chunk per
step of its lane (``vision.ImagePrefills``), then joins its lane's
generator. Every call runs on the engine's host thread, on the backend's
stream.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from ..core.backend import Admission, Captured, PrefillOut, StepOutput, TokenOut
from ..core.config import EngineConfig
from ..core.request import Priority
from . import mlx_lm_surface
from .decoding import Decoding
from .generators import Generators
from .speculation import Roster
from .states import CacheLayout
from .vision import ImagePrefills, VisionModel

__all__ = ["Lanes"]


class _Lane:
    """One BatchGenerator and its request-id <-> uid maps."""

    def __init__(self, gen: BatchGenerator, roster: Roster) -> None:
        self.gen = gen
        self.uid_of: dict[int, int] = {}
        self.rid_of: dict[int, int] = {}
        # How its sequences speculate (``mlx.speculation``).
        self.roster = roster
        # Whether its KV is quantized yet (``--quantized-kv-start``).
        self.quantized = False


class Lanes:
    """The requests of every lane: insert, step, capture, remove."""

    def __init__(
        self,
        config: EngineConfig,
        model: Any,
        tokenizer: Any,
        layout: CacheLayout,
        decoding: Decoding,
        *,
        vision: VisionModel | None,
        group: Any,
        stops: Collection[int],
        stream: Any,
    ) -> None:
        self.kit = Generators(
            config,
            model,
            tokenizer,
            layout.new(),
            vision=vision is not None,
            group=group,
            stream=stream,
        )
        self._layout = layout
        self._decoding = decoding
        self._stream = stream
        self._eos_stops = StopSequences([[e] for e in sorted(stops)])
        self._no_stops = StopSequences()
        self.lanes: dict[Priority, _Lane] = {}
        self._lane_of: dict[int, _Lane] = {}
        self._images = ImagePrefills(vision, config.scheduling.prefill_step_size, stream)

    def _lane(self, priority: Priority) -> _Lane:
        lane = self.lanes.get(priority)
        if lane is None:
            roster = Roster()
            lane = self.lanes[priority] = _Lane(self.kit.new_generator(roster), roster)
        return lane

    def insert(self, admissions: Sequence[Admission]) -> dict[int, Exception]:
        """Each admission on its own: one whose sampler, processors or seed
        state cannot be built or queued is refused alone."""
        failed: dict[int, Exception] = {}
        for a in admissions:
            try:
                lane = self._lane(a.request.priority)
                if not self._images.queue(a, self._decoding.processors):
                    self._insert_generator(lane, a)
            except Exception as exc:
                failed[a.rid] = exc
        return failed

    def _insert_generator(self, lane: _Lane, adm: Admission) -> None:
        r = adm.request
        rid = adm.rid
        seed_tokens = list(adm.seed_tokens)
        if r.vision is not None:
            # The generator sees the model's ids, never the cache key's.
            seed_tokens = list(r.vision.model_tokens[: len(seed_tokens)])
        sampling, sampler, procs = self._decoding.sampler(rid, r)
        # mlx-lm would make a plain cache: the batch holds one format.
        state = adm.seed_state if adm.seed_state is not None else self._layout.new()
        if self._layout.start is not None:
            state = self._lane_format(lane, state)
        (uid,) = lane.gen.insert_segments(
            [[list(seg) for seg in adm.segments]],
            max_tokens=[r.max_tokens],
            caches=[state],
            all_tokens=[seed_tokens],
            samplers=[sampler],
            logits_processors=[procs],
            # A grammar decides where the output ends, and then allows only
            # EOS: ignore_eos must not keep a finished constrained output going.
            stop_sequences=[
                self._no_stops if r.ignore_eos and r.constraint is None else self._eos_stops
            ],
        )
        lane.uid_of[rid] = uid
        lane.rid_of[uid] = rid
        if r.cache is not None and r.cache.salt:
            lane.roster.salts[uid] = r.cache.salt
        if not r.speculate:
            lane.roster.opted_out.add(uid)
        elif (unseeded := self._decoding.unseeded(sampling)) is not None:
            lane.roster.sampled[uid] = unseeded
        self._lane_of[rid] = lane
        self._decoding.started(rid, r)

    def _lane_format(self, lane: _Lane, state: list[Any]) -> list[Any]:
        """``state`` in the format of the lane it joins (one batch holds
        one format): an empty lane starts unquantized again; a quantized
        seed quantizes the lane; a lane already quantized quantizes the
        seed."""
        start = self._layout.start
        assert start is not None
        if not lane.uid_of:
            lane.quantized = False
        if start.holds_quantized(state):
            if not lane.quantized:
                start.quantize_generator(lane.gen)
                lane.quantized = True
            return start.quantize_state(state)  # a layer not yet quantized
        return start.quantize_state(state) if lane.quantized else state

    def remove(self, rids: Sequence[int]) -> dict[int, Captured]:
        out = {}
        for rid in rids:
            prefill = self._images.take(rid)
            if prefill is not None:
                with mx.stream(self._stream):
                    state = prefill.snapshot()
                out[rid] = Captured(state, prefill.key[: prefill.pos])
        for lane in self.lanes.values():
            uids = [lane.uid_of.pop(r) for r in rids if r in lane.uid_of]
            if not uids:
                continue
            with mx.stream(self._stream):
                got = lane.gen.remove(uids, return_prompt_caches=True)
            for uid in uids:
                rid = lane.rid_of.pop(uid)
                lane.roster.forget(uid)
                self._lane_of.pop(rid, None)
                self._decoding.forget(rid)
                if uid in got:
                    state, tokens = got[uid]
                    out[rid] = Captured(list(state), self._images.key(rid, tokens))
                self._images.forget(rid)
        return out

    def capture(self, rid: int) -> Captured | None:
        prefill = self._images.find(rid)
        if prefill is not None:
            with mx.stream(self._stream):
                return Captured(prefill.snapshot(), prefill.key[: prefill.pos])
        lane = self._lane_of.get(rid)
        uid = lane.uid_of.get(rid) if lane is not None else None
        if lane is None or uid is None:
            return None
        with mx.stream(self._stream):
            got = lane.gen.extract_cache([uid]).get(uid)
        if got is None:
            return None
        return Captured(list(got[0]), self._images.key(rid, got[1]))

    def step(self, lane_name: Priority) -> StepOutput:
        if self.kit.gated_delta is None:
            return self._step(lane_name)
        # mlx-lm's gated delta rule is this backend's for the step only.
        with mlx_lm_surface.gated_delta_kernel_as(self.kit.gated_delta):
            return self._step(lane_name)

    def _step(self, lane_name: Priority) -> StepOutput:
        if self.kit.threads is not None:
            self._before_step(lane_name)
        image_progress, image_failed = self._images.step(
            lane_name, lambda adm: self._insert_generator(self._lane(lane_name), adm)
        )
        lane = self.lanes.get(lane_name)
        if lane is None:
            return StepOutput(tuple(image_progress), (), tuple(image_failed))
        try:
            with mx.stream(self._stream):
                prompt_responses, gen_responses = lane.gen.next()
                start = self._layout.start
                if start is not None and not lane.quantized and start.due(lane.gen):
                    start.quantize_generator(lane.gen)
                    lane.quantized = True
        finally:
            failed = (*image_failed, *self._decoding.faults.take())
        rid_of = lane.rid_of
        offset = self._images.offset
        prefill = (
            *image_progress,
            *(
                PrefillOut(
                    rid_of[r.uid],
                    int(r.progress[0]) + offset(rid_of[r.uid]),
                    int(r.progress[1]) + offset(rid_of[r.uid]),
                    bool(r.end_of_segment),
                )
                for r in prompt_responses
                if r.uid in rid_of and not r.end_of_prompt
            ),
        )
        tokens = []
        for r in gen_responses:
            rid = rid_of.get(r.uid)
            if rid is None:
                continue
            finish: Literal["stop", "length"] | None = r.finish_reason
            logprob, top = self._decoding.token_logprobs(rid, int(r.token), r.logprobs)
            drafted, accepted = getattr(r, "drafted", 0), getattr(r, "accepted", 0)
            if finish is None:
                tokens.append(
                    TokenOut(rid, int(r.token), None, None, (), logprob, top, drafted, accepted)
                )
                continue
            state = list(r.prompt_cache) if r.prompt_cache is not None else None
            held = self._images.key(rid, r.all_tokens or ())
            tokens.append(
                TokenOut(rid, int(r.token), finish, state, held, logprob, top, drafted, accepted)
            )
            self._decoding.forget(rid)
            self._images.forget(rid)
            del rid_of[r.uid]
            del lane.uid_of[rid]
            lane.roster.forget(r.uid)
            self._lane_of.pop(rid, None)
        return StepOutput(prefill, tuple(tokens), failed)

    def _before_step(self, lane_name: Priority) -> None:
        """OpenBLAS's threads for what the lane's next step runs: its
        decoding sequences, and whether a prompt or an image prefills (a
        verify says its own rows, ``mlx.speculation``)."""
        assert self.kit.threads is not None
        lane = self.lanes.get(lane_name)
        gen = lane.gen if lane is not None else None
        decoding = len(mlx_lm_surface.generation_batch(gen)) if gen is not None else 0
        prefilling = self._images.waiting(lane_name) or (
            gen is not None and mlx_lm_surface.prefilling(gen)
        )
        self.kit.threads.before_step(decoding, prefilling)

    def reset(self, lane_name: Priority) -> None:
        self._images.reset(lane_name)
        lane = self.lanes.pop(lane_name, None)
        if lane is not None:
            for rid in lane.uid_of:
                self._lane_of.pop(rid, None)
                self._decoding.logprobs.pop(rid, None)
                self._images.forget(rid)
            lane.gen.close()
        self.kit.reclaim()

    def close(self) -> None:
        for name in list(self.lanes):
            self.reset(name)
        self._images.clear()
        mx.synchronize(self._stream)
        self.kit.close()
