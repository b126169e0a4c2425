"""The host side: everything that runs on the engine's one host thread
around a backend - the loop that exchanges orders and events with the Trio
side once per step (``loop``), the prompt-cache service and its files
(``prompt_cache``, ``persist``). The ``Backend`` protocol these drive is
``gezel_trio.core.backend``. No MLX here: the MLX backend is ``gezel_trio.mlx``.
"""
