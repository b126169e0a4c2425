"""``mlx_vlm.server`` on gezel-trio's BLAS, for ``python -m bench vision``.

Started as ``python -c <preload stub> bench/_mlx_vlm_server.py ARGS``: the
stub binds MLX to OpenBLAS first (as every system in the bench runs), then
this script runs mlx-vlm's server with ARGS.

One fix is applied, and only here: mlx-vlm 0.7.10's ``prepare_inputs`` hands
its tokenizer options (``padding``, ``padding_side``) to ``LlavaProcessor``,
which forwards every option to transformers' image processor, and
transformers 5 refuses the unknown ``padding`` (HTTP 500 on every LLaVA
image request). Dropping the two options before the image processor is
what the processor meant; without it the comparison has nothing to measure.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from mlx_vlm.models.llava import processing_llava

_original = processing_llava.LlavaProcessor.__call__


def _call(self: Any, images: Any = None, text: Any = None, **kwargs: Any) -> Any:
    kwargs.pop("padding", None)
    kwargs.pop("padding_side", None)
    return _original(self, images=images, text=text, **kwargs)


processing_llava.LlavaProcessor.__call__ = _call  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv[0] = "mlx_vlm.server"
    runpy.run_module("mlx_vlm.server", run_name="__main__", alter_sys=True)
