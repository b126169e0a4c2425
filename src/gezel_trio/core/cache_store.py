"""The content-addressed prompt-cache store: a trie of token blocks, the
entries that end in it, a byte budget, pins.

Pure bookkeeping: no MLX, no Trio, no clock. Block payloads and the states
of layers that cannot be cut into blocks are opaque objects the backend made,
priced by the byte counts it reported. Owned by the engine's host thread.

**Blocks.** Token positions are cut at absolute multiples of ``block_tokens``
(block *i* holds tokens ``[i*B, (i+1)*B)``), so one token sequence is one
path from the root and the last node of a path may be partial. A node holds
the backend's copy of the *blockable* layers (attention KV) for its tokens,
keyed by those tokens under its parent: four conversations that share a
4k-token system prompt pass through the same nodes and store it once. A
node is reference-counted by the entries whose path includes it and freed
with the last one.

Why 64 tokens: the tokens shared by two paths that diverge inside a block
are stored once per branch, so a block bounds that duplication (at most 63
tokens per branch); smaller blocks mean more arrays to concatenate when a
seed is assembled (one per block per layer; 4k tokens are 64 blocks) and
more per-node bookkeeping. Reuse itself is exact to the token whatever the
block size: a partial block is sliced, never re-prefilled.

**Entries.** An entry is a saved position: its tokens (a path) and, on
models with layers that cannot be cut into blocks (linear attention, sliding
windows), the ``rest`` state of those layers at exactly that position. On a
model whose layers are all blockable (``trimmable``), any prefix of any path
seeds a request; otherwise only entry ends do. An entry may carry a name (a
cache id or prefix id: ``key``) or belong to one as an alternate
(``owner``); most are anonymous.

**Salts.** Every method that takes tokens takes a ``salt`` too (vLLM's
``cache_salt``: a tenant, or a request's own). Each salt has its own root,
so paths of different salts never share a node: no seed, pin, lookup or
diagnosis crosses salts. The unsalted root is ``root``, as before salts.

**Eviction.** Over ``budget_bytes``, entries go in ``(tier, last_use)``
order down to 80% of the budget: tier 0 is anonymous and never reused,
tier 1 anonymous and reused at least once, tier 2 named or owned by a name
(a named session survives longer, with its alternates). Never the only
entry, never the entry just saved, never a pinned one (a live request's
seed), never one held until a time still ahead (``Entry.held_until``, read
against the owner's clock, ``now``). The ``before_evict`` callback sees
each victim while its blocks are still there (the prompt cache writes dirty entries to disk in it).

**Block log.** With a ``block_hasher`` the store hashes every full block
it makes, chained to its parent's hash (``Node.digest``), and logs each
such block when it is made and when it is freed (``take_block_log``): what
the KV events announce (``host.kv_events``). A partial block is neither
hashed nor logged, nor is a block under an unhashed parent or one that
holds an image key (a negative id), so every logged block's parent was
logged before it.

**Costs that do not grow with the store.** A node keeps its children's
token tuples sorted beside the dict (``Node.keys``): a block the trie lacks,
a partial block's longer sibling and a divergence's best sibling are found
by bisection among them, never by comparing every sibling (a save under a
shared head scanned 6,000 siblings, 4.4 ms, before). The entries changed or
removed since the owner last looked are kept (``take_changes``), with the
totals its view shows, so a view is maintained from deltas and never
rebuilt from every entry.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import attrs

from .cache_plan import common_prefix

__all__ = ["BLOCK_TOKENS", "BlockHasher", "CacheStore", "Entry", "EntryKind", "Node", "Seed"]

BLOCK_TOKENS = 64

EntryKind = Literal["session", "prefix", "anonymous"]

# Blocks for the token ranges given: ``(payload, nbytes)`` each, in order.
MakeBlocks = Callable[[Sequence[tuple[int, int]]], Sequence[tuple[Any, int]]]

# A full block's hash from its parent's (``None`` for a path's first block),
# its tokens and, for the first block only, its salt (``""`` otherwise).
BlockHasher = Callable[[bytes | None, tuple[int, ...], str], bytes]


@attrs.define(eq=False)
class Node:
    """One block of a token path; ``block`` is the backend's payload."""

    parent: Node | None
    start: int
    tokens: tuple[int, ...]
    block: Any = None
    nbytes: int = 0
    children: dict[tuple[int, ...], Node] = attrs.field(factory=dict)
    ends: list[Entry] = attrs.field(factory=list)
    refs: int = 0
    # The keys of ``children``, sorted: the children sharing the most tokens
    # with a chunk are its neighbours there (``CacheStore._nearest``).
    keys: list[tuple[int, ...]] = attrs.field(factory=list, repr=False)
    # Every entry whose path holds this node, least recently used first (a
    # touch moves one to the end of each node on its path): the covering
    # entry is found from the end, never by walking the subtree.
    by_use: dict[Entry, None] = attrs.field(factory=dict, repr=False)
    # The entries whose last block is a child of this node, by their tokens
    # in it, and how many such keys there are of each length: the entries
    # ending inside a prompt's next block are found by those lengths.
    tails: dict[tuple[int, ...], list[Entry]] = attrs.field(factory=dict, repr=False)
    tail_lengths: Counter[int] = attrs.field(factory=Counter, repr=False)
    # The block's hash (``CacheStore``'s ``block_hasher``); empty: not hashed,
    # so neither announced nor to be announced gone.
    digest: bytes = attrs.field(default=b"", repr=False)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@attrs.define(eq=False)
class Entry:
    """A saved position. ``path`` is the nodes it holds a reference on."""

    tokens: tuple[int, ...]
    key: str | None = None
    kind: EntryKind = "anonymous"
    owner: str | None = None
    rest: Any = None
    rest_nbytes: int = 0
    roster: str = ""
    dirty: bool = True
    last_use: int = 0
    used_at: float = 0.0
    hits: int = 0
    pins: int = 0
    # Kept from eviction until this time (the store's ``now``): a prefix
    # pinned by Anthropic's ``cache_control`` for its ttl.
    held_until: float = 0.0
    path: list[Node] = attrs.field(factory=list, repr=False)
    path_nbytes: int = 0  # the sum over ``path``, kept current (the view reads it often)
    salt: str = ""  # the partition of the trie its path lies in
    # Which entry this is, for a view kept from deltas (the store numbers them).
    serial: int = 0

    @property
    def end(self) -> int:
        return len(self.tokens)

    @property
    def tier(self) -> int:
        if self.key is not None or self.owner is not None:
            return 2
        return 1 if self.hits else 0

    @property
    def nbytes(self) -> int:
        """What the entry would cost alone: its whole path and rest state."""
        return self.path_nbytes + self.rest_nbytes


@attrs.frozen
class Seed:
    """Where a prompt starts: ``reuse`` tokens held by ``nodes`` (the last
    one possibly cut), and ``entry``, the saved position that covers them
    (its ``rest`` is the seed's unblockable state)."""

    entry: Entry
    reuse: int
    nodes: tuple[Node, ...]


def _no_eviction_hook(_: Entry) -> None:
    return None


class CacheStore:
    def __init__(
        self,
        budget_bytes: int,
        *,
        trimmable: bool,
        block_tokens: int = BLOCK_TOKENS,
        before_evict: Callable[[Entry], None] = _no_eviction_hook,
        now: Callable[[], float] = float,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.budget_bytes = budget_bytes
        self.trimmable = trimmable
        self.block_tokens = block_tokens
        self.root = Node(None, 0, ())
        # The roots of salted paths; a root goes with its last entry.
        self._salted: dict[str, Node] = {}
        self._before_evict = before_evict
        # The owner's clock, read only to compare with ``Entry.held_until``
        # (the default, ``float()``, is always 0: nothing held expires).
        self._now = now
        self._entries: dict[Entry, None] = {}
        self._named: dict[str, Entry] = {}
        self._name_pins: Counter[str] = Counter()
        self._bytes = 0
        self._nodes = 0
        self._clock = 0
        self._serial = 0
        # The sum of the entries' own sizes (``Entry.nbytes``), kept current.
        self._logical = 0
        # Entries changed (added, touched, pinned, renamed, resized) and
        # removed since ``take_changes``: what a view kept from deltas needs.
        self._changed: dict[Entry, None] = {}
        self._removed: list[Entry] = []
        # The dirty entries (anonymous ones in the order of their last use:
        # a touch moves one to the end) and those a live request pins, so a
        # writer or a pruner looks at them alone, not at every entry.
        self._dirty_named: dict[Entry, None] = {}
        self._dirty_anon: dict[Entry, None] = {}
        self._pinned: dict[Entry, None] = {}
        # The hashed blocks made (True) and freed (False) since
        # ``take_block_log``, in order, each with its salt if it is a
        # salted path's first block; kept only with a hasher.
        self._block_hasher = block_hasher
        self._block_log: list[tuple[bool, Node, str]] = []

    # --- reading -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries))

    @property
    def total_bytes(self) -> int:
        """Bytes actually held: every live block once, every rest state."""
        return self._bytes

    @property
    def block_count(self) -> int:
        return self._nodes

    @property
    def logical_bytes(self) -> int:
        """The sum of the entries' own sizes (shared blocks in each)."""
        return self._logical

    @property
    def named_count(self) -> int:
        return len(self._named)

    def named(self, key: str) -> Entry | None:
        return self._named.get(key)

    def mark(self, entry: Entry) -> None:
        """``entry`` changed in a way its view shows (the owner sets some
        fields itself: ``dirty``, ``used_at``, ``held_until``)."""
        if entry in self._entries:
            self._changed[entry] = None

    def clean(self, entry: Entry) -> None:
        """``entry`` is on disk as it is now."""
        entry.dirty = False
        self._dirty_named.pop(entry, None)
        self._dirty_anon.pop(entry, None)
        self.mark(entry)

    def dirty_entries(self) -> tuple[list[Entry], Iterator[Entry]]:
        """The dirty named entries, most recently used first, and an
        iterator over the dirty anonymous ones in that order (lazy: a writer
        that takes the first pays for one; the store must not change while
        it runs)."""
        named = sorted(self._dirty_named, key=lambda e: -e.last_use)
        return named, reversed(self._dirty_anon)

    def pinned_entries(self) -> list[Entry]:
        """Entries a live request pins, and those whose name it pins."""
        out = list(self._pinned)
        out += (e for k in self._name_pins if (e := self._named.get(k)) is not None)
        return out

    def _sync(self, entry: Entry) -> None:
        """Keep the dirty sets current for ``entry`` (after a touch, a
        rename, a save)."""
        self._dirty_named.pop(entry, None)
        self._dirty_anon.pop(entry, None)
        if entry.dirty and entry in self._entries:
            (self._dirty_anon if entry.key is None else self._dirty_named)[entry] = None

    def take_block_log(self) -> list[tuple[bool, Node, str]]:
        """The hashed blocks made (``True``) and freed (``False``) since the
        last call, in the order it happened (a parent is made before its
        children and freed after them), each made one with the salt hashed
        into it (a salted path's first block; ``""`` for the others)."""
        log, self._block_log = self._block_log, []
        return log

    def take_changes(self) -> tuple[list[Entry], list[Entry]]:
        """The entries changed and those removed since the last call (one
        added and removed meanwhile is among the removed only)."""
        changed, self._changed = list(self._changed), {}
        removed, self._removed = self._removed, []
        return changed, removed

    def owned(self, key: str) -> list[Entry]:
        """The alternates that belong to the name ``key``."""
        return [e for e in self._entries if e.owner == key]

    def root_of(self, salt: str = "") -> Node:
        """The root of ``salt``'s paths (an empty node where it has none)."""
        if not salt:
            return self.root
        return self._salted.get(salt) or Node(None, 0, ())

    def walk(self, tokens: Sequence[int], salt: str = "") -> tuple[list[Node], int]:
        """The nodes along the longest stored prefix of ``tokens`` and its
        length; the last node may be shared only in part."""
        path: list[Node] = []
        node, pos, b = self.root_of(salt), 0, self.block_tokens
        while pos < len(tokens):
            chunk = tuple(tokens[pos : pos + b])
            child = node.children.get(chunk)
            if child is None:
                best, shared = self._nearest(node, chunk)
                if best is not None:
                    path.append(best)
                    pos += shared
                break
            path.append(child)
            pos += len(chunk)
            node = child
        return path, pos

    def seed(self, prompt: Sequence[int], salt: str = "") -> Seed | None:
        """The deepest stored position a prompt can start from, leaving at
        least one token to prefill (the model must run on something to give
        the first token's logits)."""
        usable = len(prompt) - 1
        if usable <= 0:
            return None
        if self.trimmable:
            path, lcp = self.walk(prompt, salt)
            usable = min(lcp, usable)
            if usable <= 0:
                return None
            cover = [n for n in path if n.start < usable]
            entry = self._covering(cover[-1], usable)
            if entry is None:
                return self._seed_short(prompt, path, usable)
            return Seed(entry, usable, tuple(cover))
        best: Entry | None = None
        for e in self.prefixes(prompt, limit=usable, salt=salt):
            if best is None or (e.end, e.last_use) > (best.end, best.last_use):
                best = e
        if best is None:
            return None
        return Seed(best, best.end, tuple(best.path))

    def prefixes(
        self, tokens: Sequence[int], limit: int | None = None, salt: str = ""
    ) -> list[Entry]:
        """Every entry whose tokens are a prefix of ``tokens`` (at most
        ``limit`` long). One may end in a sibling of the path (a partial block
        that is a prefix of the prompt's block, folded into a longer one), so
        every child that shares tokens with ``tokens`` is looked at."""
        limit = len(tokens) if limit is None else limit
        out: list[Entry] = []
        node: Node | None = self.root_of(salt)
        pos, b = 0, self.block_tokens
        while node is not None and pos < limit:
            chunk = tuple(tokens[pos : pos + b])
            for n in node.tail_lengths:  # one look-up per length, not per sibling
                if n <= len(chunk) and pos + n <= limit:
                    out += node.tails.get(chunk[:n], ())
            node, pos = node.children.get(chunk) if len(chunk) == b else None, pos + b
        return out

    def extensions(self, entry: Entry) -> list[Entry]:
        """Every other entry whose tokens start with ``entry``'s."""
        if not entry.path:
            return []
        last = entry.path[-1]
        assert last.parent is not None
        cut = entry.end - last.start
        out: list[Entry] = []
        # Blocks that hold the same tokens up to the entry's end: its own and
        # siblings that diverge after it.
        stack = [n for n in last.parent.children.values() if n.tokens[:cut] == last.tokens[:cut]]
        while stack:
            node = stack.pop()
            out += (e for e in node.ends if e is not entry and e.end >= entry.end)
            stack.extend(node.children.values())
        return out

    def _seed_short(self, prompt: Sequence[int], path: list[Node], usable: int) -> Seed | None:
        """The rare trimmable seed where no entry through the walk's last
        node reaches ``usable``: every entry there ends inside it (a partial
        block absorbed into a longer one whose own entry is gone). The best
        of the last node's siblings (each as far as it shares the prompt and
        its entries reach) and their parent, found by looking at each."""
        last = path[-1]
        parent = last.parent
        assert parent is not None
        base = path[:-1]
        options: list[tuple[int, int, Entry, tuple[Node, ...]]] = []
        if base:
            reach = min(parent.end, usable)
            entry = self._covering(parent, reach)
            if entry is not None:
                options.append((reach, entry.last_use, entry, tuple(base)))
        for child in parent.children.values():
            shared = common_prefix(child.tokens, tuple(prompt[child.start : child.end]))
            if not shared:
                continue
            reach = min(child.start + shared, usable)
            entry = self._covering(child, reach)
            if entry is None:
                inside = [e for e in child.ends if e.end < reach]
                if not inside:
                    continue
                entry = max(inside, key=lambda e: (e.end, e.last_use))
                reach = entry.end
            options.append((reach, entry.last_use, entry, (*base, child)))
        if not options:
            return None
        reach, _, entry, nodes = max(options, key=lambda o: (o[0], o[1]))
        return Seed(entry, reach, tuple(n for n in nodes if n.start < reach))

    def _covering(self, node: Node, pos: int) -> Entry | None:
        """The most recently used entry whose path passes position ``pos``
        inside ``node``, if any (the entries through ``node`` may all end
        inside it before ``pos``)."""
        return self.recent_through(node, pos)

    @staticmethod
    def recent_through(node: Node, pos: int, *, past: bool = False) -> Entry | None:
        """The most recently used entry through ``node`` that holds tokens
        to ``pos`` (``past``: beyond it). Only entries ending inside
        ``node`` can fall short, so few are passed over."""
        for e in reversed(node.by_use):
            if e.end > pos or (e.end == pos and not past):
                return e
        return None

    def exact(self, tokens: Sequence[int], salt: str = "") -> list[Entry]:
        """The entries holding exactly ``tokens``."""
        root = self.root_of(salt)
        node: Node | None = root
        b = self.block_tokens
        for start in range(0, len(tokens), b):
            chunk = tuple(tokens[start : start + b])
            node = self._child(node, chunk) if node is not None else None
        if node is None or node is root:
            return []
        return [e for e in node.ends if e.end == len(tokens)]

    def _child(self, node: Node, chunk: tuple[int, ...]) -> Node | None:
        """The child holding ``chunk``: the block itself or, for a partial
        chunk, a longer block that starts with it (the first such in token
        order: the children that start with ``chunk`` follow it there)."""
        child = node.children.get(chunk)
        if child is not None or len(chunk) >= self.block_tokens:
            return child  # a whole block is only ever held by itself
        keys = node.keys
        i = bisect.bisect_left(keys, chunk)
        if i < len(keys) and keys[i][: len(chunk)] == chunk:
            return node.children[keys[i]]
        return None

    @staticmethod
    def _nearest(node: Node, chunk: tuple[int, ...]) -> tuple[Node | None, int]:
        """The child sharing the longest prefix with ``chunk`` and how many
        tokens it shares (``(None, 0)``: none shares one). In token order
        the prefix shared with ``chunk`` only shrinks away from where
        ``chunk`` would go, so its two neighbours there hold the longest."""
        keys = node.keys
        i = bisect.bisect_left(keys, chunk)
        best, shared = None, 0
        for key in keys[max(0, i - 1) : i + 1]:
            n = common_prefix(key, chunk)
            if n > shared:
                best, shared = node.children[key], n
        return best, shared

    @staticmethod
    def _link(parent: Node, child: Node) -> None:
        parent.children[child.tokens] = child
        bisect.insort(parent.keys, child.tokens)

    @staticmethod
    def _unlink(parent: Node, child: Node) -> None:
        del parent.children[child.tokens]
        keys = parent.keys
        del keys[bisect.bisect_left(keys, child.tokens)]

    # --- writing -----------------------------------------------------------

    def add(
        self,
        tokens: Sequence[int],
        make_blocks: MakeBlocks,
        *,
        key: str | None = None,
        kind: EntryKind = "anonymous",
        owner: str | None = None,
        rest: Any = None,
        rest_nbytes: int = 0,
        roster: str = "",
        dirty: bool = True,
        salt: str = "",
    ) -> tuple[Entry, list[Entry]]:
        """Save a position; returns the entry and the entries evicted to stay
        in budget. ``make_blocks`` is asked only for the blocks the trie does
        not hold yet; if it raises, nothing changed."""
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("an entry holds at least one token")
        same = self._same(tokens, key, kind, owner, roster, salt)
        if same is not None:
            same.dirty = same.dirty or dirty
            self.touch(same, hit=False)
            return same, []
        missing = self._missing(tokens, salt)
        made = list(make_blocks([(s, e) for _, s, e in missing])) if missing else []
        if len(made) != len(missing):
            raise ValueError("make_blocks returned the wrong number of blocks")
        if salt and salt not in self._salted:
            self._salted[salt] = Node(None, 0, ())
        path = self._build(tokens, missing, made, self.root_of(salt), salt)
        entry = Entry(
            tokens,
            key=key,
            kind=kind,
            owner=owner,
            rest=rest,
            rest_nbytes=rest_nbytes,
            roster=roster,
            dirty=dirty,
            path=path,
            path_nbytes=sum(n.nbytes for n in path),
            salt=salt,
            serial=self._next_serial(),
        )
        for node in path:
            node.refs += 1
        path[-1].ends.append(entry)
        self._add_tail(entry)
        self._entries[entry] = None
        self._bytes += rest_nbytes
        self._logical += entry.nbytes
        if key is not None:
            old = self._named.get(key)
            if old is not None:
                self.remove(old)  # after the new path holds its references
            self._named[key] = entry
        self.touch(entry, hit=False)
        if self.trimmable:
            self._drop_covered(entry)
        return entry, self._enforce_budget(keep=entry)

    def _same(
        self,
        tokens: tuple[int, ...],
        key: str | None,
        kind: EntryKind,
        owner: str | None,
        roster: str,
        salt: str = "",
    ) -> Entry | None:
        """An entry that already holds exactly ``tokens`` and can stand for
        the one being saved: the same name, or (for a named save) an
        anonymous one, which takes the name."""
        entries = self.exact(tokens, salt)
        if key is None:
            if not entries:
                return None
            found = entries[0]
            if found.key is None and found.owner is None and owner is not None:
                found.owner = owner
            return found
        for e in entries:
            if e.key == key:
                e.kind, e.roster = kind, roster or e.roster
                return e
        for e in entries:
            if e.key is None:
                self.rename(e, key, kind, roster)
                return e
        return None

    def _missing(
        self, tokens: tuple[int, ...], salt: str = ""
    ) -> list[tuple[Node | None, int, int]]:
        """``(None, start, end)`` for each block of ``tokens`` the trie lacks."""
        out: list[tuple[Node | None, int, int]] = []
        node: Node | None = self.root_of(salt)
        b = self.block_tokens
        for start in range(0, len(tokens), b):
            chunk = tokens[start : start + b]
            child = self._child(node, chunk) if node is not None else None
            if child is None:
                out.append((None, start, start + len(chunk)))
            node = child
        return out

    def _build(
        self,
        tokens: tuple[int, ...],
        missing: list[tuple[Node | None, int, int]],
        made: list[tuple[Any, int]],
        root: Node,
        salt: str = "",
    ) -> list[Node]:
        payload = {start: blk for (_, start, _), blk in zip(missing, made, strict=True)}
        path: list[Node] = []
        node = root
        b = self.block_tokens
        for start in range(0, len(tokens), b):
            chunk = tokens[start : start + b]
            child = self._child(node, chunk)
            if child is None:
                block, nbytes = payload[start]
                child = Node(node, start, chunk, block, nbytes)
                self._link(node, child)
                self._bytes += nbytes
                self._nodes += 1
                self._absorb(child)
                if self._block_hasher is not None:
                    self._hash(child, salt)
            path.append(child)
            node = child
        return path

    def _hash(self, node: Node, salt: str) -> None:
        """Hash and log a block just made, if it is a full block whose
        parent is hashed or a root (about 11 us a block: 0.7 ms for a
        4k-token prompt's 64 blocks, made once)."""
        parent, hasher = node.parent, self._block_hasher
        assert parent is not None
        assert hasher is not None
        first = parent.parent is None
        if len(node.tokens) != self.block_tokens or (not first and not parent.digest):
            return
        if min(node.tokens) < 0:
            return  # an image key: no text prompt matches it
        salt = salt if first else ""
        node.digest = hasher(None if first else parent.digest, node.tokens, salt)
        self._block_log.append((True, node, salt))

    def _freed(self, node: Node) -> None:
        """``node`` left the trie."""
        self._bytes -= node.nbytes
        self._nodes -= 1
        node.block = None
        if node.digest:
            self._block_log.append((False, node, ""))

    def _absorb(self, node: Node) -> None:
        """A partial block that is a prefix of the new ``node`` is redundant:
        its entries end inside ``node`` from now on and it is freed. (A
        partial block is always a leaf: its path ends in it.) Such a sibling
        is keyed by a prefix of ``node``'s tokens: one look-up per length,
        never a pass over the siblings."""
        parent = node.parent
        assert parent is not None
        siblings = [parent.children.get(node.tokens[:n]) for n in range(1, len(node.tokens))]
        moved = [e for sib in siblings if sib is not None for e in sib.by_use]
        for e in sorted(moved, key=lambda e: e.last_use):  # ``by_use``'s order
            node.by_use[e] = None
        for sib in siblings:
            if sib is None:
                continue
            for e in sib.ends:
                e.path[-1] = node
                e.path_nbytes += node.nbytes - sib.nbytes
                self._logical += node.nbytes - sib.nbytes
                node.ends.append(e)
                node.refs += 1
                self.mark(e)
            self._unlink(parent, sib)
            self._freed(sib)
            sib.ends, sib.refs = [], 0

    def _drop_covered(self, entry: Entry) -> None:
        """On trimmable models an anonymous entry whose tokens are a prefix of
        ``entry``'s is redundant: ``entry`` serves every prompt it served."""
        for node in entry.path:
            for other in list(node.ends):
                if (
                    other is not entry
                    and other.end < entry.end
                    and other.key is None
                    and other.owner is None
                    and other.pins == 0
                    and other.held_until <= self._now()
                ):
                    self.remove(other)

    def remove(self, entry: Entry) -> None:
        """Forget ``entry``; blocks nobody else references are freed."""
        if entry not in self._entries:
            return
        del self._entries[entry]
        self._logical -= entry.nbytes
        self._changed.pop(entry, None)
        self._removed.append(entry)
        self._dirty_named.pop(entry, None)
        self._dirty_anon.pop(entry, None)
        self._pinned.pop(entry, None)
        if entry.key is not None and self._named.get(entry.key) is entry:
            del self._named[entry.key]
        if entry.path:
            entry.path[-1].ends.remove(entry)
            self._drop_tail(entry)
        for node in reversed(entry.path):
            node.by_use.pop(entry, None)
            node.refs -= 1
            if node.refs == 0:
                assert node.parent is not None
                self._unlink(node.parent, node)
                self._freed(node)
        self._bytes -= entry.rest_nbytes
        entry.path = []
        root = self._salted.get(entry.salt)
        if root is not None and not root.children:
            del self._salted[entry.salt]  # salts are the clients': none is kept empty

    def rename(self, entry: Entry, key: str, kind: EntryKind, roster: str) -> None:
        """Give an anonymous entry a name (replacing what had the name)."""
        old = self._named.get(key)
        if old is not None and old is not entry:
            self.remove(old)
        entry.key, entry.kind, entry.owner, entry.roster = key, kind, None, roster
        entry.dirty = True
        self._named[key] = entry
        self.mark(entry)
        self._sync(entry)

    def touch(self, entry: Entry, *, hit: bool) -> None:
        entry.last_use = self._tick()
        if hit:
            entry.hits += 1
        for node in entry.path:
            node.by_use.pop(entry, None)
            node.by_use[entry] = None
        self.mark(entry)
        if entry.dirty:
            self._sync(entry)

    # --- pins --------------------------------------------------------------

    def pin(self, entry: Entry) -> None:
        entry.pins += 1
        if entry in self._entries:
            self._pinned[entry] = None
        self.mark(entry)

    def unpin(self, entry: Entry) -> None:
        """Release one pin; never below zero, so a double release cannot
        unpin someone else's hold."""
        entry.pins = max(0, entry.pins - 1)
        if not entry.pins:
            self._pinned.pop(entry, None)
        self.mark(entry)

    def pin_name(self, key: str) -> None:
        self._name_pins[key] += 1
        self._mark_name(key)

    def unpin_name(self, key: str) -> None:
        if self._name_pins[key] <= 1:
            del self._name_pins[key]
        else:
            self._name_pins[key] -= 1
        self._mark_name(key)

    def _mark_name(self, key: str) -> None:
        entry = self._named.get(key)
        if entry is not None:
            self.mark(entry)

    def name_pinned(self, key: str) -> bool:
        return self._name_pins[key] > 0

    @property
    def pin_count(self) -> int:
        return sum(e.pins for e in self._entries) + sum(self._name_pins.values())

    # --- internals ---------------------------------------------------------

    @staticmethod
    def _tail(entry: Entry) -> tuple[Node, tuple[int, ...]]:
        last = entry.path[-1]
        assert last.parent is not None
        return last.parent, entry.tokens[last.start :]

    def _add_tail(self, entry: Entry) -> None:
        parent, tail = self._tail(entry)
        held = parent.tails.setdefault(tail, [])
        if not held:
            parent.tail_lengths[len(tail)] += 1
        held.append(entry)

    def _drop_tail(self, entry: Entry) -> None:
        parent, tail = self._tail(entry)
        held = parent.tails[tail]
        held.remove(entry)
        if not held:
            del parent.tails[tail]
            parent.tail_lengths[len(tail)] -= 1
            if not parent.tail_lengths[len(tail)]:
                del parent.tail_lengths[len(tail)]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def _enforce_budget(self, keep: Entry) -> list[Entry]:
        if self._bytes <= self.budget_bytes or len(self._entries) <= 1:
            return []
        target = int(self.budget_bytes * 0.8)
        evicted: list[Entry] = []
        now = self._now()
        for entry in sorted(self._entries, key=lambda e: (e.tier, e.last_use)):
            if self._bytes <= target or len(self._entries) <= 1:
                break
            if entry is keep or entry.pins or (entry.key and self.name_pinned(entry.key)):
                continue
            if entry.held_until > now:
                continue
            if entry not in self._entries:
                continue  # removed by an earlier victim's hook
            self._before_evict(entry)
            self.remove(entry)
            evicted.append(entry)
        return evicted
