"""The product speaks of the product: no words that record how the team
worked in the code, tests, benchmarks, documents or examples.

A reader of any of them should learn what gezel-trio does and why, not
which numbered piece of work, review or person brought a line in: that
history lives in git and CHANGELOG.md. The scan reads every text file under
``src/``, ``tests/``, ``bench/``, ``docs/`` and ``examples/``, ``README.md``
and the ``dev`` script, and matches each pattern against a whole file (a
phrase may break across lines), reporting ``file:line: text`` per hit.

"session", "landed" and "helper" are left out as bare words: the product
names its prompt-cache sessions, writes that landed and helper functions.
Only a helper spoken of as a person ("a helper's branch", "the helper
found") is matched.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("src", "tests", "bench", "docs", "examples", "README.md", "dev")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".json", ".sh", ".cfg", ".yml", ".yaml"}
SCRIPTS = {"dev"}  # text files without a suffix

# The only exclusions (paths from the root), each for a reason:
EXCLUDED = (
    # What the real CLIs sent, byte for byte: their words, not ours (the
    # README beside the folders is ours, and scanned).
    "tests/fixtures/clients/*/*",
    # Codex's base prompt in Codex's own words (shortened), which
    # bench/scenarios/_agent_shapes.py sends as ``instructions``.
    "bench/scenarios/recorded/*",
    # This file spells every pattern out.
    "tests/docs/test_work_log_words.py",
)

_HEX = r"(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"  # a commit hash: hex with a digit
PATTERNS = {
    "a numbered stop": r"\bstop\s+\d+\b",
    "this stop": r"\bthis\s+stop\b",
    "a teammate": r"\bteammates?\b",
    "throwaway": r"\bthrowaway\b",
    "the review": r"\bthe\s+review\b",
    "an issue number": r"\bissues?\s+#?\d+",
    # ``owner/repo#N`` names an upstream issue; ``&#39;`` is an entity.
    "a bare #N": r"(?<![\w/&#])#\d{2,}\b",
    # An upstream pin reads ``openai/codex@<sha>``; a hash beside the word
    # "commit" is one of ours ("Recent commits:" heads a prompt's git log).
    "a commit hash": rf"\bcommit\b[^\w\n]{{0,3}}\s*[^\w\s]{{0,3}}{_HEX}"
    rf"|\b{_HEX}[^\w]{{1,4}}commit\b",
    "a numbered session": r"\bsession\s+\d+\b",
    "a round of work": r"\bround\s+of\s+work\b",
    "a helper as a person": r"\bhelpers?'s\s+(?:branch|worktree|run|machine)\b"
    r"|\b(?:the|a|each|another|one)\s+helpers?\s+"
    r"(?:found|wrote|measured|ran|saw|said|reported|noticed|fixed|added|checked)\b",
}
_ANY = re.compile("|".join(f"(?:{p})" for p in PATTERNS.values()), re.IGNORECASE)


def _excluded(path: Path) -> bool:
    rel = path.relative_to(ROOT)
    return any(len(rel.parts) == len(Path(e).parts) and rel.match(e) for e in EXCLUDED)


def _text_files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        top = ROOT / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*"))
        for path in candidates:
            if not path.is_file() or ".git" in path.parts or _excluded(path):
                continue
            if path.suffix in SUFFIXES or path.name in SCRIPTS:
                out.append(path)
    return out


def hits(text: str) -> list[tuple[int, str]]:
    """Each match in ``text``: the line it starts on (1-based) and that line."""
    lines = text.splitlines()
    found = []
    for m in _ANY.finditer(text):
        line = text.count("\n", 0, m.start())
        found.append((line + 1, lines[line].strip()))
    return found


def test_no_work_log_words() -> None:
    found = []
    for path in _text_files():
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}:{n}: {line}" for n, line in hits(text)]
    assert not found, (
        f"{len(found)} line(s) speak of how the work was done, not of the product:\n"
        + "\n".join(found)
    )


def test_the_scan_sees_the_words_and_spares_the_product() -> None:
    caught = [
        "as stop 41 measured",
        "one of stop 42's runs",
        "this stop adds",
        "like a teammate handing off",
        "a throwaway script",
        "the leaks the review found",
        "the review's run",
        "issue 9",
        "(issues 9, 20)",
        "issue #47",
        "issue 12's work",
        "see #47",
        "on commit `a21ccd8`",
        '"commit": "a21ccd8"',
        "at commit\n   71163530a46dc568775f9ee95a9b57de3385cd9a",
        "a21ccd8 (commit)",
        "in session 3",
        "another round of work",
        "on a helper's branch",
        "the helper measured",
    ]
    spared = [
        "stop sequences",
        "a stop that arrives",
        'finish_reason "stop"',
        "issue a request",
        "openai/codex#1234",
        "&#39;",
        "# 12 tokens",
        "colour #1f77b4",
        "read at openai/codex@71163530a46dc568775f9ee95a9b57de3385cd9a",
        "NEVER commit changes unless the user asks",
        "git commit -qm start",
        "the session entry",
        "a write that landed",
        "the seed's own helper modules",
        "test helper",
        "review the diff",
        "Recent commits:\n3f2c1ab ledger: count arrivals by hour",
    ]
    assert [s for s in caught if not hits(s)] == []
    assert [s for s in spared if hits(s)] == []
