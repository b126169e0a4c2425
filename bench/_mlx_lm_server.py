"""``mlx_lm.server`` with its prompt-cache statistics logged exactly.

The bench starts ``python bench/_mlx_lm_server.py ARGS`` instead of
``python -m mlx_lm server ARGS``: the same server, whose own
``_log_cache_stats`` (called before each request is served) logs the byte
count of its ``LRUPromptCache`` as an integer at WARNING level, instead of
in GB with two decimals at INFO. Nothing else changes.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import mlx_lm.server as server


def _log_cache_stats(self: Any) -> None:
    cache = self.prompt_cache
    logging.warning("gezel-bench prompt cache: %d sequences, %d bytes", len(cache), cache.nbytes)


def main() -> None:
    patched = 0
    for value in vars(server).values():
        if isinstance(value, type) and "_log_cache_stats" in vars(value):
            value._log_cache_stats = _log_cache_stats  # type: ignore[attr-defined]
            patched += 1
    if patched != 1:
        raise SystemExit(f"expected one class with _log_cache_stats, found {patched}")
    sys.argv = ["mlx_lm.server", *sys.argv[1:]]
    server.main()


if __name__ == "__main__":
    main()
