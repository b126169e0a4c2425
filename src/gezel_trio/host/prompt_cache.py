"""The prompt-cache service: seeding, checkpoints, saves, names, disk.

Lives on the engine's host thread beside the backend whose opaque states it
keeps; it touches those states only through the backend's cache operations,
so the same logic serves the MLX backend and the scripted testing backend.
The entries themselves live in ``cache_store.CacheStore``, one
content-addressed store for every request: a request without any
cache id is cached exactly like a named session, and a name is only a handle
onto an entry that lives longer.

For each admitted sequence it decides:

* where to start: the deepest position of the store the prompt shares (any
  prefix of a stored path on models whose caches rewind; an entry end on the
  others), or a longer one from disk, which is loaded into the store first.
  The lookup runs at admission, on this thread, so whatever a sibling saved
  while this request waited is already seen.
* where to cut (models whose caches cannot rewind): at the message
  boundaries the renderer found (end of the system turn, end of the
  history), at ``len(prompt) - 1`` so a retried request resumes at once,
  and at the shared band's end. Each cut is saved as an entry the moment it
  is captured, so a later failure cannot lose it and a sibling can use it.
* what to save when it ends: the final state, whatever the ending - a
  finished turn its post-generation state, a cancelled one whatever it
  had computed beyond its seed (a chunk edge of its prefill, or the prompt
  plus the tokens generated before the client left). A state whose layer
  offsets disagree with its tokens is never saved.

Every decision is one log line on ``gezel_trio.cache``.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from ..core.backend import Admission, Captured, StateBlocks
from ..core.cache_plan import SNAPSHOT_MARGIN, common_prefix, snapshot_cut, split_segments
from ..core.cache_store import BlockHasher, CacheStore, Entry, EntryKind, Node, Seed
from ..core.events import CacheMiss, CacheMissReason
from ..core.request import CacheRequest, GenerationRequest, Pin
from .persist import DiskCache, DiskEntry

__all__ = [
    "CacheBook",
    "CacheDelta",
    "CacheRow",
    "CacheSnapshot",
    "CacheTotals",
    "CacheView",
    "PromptCache",
    "SeedInfo",
]

log = logging.getLogger("gezel_trio.cache")


@attrs.frozen
class SeedInfo:
    """What admission decided, for usage (``reuse`` is ``cached_tokens``) and logs."""

    reuse: int
    source: str
    mode: str
    # Where the prompt left the cache, when it reused less than the cache
    # held for it (``core.events.CacheMiss``).
    miss: CacheMiss | None = None
    # Prompt tokens written into new pinned entries, by ttl bucket.
    pinned_5m: int = 0
    pinned_1h: int = 0


@attrs.frozen
class CacheView:
    """One entry as ``/v1/cache/stats`` shows it. ``bytes`` is what it would
    cost alone; blocks shared with other entries are counted in each."""

    cache_id: str
    tokens: int
    bytes: int
    kind: str
    last_used: float
    dirty: bool
    pinned: bool
    hits: int = 0
    # A ``cache_control`` pin: seconds until eviction may take it again.
    pin_expires_in: float | None = None
    # Named by a client (a cache id), not an anonymous entry.
    named: bool = True
    # The entry's salt (``CacheRequest.salt``): whose it is, for the HTTP layer.
    salt: str = ""


@attrs.frozen
class CacheTotals:
    """The store as a whole: ``bytes`` really held (shared blocks once),
    ``logical_bytes`` the sum of the entries' own sizes, and the hit
    counters since start."""

    entries: int = 0
    named: int = 0
    blocks: int = 0
    bytes: int = 0
    logical_bytes: int = 0
    budget_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    # The seeded prefix ids remembered (bounded: ``SEEDED_PREFIXES_KEPT``).
    seeded_prefixes: int = 0


@attrs.frozen
class CacheSnapshot:
    entries: tuple[CacheView, ...] = ()
    totals: CacheTotals = CacheTotals()


@attrs.frozen
class CacheRow:
    """One entry's view as the host last saw it changed: what ``CacheView``
    shows, with what depends on the time (a pin's ``held_until``, read
    against the delta's ``now``) and its place in the order (``last_use``)."""

    serial: int
    cache_id: str
    tokens: int
    bytes: int
    kind: str
    last_used: float
    dirty: bool
    pinned: bool
    hits: int
    held_until: float
    named: bool
    last_use: int
    salt: str = ""

    def view(self, now: float) -> CacheView:
        held = self.held_until > now
        return CacheView(
            cache_id=self.cache_id,
            tokens=self.tokens,
            bytes=self.bytes,
            kind="pin" if held else self.kind,
            last_used=self.last_used,
            dirty=self.dirty,
            pinned=self.pinned,
            hits=self.hits,
            pin_expires_in=round(self.held_until - now, 3) if held else None,
            named=self.named,
            salt=self.salt,
        )


@attrs.frozen
class CacheDelta:
    """What changed in the prompt cache since the last delta: the rows of
    the entries changed, the serials of those removed, the totals, and the
    host clock's time (what a pin's remaining seconds are read against)."""

    rows: tuple[CacheRow, ...] = ()
    removed: tuple[int, ...] = ()
    totals: CacheTotals = CacheTotals()
    now: float = 0.0


class CacheBook:
    """The Trio side's copy of the prompt cache's view, kept from the
    host's deltas (``PromptCache.delta``): a delta costs what changed, and
    the ordered entries are built when someone reads them (``/v1/cache/stats``,
    a test), not at every admission and end. It shows what
    ``PromptCache.view`` would have shown when the delta was taken."""

    def __init__(self) -> None:
        self._rows: dict[int, CacheRow] = {}
        self._now = 0.0
        self._entries: tuple[CacheView, ...] | None = ()
        self.totals = CacheTotals()

    def apply(self, delta: CacheDelta) -> None:
        for serial in delta.removed:
            self._rows.pop(serial, None)
        for row in delta.rows:
            self._rows[row.serial] = row
        self.totals = delta.totals
        self._now = delta.now
        self._entries = None

    @property
    def entries(self) -> tuple[CacheView, ...]:
        """Named entries first, then the rest, each most recently used first."""
        if self._entries is None:
            rows = sorted(self._rows.values(), key=lambda r: (not r.named, -r.last_use))
            self._entries = tuple(r.view(self._now) for r in rows)
        return self._entries


@attrs.define
class _Seq:
    prompt: tuple[int, ...]
    cache: CacheRequest
    reuse: int
    seed: Entry | None
    cuts: dict[int, set[str]]
    snapshot: Entry | None = None
    warned: bool = False
    # Pins whose entry this sequence is to save (at its cut, or at the end).
    pins: tuple[Pin, ...] = ()


# Seconds write-behind pauses after a failed write (a full or read-only
# disk): eviction, flushes and the shutdown still write, and report.
BEHIND_BACKOFF = 5.0
# Writes behind staged and not yet landed, at most: one being sealed, the
# next one staged, so a slow disk never piles temp files up.
BEHIND_IN_FLIGHT = 2
# How many seeded prefix ids a process remembers (``_publish_prefix``).
SEEDED_PREFIXES_KEPT = 4096


def _reaching(node: Node, pos: int) -> Entry | None:
    """The most recently used entry through ``node`` that holds tokens past
    ``pos``: the cached side of a divergence there."""
    return CacheStore.recent_through(node, pos, past=True)


def _short(key: str) -> str:
    return key if len(key) <= 64 else key[:61] + "..."


def _sound(cap: Captured, ops: StateBlocks) -> bool:
    """Every layer that tracks a position agrees with the tokens."""
    n = len(cap.tokens)
    return n > 0 and all(off is None or off == n for off in ops.state_offsets(cap.state))


def _file_key(entry: Entry) -> str:
    if entry.key is not None:
        return "name:" + entry.key
    digest = hashlib.sha256(_salt_bytes(entry.salt))
    digest.update(b"".join(map(_token_bytes, entry.tokens)))
    return "anon:" + digest.hexdigest()[:32]


def _salt_bytes(salt: str) -> bytes:
    # Unsalted entries keep their keys; a salted one's key starts with what
    # no token's bytes can be (ids below 2**31, image keys start with 0xff).
    return b"\xfe\xfe\xfe\xfe" + salt.encode("utf-8", "surrogatepass") + b"\0" if salt else b""


# Pins up to 5 minutes count as Anthropic's 5m cache writes, longer as 1h.
_SHORT_PIN = 300.0


def _token_bytes(token: int) -> bytes:
    # Image keys (core.images) are negative and wider than a token id; text
    # tokens keep the 4-byte form, so existing files keep their keys.
    if token >= 0:
        return token.to_bytes(4, "little")
    return b"\xff\xff\xff\xff" + (-token).to_bytes(8, "little")


# Tokens of context on each side of a divergence: enough to read which line
# changed, few enough that decoding them costs microseconds on this thread.
_BEFORE, _AFTER = 8, 24


class _EvictedTrail:
    """Digests of the block-aligned prefixes of entries the memory budget
    evicted, so a miss can say an eviction cost it: a chained hash per block
    (one pass over an entry's tokens), at most ``limit`` kept, oldest first
    out. Digests only: no tokens, no states."""

    def __init__(self, block: int, limit: int = 16384) -> None:
        self._block = block
        self._limit = limit
        self._reach: OrderedDict[int, int] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._reach)

    def _chain(self, tokens: Sequence[int], salt: str = "") -> Iterator[tuple[int, int]]:
        # Python's tuple hash, chained: a third of what blake2b over the
        # packed tokens cost (0.5 ms for a 20k-token prompt), and a 64-bit
        # collision only misnames a miss in this process. A salt starts the
        # chain, so one salt's evictions say nothing of another's prompts.
        digest = hash(salt) if salt else 0
        tokens = tuple(tokens)
        for start in range(0, len(tokens) - self._block + 1, self._block):
            digest = hash((digest, tokens[start : start + self._block]))
            yield digest, start + self._block

    def record(self, tokens: Sequence[int], salt: str = "") -> None:
        for digest, depth in self._chain(tokens, salt):
            self._reach[digest] = depth
            self._reach.move_to_end(digest)
        while len(self._reach) > self._limit:
            self._reach.popitem(last=False)

    def reach(self, prompt: Sequence[int], salt: str = "") -> int:
        """How far into ``prompt`` an evicted entry reached (block-aligned)."""
        best = 0
        for digest, depth in self._chain(prompt, salt):
            if digest not in self._reach:
                break
            best = depth
        return best


class PromptCache:
    def __init__(
        self,
        ops: StateBlocks,
        *,
        model_trimmable: bool,
        budget_bytes: int,
        disk: DiskCache | None = None,
        disk_budget_bytes: int = 0,
        decode: Any = None,
        block_tokens: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        self._ops = ops
        self._trimmable = model_trimmable
        extra = {} if block_tokens is None else {"block_tokens": block_tokens}
        # Pins expire by this clock (tests drive it).
        self._clock = clock
        self.store = CacheStore(
            budget_bytes,
            trimmable=model_trimmable,
            before_evict=self._before_evict,
            now=clock,
            # With KV events on (host.kv_events): the blocks they announce.
            block_hasher=block_hasher,
            **extra,
        )
        # An anonymous entry's file key (a digest of all its tokens), worked
        # out once: the view and the writers ask for it again and again.
        self._anon_keys: dict[Entry, str] = {}
        self.disk = disk
        self._disk_budget = disk_budget_bytes
        self._seqs: dict[int, _Seq] = {}
        # Prefix ids seeded in this process, oldest first, at most
        # ``SEEDED_PREFIXES_KEPT``: one forgotten is only seeded again (its
        # entry is kept unless the new one is shorter), so the set need not
        # grow with every id a client ever sent.
        self._seeded_prefixes: dict[str, None] = {}
        # Token decoder for divergence previews in logs (optional).
        self._decode = decode
        self._counts = {"lookups": 0, "hits": 0, "prompt": 0, "cached": 0, "evictions": 0}
        self._evicted = _EvictedTrail(self.store.block_tokens)
        self.version = 0
        # Entries whose write behind is in flight, with the file key written.
        self._behind: dict[Entry, str] = {}
        # No write behind is tried before this time (time.monotonic()): a
        # failing disk is not retried in a loop (its cause is logged once).
        self._behind_after = 0.0

    def _file_key(self, entry: Entry) -> str:
        if entry.key is not None:
            return "name:" + entry.key
        key = self._anon_keys.get(entry)
        if key is None:
            key = self._anon_keys[entry] = _file_key(entry)
        return key

    # --- admission ---------------------------------------------------------

    def admit(self, rid: int, request: GenerationRequest) -> tuple[Admission, SeedInfo]:
        cr = request.cache or CacheRequest()
        prompt = request.prompt
        seed, where = self._find_seed(cr, prompt)
        state: Any = None
        if seed is not None:
            try:
                state = self._ops.join_state(
                    [n.block for n in seed.nodes], seed.reuse, seed.entry.rest
                )
            except Exception:  # a seed that cannot be assembled is a miss, not a failure
                log.exception("seed assembly failed; prefilling from scratch")
                seed = None
        reuse = seed.reuse if seed is not None else 0
        if seed is not None:
            self.store.pin(seed.entry)
            self.store.touch(seed.entry, hit=True)
            seed.entry.used_at = time.time()
        if cr.cache_id:
            self.store.pin_name(cr.cache_id)
        if seed is not None or cr.cache_id:
            self.version += 1
        self._counts["lookups"] += 1
        self._counts["hits"] += reuse > 0
        self._counts["prompt"] += len(prompt)
        self._counts["cached"] += reuse
        pending, written = self._hold_pins(cr, prompt, seed)
        cuts = self._plan_cuts(cr, prompt, reuse)
        if not self._trimmable:
            for pin in pending:
                if reuse < pin.end < len(prompt):
                    cuts.setdefault(pin.end, set()).add("pin")
        self._seqs[rid] = _Seq(prompt, cr, reuse, seed.entry if seed else None, cuts, pins=pending)
        segments = tuple(tuple(s) for s in split_segments(prompt, reuse, cuts))
        source, mode = "fresh", "fresh"
        if seed is not None:
            source = f"{where}:{self._role(seed.entry, cr)}"
            mode = "extend" if seed.reuse == seed.entry.end else "trim"
        log.info(
            "seed cache_id=%s source=%s mode=%s reused=%d prefill=%d cuts=%s",
            _short(cr.cache_id or "-"),
            source,
            mode,
            reuse,
            len(prompt) - reuse,
            sorted(cuts) or "-",
        )
        miss = self.diagnose(prompt, reuse, cr)
        return (
            Admission(rid, request, segments, state, prompt[:reuse]),
            SeedInfo(reuse, source, mode, miss, *written),
        )

    def diagnose(
        self, prompt: tuple[int, ...], reuse: int, cr: CacheRequest | None = None
    ) -> CacheMiss | None:
        """Where ``prompt`` (which reused ``reuse`` tokens) left the longest
        prefix the store holds, or ``None`` when it reused all the store held
        for it: the whole prompt but the token that must be computed, or a
        cached sequence that the prompt extends. One walk of the store's
        trie (what a seed lookup costs); on a miss, a few dozen tokens
        decoded. Never raises: a diagnosis that fails is logged and absent."""
        try:
            return self._diagnose(prompt, reuse, cr or CacheRequest())
        except Exception:  # diagnostics never break a turn
            log.exception("cache-miss diagnosis failed")
            return None

    def _diagnose(self, prompt: tuple[int, ...], reuse: int, cr: CacheRequest) -> CacheMiss | None:
        limit = len(prompt) - 1
        if reuse >= limit:
            return None
        path, lcp = self.store.walk(prompt, cr.salt)
        last = path[-1] if path else self.store.root_of(cr.salt)
        # Something cached goes on past the shared prefix: the last node is
        # shared only in part, or has children the prompt matched none of.
        continues = lcp < last.end or bool(last.children)
        evicted = self._evicted.reach(prompt, cr.salt) if self._evicted else 0
        reason: CacheMissReason
        if evicted > lcp:
            reason = "evicted"
        elif lcp == 0:
            reason = "cold"
        elif reuse < min(lcp, limit):
            reason = "checkpoint"
        elif continues:
            reason = "diverged"
        else:
            return None
        lo, hi = max(0, lcp - _BEFORE), lcp + _AFTER
        cached: tuple[int, ...] = ()
        if lcp and continues:
            entry = _reaching(last, lcp)
            cached = entry.tokens[lcp:hi] if entry is not None else ()
        common, cached_text, prompt_text = self._texts(prompt[lo:lcp], cached, prompt[lcp:hi])
        message = role = None
        if cr.message_starts:
            index = max(0, bisect.bisect_right(cr.message_starts, lcp) - 1)
            message = index
            role = cr.message_roles[index] if index < len(cr.message_roles) else None
        miss = CacheMiss(reason, lcp, reuse, message, role, common, cached_text, prompt_text)
        log.info(
            "cache miss reason=%s token=%d reused=%d of %d message=%s role=%s "
            "common=%r cached=%r prompt=%r",
            reason,
            lcp,
            reuse,
            len(prompt),
            "-" if message is None else message,
            role or "-",
            common,
            cached_text,
            prompt_text,
        )
        return miss

    def _texts(self, *parts: Sequence[int]) -> tuple[str, str, str]:
        if self._decode is None:
            return ("", "", "")
        try:
            a, b, c = (self._decode(list(p)) if p else "" for p in parts)
        except Exception:  # a preview that cannot be decoded is left out
            log.debug("cache-miss preview could not be decoded", exc_info=True)
            return ("", "", "")
        return (str(a), str(b), str(c))

    def _hold_pins(
        self, cr: CacheRequest, prompt: tuple[int, ...], seed: Seed | None
    ) -> tuple[tuple[Pin, ...], tuple[int, int]]:
        """Refresh the pinned entries this prompt already has; return the
        pins still to save and the prompt tokens they will write (by ttl:
        5m, 1h), counted once each, beyond what the cache served."""
        if not cr.pins:
            return (), (0, 0)
        now = self._clock()
        reuse = seed.reuse if seed is not None else 0
        pending: list[Pin] = []
        covered = reuse
        written = [0, 0]
        for pin in sorted(cr.pins, key=lambda p: p.end):
            if pin.end > len(prompt):
                continue
            # The store is content-addressed: the entry holding exactly this
            # prefix is the pin, whoever saved it.
            held = self.store.exact(prompt[: pin.end], cr.salt)
            entry = held[0] if held else None
            if entry is not None:
                entry.held_until = max(entry.held_until, now + pin.seconds)
                self.store.touch(entry, hit=False)
                self.version += 1
                log.info("pin-refresh tokens=%d for %.0fs", pin.end, pin.seconds)
                continue
            pending.append(pin)
            if pin.end > covered:
                written[pin.seconds > _SHORT_PIN] += pin.end - covered
                covered = pin.end
        return tuple(pending), (written[0], written[1])

    def _pin(self, seq: _Seq, tokens: Sequence[int], state: Any, *, end: int) -> None:
        """Save the pinned prefix ``tokens[:end]`` as an entry held for the
        longest of the pins that end there. It has no name: once its ttl
        passes it is an ordinary entry, evicted in its turn."""
        seconds = max(p.seconds for p in seq.pins if p.end == end)
        salt = seq.cache.salt
        held = self.store.exact(tokens[:end], salt)
        entry = (
            held[0] if held else self._save(tokens[:end], state, roster=seq.cache.roster, salt=salt)
        )
        if entry is not None:
            entry.held_until = max(entry.held_until, self._clock() + seconds)
            self.store.mark(entry)
            log.info("pin-save tokens=%d for %.0fs", end, seconds)

    @staticmethod
    def _role(entry: Entry, cr: CacheRequest) -> str:
        if cr.cache_id is not None and cr.cache_id in (entry.key, entry.owner):
            return "session"
        return "prefix" if entry.kind == "prefix" else "shared"

    def _find_seed(self, cr: CacheRequest, prompt: tuple[int, ...]) -> tuple[Seed | None, str]:
        """The deepest seed in memory, or on disk when that reaches further."""
        seed = self.store.seed(prompt, cr.salt)
        where = "memory"
        found = self._disk_best(prompt, seed.reuse if seed is not None else 0, cr.salt)
        if found is not None and self._load(found) is not None:
            better = self.store.seed(prompt, cr.salt)
            if better is not None and (seed is None or better.reuse > seed.reuse):
                seed, where = better, "disk"
        if cr.cache_id and not self._trimmable:
            named = self.store.named(cr.cache_id)
            if named is not None and (seed is None or seed.reuse < named.end):
                self._log_divergence(cr.cache_id, named.tokens, prompt)
        return seed, where

    def _disk_best(self, prompt: tuple[int, ...], beat: int, salt: str = "") -> DiskEntry | None:
        """The disk entry of ``salt`` that would seed ``prompt`` deeper than ``beat``."""
        if self.disk is None:
            return None

        def newer_in_memory(file_key: str) -> bool:
            # Memory holds that name's newer state.
            return file_key.startswith("name:") and self.store.named(file_key[5:]) is not None

        return self.disk.index.best(
            prompt, beat=beat, trimmable=self._trimmable, skip=newer_in_memory, salt=salt
        )

    def _load(self, found: DiskEntry) -> Entry | None:
        assert self.disk is not None
        loaded = self.disk.load(found.file_key)
        if loaded is None:
            return None
        cap = Captured(loaded.state, loaded.tokens)
        if not _sound(cap, self._ops):
            log.warning("disk entry %s: offsets disagree with its tokens", found.file_key)
            self.disk.delete(found.file_key)
            return None
        named = found.file_key.startswith("name:")
        kind: EntryKind = "anonymous"
        if named:
            kind = "prefix" if loaded.kind == "prefix" else "session"
        entry = self._save(
            loaded.tokens,
            loaded.state,
            key=found.file_key[5:] if named else None,
            kind=kind,
            owner=loaded.owner,
            roster=loaded.roster,
            dirty=False,
            salt=found.salt,
        )
        if entry is not None:
            log.info("disk-load %s tokens=%d", _short(found.file_key), len(loaded.tokens))
        return entry

    def _plan_cuts(
        self, cr: CacheRequest, prompt: tuple[int, ...], reuse: int
    ) -> dict[int, set[str]]:
        cuts: dict[int, set[str]] = {}

        def cut(pos: int | None, role: str) -> None:
            if pos is not None and reuse < pos < len(prompt):
                cuts.setdefault(pos, set()).add(role)

        if cr.prefill_group is not None:
            # Siblings of this prompt (n > 1) seed from its state here.
            cut(len(prompt) - 1, "retry")
        if cr.snapshot_at is not None:
            cut(cr.snapshot_at, "warm")
        elif not self._trimmable:
            for boundary in cr.boundaries or (snapshot_cut(len(prompt), 0),):
                cut(boundary, "boundary")
            cut(len(prompt) - 1, "retry")
            if cr.band_end is not None and cr.prefix_ids:
                cut(cr.band_end - SNAPSHOT_MARGIN, "band")
        return cuts

    # --- during a sequence -------------------------------------------------

    def wants_capture(self, rid: int, done: int) -> bool:
        seq = self._seqs.get(rid)
        return seq is not None and (seq.reuse + done) in seq.cuts

    def captured(self, rid: int, done: int, cap: Captured) -> None:
        """A cut was reached: save it at once, as the entry its role asks for."""
        seq = self._seqs.get(rid)
        if seq is None:
            return
        boundary = seq.reuse + done
        roles = seq.cuts.get(boundary, set())
        if tuple(cap.tokens) != seq.prompt[:boundary] or not _sound(cap, self._ops):
            if not seq.warned:
                seq.warned = True
                log.warning(
                    "snapshot dropped cache_id=%s boundary=%d tokens=%d offsets=%s",
                    _short(seq.cache.cache_id or "-"),
                    boundary,
                    len(cap.tokens),
                    self._ops.state_offsets(cap.state),
                )
            return
        cr = seq.cache
        if "warm" in roles and cr.cache_id is not None:
            self._save(
                cap.tokens,
                cap.state,
                key=cr.cache_id,
                kind="session",
                roster=cr.roster,
                persist=cr.persist,
                salt=cr.salt,
            )
        if roles & {"boundary", "retry"}:
            entry = self._save(cap.tokens, cap.state, owner=cr.cache_id, salt=cr.salt)
            if "boundary" in roles and entry is not None:
                seq.snapshot = entry
        if "band" in roles:
            self._publish_prefix(cr, cap.tokens, cap.state)
        if "pin" in roles:
            self._pin(seq, cap.tokens, cap.state, end=boundary)

    # --- endings -----------------------------------------------------------

    def finished(self, rid: int, cap: Captured | None) -> None:
        """The sequence ended normally; ``cap`` is its final state."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        try:
            cr = seq.cache
            if cap is None or cr.snapshot_at is not None:
                return  # a warm keeps only its cut, never the synthetic turn
            if not _sound(cap, self._ops):
                log.warning("final state of request %d disagrees with its tokens: not saved", rid)
                return
            saved = self._save(
                cap.tokens,
                cap.state,
                key=cr.cache_id,
                kind="session" if cr.cache_id else "anonymous",
                roster=cr.roster,
                persist=cr.persist,
                salt=cr.salt,
            )
            if self._trimmable:
                # Any prefix of a state seeds on these models: each pinned
                # prefix is cut from the final state.
                for end in sorted({p.end for p in seq.pins}):
                    if end <= len(cap.tokens):
                        self._pin(seq, cap.tokens, cap.state, end=end)
            self._prune_lineage(seq, saved, finished=True)
            if not cr.prefix_ids:
                return
            if self._trimmable:
                band = cr.band_end - SNAPSHOT_MARGIN if cr.band_end is not None else None
                tokens = cap.tokens[:band] if band is not None and band > 0 else cap.tokens
                self._publish_prefix(cr, tokens, cap.state)
            elif cr.band_end is None and seq.snapshot is not None:
                self._publish_prefix(cr, seq.snapshot.tokens, None, entry=seq.snapshot)
        finally:
            self._release(seq)

    def cancelled(self, rid: int, cap: Captured | None) -> None:
        """The caller left (or the engine shut down, or the request failed):
        keep what was computed beyond the seed, if it is sound."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        try:
            cr = seq.cache
            if cap is None or len(cap.tokens) <= seq.reuse or not _sound(cap, self._ops):
                log.info(
                    "cancelled cache_id=%s: nothing beyond the %d seeded tokens to save",
                    _short(cr.cache_id or "-"),
                    seq.reuse,
                )
                return
            named = cr.cache_id is not None and cr.snapshot_at is None
            saved = self._save(
                cap.tokens,
                cap.state,
                key=cr.cache_id if named else None,
                kind="session" if named else "anonymous",
                owner=None if named else cr.cache_id,
                roster=cr.roster,
                salt=cr.salt,
            )
            log.info(
                "saved cancelled cache_id=%s tokens=%d (was seeded with %d)",
                _short(cr.cache_id or "-"),
                len(cap.tokens),
                seq.reuse,
            )
            self._prune_lineage(seq, saved, finished=False)
        finally:
            self._release(seq)

    def _publish_prefix(
        self,
        cr: CacheRequest,
        tokens: Sequence[int],
        state: Any,
        entry: Entry | None = None,
    ) -> None:
        """Seed the most specific prefix id from this session, once per process,
        so sibling sessions inherit the shared head; a prefix entry is never
        replaced by a longer one."""
        if not cr.prefix_ids:
            return
        pid = cr.prefix_ids[0]
        if pid in self._seeded_prefixes:
            return
        self._seeded_prefixes[pid] = None
        if len(self._seeded_prefixes) > SEEDED_PREFIXES_KEPT:
            del self._seeded_prefixes[next(iter(self._seeded_prefixes))]
        existing = self._named_tokens(pid)
        if existing is not None and len(existing) <= len(tokens):
            log.info(
                "prefix-keep %s: existing %d tokens, not replaced by %d",
                _short(pid),
                len(existing),
                len(tokens),
            )
            return
        if entry is not None:
            self.store.rename(entry, pid, "prefix", cr.roster)
            self.version += 1
            self._write(entry)
        else:
            self._save(
                tokens, state, key=pid, kind="prefix", roster=cr.roster, persist=True, salt=cr.salt
            )
        log.info("prefix-seeded %s tokens=%d", _short(pid), len(tokens))

    def _release(self, seq: _Seq) -> None:
        if seq.seed is not None:
            self.store.unpin(seq.seed)
        if seq.cache.cache_id:
            self.store.unpin_name(seq.cache.cache_id)
        self.version += 1  # the published view shows pins

    def _prune_lineage(self, seq: _Seq, saved: Entry | None, *, finished: bool) -> None:
        """Untrimmable models keep a fixed-size recurrent state per checkpoint
        (0.8 MiB on the bench hybrid model), so once a turn saved its state,
        what it superseded goes:

        * the older checkpoints inside its prompt that it does not still call
          a boundary - the previous turn's post-generation state, retry and
          history cuts. For each boundary (the system turn's end, where a new
          user turn would rewrite the history) the deepest checkpoint at or
          before it stays;
        * a finished turn's retry checkpoint, when a boundary lies within the
          snapshot margin before it (a regenerate then prefills those few
          tokens; a cancelled turn keeps it, for the retry that follows);
        * when the turn left its conversation's own path after the system
          turn (a new user message re-rendered the history), the abandoned
          branch's checkpoints that nobody ever seeded from.

        Named entries and anything a live request holds always stay. Without
        this, four agents of ten turns held 47 MiB of checkpoints and KV on the
        bench hybrid model, where mlx_lm.server's ten-entry LRU holds 34 MiB
        (and re-prefills 2.3 times more)."""
        cr, prompt = seq.cache, seq.prompt
        if self._trimmable or saved is None or not cr.boundaries:
            return  # a request that does not know its message boundaries prunes nothing
        retry = len(prompt) - 1
        marks = {*cr.boundaries, *(pos for pos, roles in seq.cuts.items() if roles != {"retry"})}
        if cr.band_end is not None:
            marks.add(cr.band_end - SNAPSHOT_MARGIN)
        if not (finished and any(retry - SNAPSHOT_MARGIN <= b < retry for b in marks)):
            marks.add(retry)
        entries = self.store.prefixes(prompt, limit=retry, salt=cr.salt)
        # For each mark, the checkpoint a prompt diverging there would use:
        # the deepest one at or before it (the mark itself may lie inside
        # what this turn reused, where no new checkpoint was cut).
        ends = sorted({e.end for e in entries})
        keep = {max((n for n in ends if n <= mark), default=0) for mark in marks}
        victims = [e for e in entries if e is not saved and e.end not in keep]
        seed = seq.seed
        if seed is not None and seed.end > min(cr.boundaries):
            on_path = set(map(id, self.store.prefixes(saved.tokens, salt=cr.salt)))
            victims += [
                e for e in self.store.extensions(seed) if id(e) not in on_path and e.hits == 0
            ]
        dropped = 0
        for entry in victims:
            held = entry.pins - (1 if entry is seq.seed else 0)
            if entry.key is not None or held > 0 or entry.held_until > self._clock():
                continue
            self.store.remove(entry)
            dropped += 1
        if dropped:
            self.version += 1
            log.info("pruned %d superseded checkpoints", dropped)

    # --- storage -----------------------------------------------------------

    def _save(
        self,
        tokens: Sequence[int],
        state: Any,
        *,
        key: str | None = None,
        kind: EntryKind = "anonymous",
        owner: str | None = None,
        roster: str = "",
        persist: bool = False,
        dirty: bool = True,
        salt: str = "",
    ) -> Entry | None:
        """Put a state holding exactly ``tokens`` into the store (in
        ``salt``'s part of it); ``None`` (logged) when the backend could not
        copy it."""
        try:
            rest, rest_nbytes = self._ops.state_rest(state)
            entry, evicted = self.store.add(
                tokens,
                lambda ranges: self._ops.state_blocks(state, ranges),
                key=key,
                kind=kind,
                owner=owner if key is None else None,
                rest=rest,
                rest_nbytes=rest_nbytes,
                roster=roster,
                dirty=dirty,
                salt=salt,
            )
        except Exception:  # a state that cannot be copied is not saved, nothing else
            log.exception("cache save failed cache_id=%s", _short(key or owner or "-"))
            return None
        entry.used_at = time.time()
        self._counts["evictions"] += len(evicted)
        self.version += 1
        log.info(
            "save cache_id=%s kind=%s tokens=%d bytes=%d store=%d",
            _short(key or (f"(alternate of {owner})" if owner else "-")),
            kind,
            len(entry.tokens),
            entry.nbytes,
            self.store.total_bytes,
        )
        if persist:
            self._write(entry)
        return entry

    def _before_evict(self, victim: Entry) -> None:
        """The store is about to drop ``victim``: if dirty, its state is
        serialized here (the backend's part, on this thread) and the writer
        thread seals the file, so no file write or fsync holds the host
        thread; the disk index lists it at once, and a load of it waits for
        that write (``DiskCache.save_behind``, ``provisional``)."""
        if victim.dirty and self.disk is not None:
            self._write_evicted(victim)
        self._evicted.record(victim.tokens, victim.salt)
        log.info(
            "evicted %s tokens=%d (memory budget)",
            _short(victim.key or "anonymous"),
            len(victim.tokens),
        )

    def _write_evicted(self, entry: Entry) -> None:
        assert self.disk is not None
        if not entry.path:
            return
        key = self._file_key(entry)
        if self._behind.get(entry) == key:
            return  # its write behind is the write
        if (state := self._assembled(entry)) is None:
            return
        if self.disk.save_behind(
            key,
            entry.tokens,
            state,
            **self._described(entry),
            tag=entry,
            provisional=True,
        ):
            self._behind[entry] = key
            self.version += 1

    def _assembled(self, entry: Entry) -> Any | None:
        """The whole state of ``entry``, to write; ``None`` (logged) when
        the backend could not join its blocks."""
        try:
            return self._ops.join_state([n.block for n in entry.path], entry.end, entry.rest)
        except Exception:
            log.exception("cache write failed: the state could not be assembled")
            return None

    @staticmethod
    def _described(entry: Entry) -> dict[str, Any]:
        """What a file records of ``entry`` besides its tokens and state."""
        return {
            "kind": entry.kind,
            "roster": entry.roster,
            "owner": entry.owner,
            "salt": entry.salt,
        }

    def _write(self, entry: Entry) -> None:
        if self.disk is None or not entry.path:
            return
        if entry in self._behind:
            self.collect_behind(None)  # its write behind may already be the write
            if not entry.dirty:
                return
        if (state := self._assembled(entry)) is None:
            return
        if self.disk.save(
            self._file_key(entry),
            entry.tokens,
            state,
            **self._described(entry),
        ):
            self.store.clean(entry)
            self.version += 1
            self._prune_disk()

    def _prune_disk(self) -> None:
        if self.disk is None or self._disk_budget <= 0:
            return
        protect = [self._file_key(e) for e in self.store.pinned_entries()]
        for name in self.disk.prune(self._disk_budget, protect=protect):
            log.info("disk-evicted %s (disk budget)", name)

    def _named_tokens(self, key: str) -> tuple[int, ...] | None:
        entry = self.store.named(key)
        if entry is not None:
            return entry.tokens
        found = self.disk.index.get("name:" + key) if self.disk is not None else None
        return found.tokens if found is not None else None

    def _log_divergence(self, key: str, cached: Sequence[int], prompt: Sequence[int]) -> None:
        """Name the churn: the decoded text on both sides of the divergence is
        the only thing that says whether the prompt or the boundary is wrong."""
        lcp = common_prefix(cached, prompt)
        lo = max(0, lcp - 6)
        if self._decode is not None:
            try:
                left = self._decode(list(cached[lo : lcp + 24]))
                right = self._decode(list(prompt[lo : lcp + 24]))
            except Exception as exc:  # diagnostics never break a turn
                left = right = f"<preview unavailable: {exc}>"
        else:
            left, right = list(cached[lo : lcp + 8]), list(prompt[lo : lcp + 8])
        log.warning(
            "session entry cannot seed: cache_id=%s untrimmable entry diverges at token %d "
            "of %d; cached=%r prompt=%r",
            _short(key),
            lcp,
            len(cached),
            left,
            right,
        )

    # --- write-behind ------------------------------------------------------

    def _to_write(self, min_age: float = 0.0, *, settled: bool = False) -> Iterator[Entry]:
        """The dirty entries a flush writes, in its order: every named one,
        then anonymous ones from the most recently used while the disk
        budget has room; with ``min_age``, only those saved that many
        seconds ago or more. From the store's dirty sets, never a pass over
        every entry; ``settled``: the order is taken first, so the caller
        may write (and clean) entries as it goes."""
        assert self.disk is not None
        named, anonymous = self.store.dirty_entries()
        order: Iterator[Entry] = itertools.chain(named, list(anonymous) if settled else anonymous)
        now = time.time()
        for entry in order:
            if not entry.dirty or now - entry.used_at < min_age:
                continue
            if (
                entry.key is None
                and self._disk_budget > 0
                and self.disk.total_bytes >= 0.8 * self._disk_budget
            ):
                continue  # the cold part of the store is not worth a restart's disk
            yield entry

    def write_behind(self, min_age: float = 0.0) -> bool:
        """Hand the first dirty entry a flush would write (and that is not
        being written already) to the disk's writer thread: its state is
        assembled and serialized here, on the host thread, the rest is not.
        ``False``: nothing to hand over, ``BEHIND_IN_FLIGHT`` writes in
        flight, or paused after a failed write. A finished write marks the
        entry clean in ``collect_behind``."""
        if self.disk is None or not self.disk.writable:
            return False
        self.collect_behind()
        if len(self._behind) >= BEHIND_IN_FLIGHT or time.monotonic() < self._behind_after:
            return False
        for entry in self._to_write(min_age):
            if entry in self._behind or not entry.path:
                continue
            if (state := self._assembled(entry)) is None:
                self._behind_after = time.monotonic() + BEHIND_BACKOFF
                return False
            key = self._file_key(entry)
            if not self.disk.save_behind(
                key,
                entry.tokens,
                state,
                **self._described(entry),
                tag=entry,
            ):
                self._behind_after = time.monotonic() + BEHIND_BACKOFF
                return False
            self._behind[entry] = key
            return True
        return False

    @property
    def writes_behind(self) -> int:
        """Writes behind in flight."""
        return len(self._behind)

    def collect_behind(self, timeout: float | None = 0.0) -> int:
        """Mark clean the entries whose write behind finished (waiting up to
        ``timeout`` seconds for those in flight; ``None``: until all land);
        returns how many. One renamed meanwhile stays dirty: its file is
        another key's."""
        if self.disk is None or not self._behind:
            return 0
        cleaned = 0
        for entry, saved in self.disk.collect(timeout):
            key = self._behind.pop(entry, None)
            if not saved:
                self._behind_after = time.monotonic() + BEHIND_BACKOFF
            elif entry.path and key == self._file_key(entry):
                self.store.clean(entry)
                cleaned += 1
        if cleaned:
            self.version += 1
            self._prune_disk()
        return cleaned

    def close_disk(self, deadline: float | None = None) -> None:
        """Last act (shutdown): the writes behind land by ``deadline``
        (``time.monotonic()``), then the writer thread stops."""
        if self.disk is None:
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.collect_behind(left)
        self.disk.close(left)
        self._behind.clear()

    # --- commands from the Trio side ---------------------------------------

    def flush(self, deadline: float | None = None) -> int:
        """Write dirty entries to disk - every named one, then anonymous ones
        from the most recently used while the disk budget has room; returns
        how many were written (writes behind that landed meanwhile count).
        Stops once ``time.monotonic()`` passes ``deadline`` (shutdown)."""
        if self.disk is None:
            return 0
        started = time.monotonic()
        left = None if deadline is None else max(0.0, deadline - started)
        written = self.collect_behind(left if self._behind else 0.0)
        behind = written
        nbytes = 0
        for entry in self._to_write(settled=True):
            if deadline is not None and time.monotonic() > deadline:
                log.warning("flush stopped at its deadline; dirty entries left unwritten")
                break
            if entry in self._behind:
                continue  # still in flight at the deadline: close_disk waits for it
            self._write(entry)
            if not entry.dirty:
                written += 1
                nbytes += entry.nbytes
        if written:
            log.info(
                "flushed %d dirty entries to disk (%d written here, %d bytes, in %.3f s; "
                "%d were writes behind)",
                written,
                written - behind,
                nbytes,
                time.monotonic() - started,
                behind,
            )
        return written

    def evict(self, key: str) -> tuple[bool, bool]:
        """Drop the name ``key`` and its alternates from memory and disk:
        ``(in_memory, on_disk)``. Blocks other entries share stay. An
        ``anon:...`` id (as stats lists an unnamed entry) drops that entry."""
        entry = self.store.named(key)
        mem = entry is not None
        victims = [entry, *self.store.owned(key)]
        if key.startswith("anon:"):
            # The id stats shows for an anonymous entry is its file key.
            unnamed = [e for e in self.store if e.key is None and self._file_key(e) == key]
            mem = mem or bool(unnamed)
            victims += unnamed
        for victim in victims:
            if victim is not None:
                self.store.remove(victim)
        on_disk = False
        if self.disk is not None:
            on_disk = self.disk.delete("name:" + key)
            if key.startswith("anon:"):
                on_disk = self.disk.delete(key) or on_disk
            for found in list(self.disk.index.values()):
                if found.owner == key:
                    self.disk.delete(found.file_key)
        self._seeded_prefixes.pop(key, None)
        if mem or on_disk:
            self.version += 1
            log.info("deleted cache_id=%s memory=%s disk=%s", _short(key), mem, on_disk)
        return mem, on_disk

    def inspect(self, key: str) -> tuple[int, str] | None:
        """``(tokens, roster)`` of the entry named ``key`` (memory, then disk)."""
        entry = self.store.named(key)
        if entry is not None:
            return len(entry.tokens), entry.roster
        found = self.disk.index.get("name:" + key) if self.disk is not None else None
        return None if found is None else (len(found.tokens), found.roster)

    def pinned(self, key: str) -> bool:
        return self.store.name_pinned(key)

    def view(self) -> CacheSnapshot:
        """Every entry and the totals, built from the whole store: what the
        Trio side's ``CacheBook`` shows from the deltas (tests compare the
        two). Costs every entry: never called per step."""
        entries = sorted(self.store, key=lambda e: (e.key is None, -e.last_use))
        now = self._clock()
        rows = tuple(
            CacheView(
                cache_id=self._file_key(e) if e.key is None else e.key,
                tokens=len(e.tokens),
                bytes=e.nbytes,
                kind="pin" if e.held_until > now else e.kind,
                last_used=e.used_at,
                dirty=e.dirty,
                pinned=bool(e.pins) or (e.key is not None and self.pinned(e.key)),
                hits=e.hits,
                pin_expires_in=round(e.held_until - now, 3) if e.held_until > now else None,
                named=e.key is not None,
                salt=e.salt,
            )
            for e in entries
        )
        totals = attrs.evolve(
            self._totals(logical_bytes=sum(r.bytes for r in rows)),
            entries=len(rows),
            named=sum(1 for e in entries if e.key is not None),
        )
        return CacheSnapshot(rows, totals)

    def delta(self) -> CacheDelta:
        """What changed since the last delta, for the Trio side's
        ``CacheBook``: the rows of the entries changed and the totals, all
        kept current as entries change, so it costs what changed and never
        what the store holds."""
        changed, removed = self.store.take_changes()
        for entry in removed:
            self._anon_keys.pop(entry, None)
        rows = tuple(
            CacheRow(
                serial=e.serial,
                cache_id=self._file_key(e) if e.key is None else e.key,
                tokens=len(e.tokens),
                bytes=e.nbytes,
                kind=e.kind,
                last_used=e.used_at,
                dirty=e.dirty,
                pinned=bool(e.pins) or (e.key is not None and self.pinned(e.key)),
                hits=e.hits,
                held_until=e.held_until,
                named=e.key is not None,
                last_use=e.last_use,
                salt=e.salt,
            )
            for e in changed
        )
        return CacheDelta(rows, tuple(e.serial for e in removed), self._totals(), self._clock())

    def _totals(self, logical_bytes: int | None = None) -> CacheTotals:
        c = self._counts
        return CacheTotals(
            entries=len(self.store),
            named=self.store.named_count,
            blocks=self.store.block_count,
            bytes=self.store.total_bytes,
            logical_bytes=self.store.logical_bytes if logical_bytes is None else logical_bytes,
            budget_bytes=self.store.budget_bytes,
            disk_entries=len(self.disk.index) if self.disk is not None else 0,
            disk_bytes=self.disk.total_bytes if self.disk is not None else 0,
            lookups=c["lookups"],
            hits=c["hits"],
            prompt_tokens=c["prompt"],
            cached_tokens=c["cached"],
            evictions=c["evictions"],
            seeded_prefixes=len(self._seeded_prefixes),
        )
