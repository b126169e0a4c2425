"""gezel-trio started the way the seed sidecar was: ``python
gezel_mlx_server.py --model DIR --host ... --port ... <the seed's flags>``
serves with the seed profile (docs/migrating-from-the-seed.md).

This file is run by path, never imported: the gezel app spawns
``<its MLX venv python> <bundle>/providers/mlx/python/gezel_mlx_server.py``,
so a copy of this file goes there in place of the seed's, with gezel-trio
installed in that venv. ``gezel-trio seed-server-path`` prints where the
installed one is. Its directory holds no package (``_seed`` has no
``__init__``), so nothing here can shadow a module.
"""

import os
import sys

if __name__ == "__main__":
    # Python put this file's directory first on sys.path. In the app's
    # bundle that directory holds the seed's own helper modules
    # (tool_grammar.py, cache_persist.py, ...): none of them may stand in
    # for a module that gezel-trio or its dependencies import.
    here = os.path.dirname(os.path.realpath(__file__))
    if sys.path and os.path.realpath(sys.path[0] or os.curdir) == here:
        del sys.path[0]

    from gezel_trio.cli import main

    sys.exit(main(seed_launch=True))
