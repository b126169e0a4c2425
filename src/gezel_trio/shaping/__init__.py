"""Shaping: a generation's streamed text turned into typed events.

Pure string logic, per sequence, with no MLX and no Trio. So far it holds
:mod:`gezel_trio.shaping.toolcalls` (tool-call markup, one module per
format); reasoning splitting, grammar building and prompt rendering are to
move here beside it.
"""
