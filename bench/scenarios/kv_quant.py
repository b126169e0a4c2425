"""What a quantized KV cache (``--kv-bits``) saves and costs: KV bytes per
token, and the quality lost, at 16/32 (unquantized), 8 and 4 bits.

In a child process bound to the servers' OpenBLAS (``bench._worker``), on
the same float32 weights the servers hold (default: SmolLM2-135M-Instruct,
the default model), for each prompt (the ``bench speculative`` workloads,
rendered with the chat template):

- the unquantized reference: ``--tokens`` greedy tokens, and the model's
  log-probabilities over them with the reference tokens fed (teacher
  forcing);
- per bit width, through gezel-trio's own cache layout (``mlx.kv_quant``):
  greedy agreement (the tokens equal to the reference's before the first
  difference, and the share of positions equal), and, teacher-forced on the
  reference tokens, the mean absolute drift of the chosen token's
  log-probability, the mean KL divergence from the reference distribution,
  and how often the top token agrees;
- KV bytes per token (``mlx.memory.kv_footprint`` on that layout) and the
  decode tok/s of the free-running loop at that prompt length (one stream,
  not the batch: a side figure).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import _servers, _worker
from bench._scenario import Context, Option, Result, Scenario, table
from bench.scenarios.speculative import WORKLOADS, messages


def measure(
    model: str, workloads: list[str], tokens: int, bits: list[int], group_size: int
) -> Iterator[dict[str, Any]]:
    """In the child: one dict per (workload, bit width)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from gezel_trio.mlx.kv_quant import layout, plan
    from gezel_trio.mlx.loading import hold_float32
    from gezel_trio.mlx.memory import kv_footprint

    m, tok = load(model)
    hold_float32(m)
    mx.eval(m.parameters())
    stream = mx.default_stream(mx.default_device())
    layers = plan(m, 8, group_size, stream).layers

    def cache(b: int) -> list[Any]:
        return layout(m, b, group_size, layers)

    def greedy(prompt: list[int], b: int) -> tuple[list[int], float]:
        c = cache(b)
        logits = m(mx.array([prompt]), cache=c)
        out: list[int] = []
        start = time.perf_counter()
        for _ in range(tokens):
            t = int(mx.argmax(logits[0, -1]).item())
            out.append(t)
            logits = m(mx.array([[t]]), cache=c)
        mx.eval(logits)
        return out, tokens / (time.perf_counter() - start)

    def forced(prompt: list[int], answer: list[int], b: int) -> mx.array:
        """Log-probabilities at each answer position, the answer fed."""
        logits = m(mx.array([prompt + answer[:-1]]), cache=cache(b))[0, len(prompt) - 1 :]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        return lp

    for w in workloads:
        prompt = list(tok.apply_chat_template(messages(w), add_generation_prompt=True))
        ref, ref_tps = greedy(prompt, 0)
        ref_lp = forced(prompt, ref, 0)
        chosen = mx.array(ref)[:, None]
        ref_chosen = mx.take_along_axis(ref_lp, chosen, axis=-1)[:, 0]
        for b in [0, *bits]:
            foot = kv_footprint(m, stream, cache(b))
            row: dict[str, Any] = {
                "workload": w,
                "prompt_tokens": len(prompt),
                "bits": b,
                "kv_bytes_per_token": foot.per_token if foot is not None else None,
            }
            if b == 0:
                row.update(agree_prefix=tokens, agree_share=1.0, tok_s=ref_tps)
                row.update(logprob_drift=0.0, kl=0.0, top1=1.0)
                yield row
                continue
            got, tps = greedy(prompt, b)
            prefix = next(
                (i for i, (x, y) in enumerate(zip(got, ref, strict=True)) if x != y), tokens
            )
            lp = forced(prompt, ref, b)
            drift = mx.abs(mx.take_along_axis(lp, chosen, axis=-1)[:, 0] - ref_chosen)
            kl = mx.sum(mx.exp(ref_lp) * (ref_lp - lp), axis=-1)
            top1 = mx.argmax(lp, axis=-1) == mx.argmax(ref_lp, axis=-1)
            row.update(
                agree_prefix=prefix,
                agree_share=sum(x == y for x, y in zip(got, ref, strict=True)) / tokens,
                tok_s=tps,
                logprob_drift=float(mx.mean(drift).item()),
                kl=float(mx.mean(kl).item()),
                top1=float(mx.mean(top1.astype(mx.float32)).item()),
            )
            yield row


def run(ctx: Context) -> Result:
    a = ctx.args
    model_dir = _servers.float32_model(a.model)
    with ctx.phase("reference and quantized decodes"):
        got = _worker.run(
            f"{__name__}:measure",
            model=str(model_dir),
            workloads=list(a.workloads),
            tokens=a.tokens,
            bits=list(a.bits),
            group_size=a.group_size,
        )
    rows = [
        (
            r["workload"],
            r["prompt_tokens"],
            r["bits"] or "unquantized",
            r["kv_bytes_per_token"],
            r["agree_prefix"],
            r["agree_share"],
            r["logprob_drift"],
            r["kl"],
            r["top1"],
            r["tok_s"],
        )
        for r in got
    ]
    return Result(
        data={"model": str(model_dir), "tokens": a.tokens, "measurements": got},
        tables=[
            table(
                f"KV bits: memory and quality, {a.tokens} greedy tokens, group {a.group_size}",
                "workload | prompt tokens:d | KV bits | KV bytes per token:d"
                " | same tokens before the first difference:d | same tokens:.3f"
                " | mean abs logprob drift:.4f | mean KL:.5f | top-1 agrees:.3f"
                " | decode tok/s, 1 stream:.1f",
                rows,
                "drift, KL and top-1: teacher-forced on the unquantized greedy tokens;"
                " same tokens: the free-running greedy output against the unquantized"
                " one; tok/s: the model's own loop at this prompt length (a side figure)",
            )
        ],
        title=f"model {Path(model_dir).name}",
    )


SCENARIO = Scenario(
    name="kv_quant",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("tokens", 256, "greedy tokens per prompt", int, quick=16),
        Option("bits", [8, 4], "KV bit widths", int, "+"),
        Option("group_size", 64, "quantization group size", int),
        Option(
            "workloads", list(WORKLOADS), "workloads", str, "+", choices=WORKLOADS, quick=["code"]
        ),
        Option("model", None, "a model directory (default: the default model)", Path),
    ),
)
