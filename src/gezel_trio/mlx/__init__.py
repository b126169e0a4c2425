"""The MLX backend - the only package that imports ``mlx`` and ``mlx_lm``:
the backend over mlx-lm's ``BatchGenerator`` (``backend``), its grammar
processors (``constraints``), model loading and the default model
(``loading``, ``model_source``, ``gguf``), the demo models (``demo_model``),
and binding MLX to an optimized BLAS before anything imports it (``blas``).

This module imports nothing, so ``gezel_trio.mlx.blas`` can run before
``mlx`` is loaded.
"""
