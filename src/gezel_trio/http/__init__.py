"""The OpenAI-compatible HTTP edge (quart-trio on hypercorn). Imports no MLX."""
