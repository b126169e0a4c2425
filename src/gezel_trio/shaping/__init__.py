"""Shaping: from a sequence's text to what a protocol sends - reasoning split
out of the answer, tool-call markup parsed into calls - and the prompt and
grammar that shape the model's output in the first place. Pure Python (no
MLX, no Trio); runs in the task that reads a request, or on a worker thread.
"""
