"""The suite's own shape: what test modules share lives in ``tests/support``
(or a fixture), never in another test module, so a test file can be moved,
split or deleted without breaking another, and importing one never runs a
second file's module-level code (its marks, its fixtures' definitions) in
the importer's worker."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _module(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def _is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def _imported(source: str, path: Path) -> set[str]:
    """Every module ``source`` (the text of ``path``) imports, relative
    imports resolved, and each ``from package import name`` counted as the
    module ``package.name`` too (the name may be a module)."""
    package = _module(path).split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def _imports_a_test_module(source: str, path: Path) -> list[str]:
    return sorted(
        name for name in _imported(source, path) if _is_test_module(name) and name != _module(path)
    )


def test_no_test_module_imports_another() -> None:
    found = [
        f"{path.relative_to(TESTS.parent)} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in _imports_a_test_module(path.read_text(), path)
    ]
    assert not found, "move what is shared to tests/support:\n" + "\n".join(found)


def test_the_scan_sees_every_spelling_of_such_an_import() -> None:
    # The scan itself, on the spellings it must catch and one it must not.
    cases = {
        "from tests.host.test_prompt_cache import Harness": True,
        "import tests.host.test_prompt_cache": True,
        "from tests.host import test_prompt_cache": True,
        "from .test_prompt_cache import Harness": True,
        "from ..shaping.test_grammar import build": True,
        "from tests.support.prompt_cache import Harness": False,
    }
    path = TESTS / "host" / "test_cache_miss.py"
    for source, expected in cases.items():
        assert bool(_imports_a_test_module(source, path)) is expected, source
