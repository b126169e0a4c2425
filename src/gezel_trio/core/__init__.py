"""The pure core: what requests, events, errors and the model look like, the
scheduler's decisions and the prompt cache's store - plain synchronous code,
no MLX, no Trio, no clock (import-linter checks it)."""
