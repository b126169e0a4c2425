"""The model fingerprint: what the KV of a token sequence depends on.

Persisted prompt-cache entries (``--persist-dir``) are filed under it, and
the reply ledger and sealed replies kept there are keyed by it, so an
entry is only ever served to the model that computed it. In it:

* the bytes of every ``*.safetensors`` file of the model directory (their
  sha256, streamed): a fine-tune written over the old files, with the same
  names and sizes, is another model;
* ``config.json``: the architecture, its sizes, rope scaling, quantization;
* the format the weights are held in once loaded (``held``): on the CPU a
  quantized or half-precision model runs as float32 unless
  ``--keep-quantized`` keeps it as stored, and the two compute different KV
  (where the flag changes nothing, on a GPU or for float32 weights, it does
  not change the fingerprint either);
* mlx-lm's version: it holds the model code that turns weights into KV;
* ``tokenizer.json`` and ``tokenizer_config.json`` without its chat
  template. The KV of a token id sequence does not depend on them (cache
  entries are matched by token ids, and a new tokenizer only stops old
  prompts from matching), but the reply ledger kept beside the cache maps
  reply text to the ids generated, which a changed vocabulary breaks. The
  chat template only changes which tokens a prompt has: it is left out, so
  a template fix keeps the cache.

Left out: adapters (the server loads none: mlx-lm's adapter path is never
given), the device and the batch size (float rounding only), the operator's
``--model-fingerprint`` (which replaces all of this).

Hashing reads every weight byte once (sha256 streamed from the page cache
ran at 565-607 MB/s on one of 2 busy cores, 0.16-0.30 s for the default
model's 98 MB, so about 1.7 s per GB), so the digest of each file is
remembered in ``<persist_dir>/weight-digests/``, one small JSON file per
weight file path, keyed by its size, mtime, ctime and inode: a restart with
the same files reads none of them; a file written anew (a new mtime, or a
new ctime even where a copy restored the mtime, or a new inode) is hashed
again. Without a persist directory nothing outlives the process, so the
weight files enter by name and size only and nothing is read.

Runs on the engine's host thread while the model loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from importlib import metadata
from pathlib import Path

from ..core.shared_dir import read_regular

__all__ = ["DIGESTS_DIR", "model_fingerprint", "weights_digest"]

log = logging.getLogger("gezel_trio.mlx")

# Beside the persisted cache: the digests are only needed where it is.
DIGESTS_DIR = "weight-digests"
_VERSION = "gezel-fp-2"
_CHUNK = 1 << 22


def model_fingerprint(model_dir: Path, *, held: str, digests: Path | None) -> str:
    """A short id for what the KV of ``model_dir``'s model, held as
    ``held``, depends on; the weights' bytes are hashed (and their digests
    remembered in ``digests``) only when ``digests`` is given."""
    h = hashlib.sha256(_VERSION.encode())

    def part(name: str, value: bytes) -> None:
        h.update(f"{name}:{len(value)}:".encode())
        h.update(value)

    part("held", held.encode())
    part("mlx-lm", _version("mlx-lm").encode())
    config = model_dir / "config.json"
    if config.is_file():
        part("config.json", config.read_bytes())
    tokenizer = model_dir / "tokenizer.json"
    if tokenizer.is_file():
        part("tokenizer.json", tokenizer.read_bytes())
    part("tokenizer_config.json", _without_template(model_dir / "tokenizer_config.json"))
    for path in sorted(model_dir.glob("*.safetensors")):
        if digests is None:
            part(path.name, str(path.stat().st_size).encode())
        else:
            part(path.name, weights_digest(path, digests).encode())
    return h.hexdigest()[:16]


def weights_digest(path: Path, digests: Path) -> str:
    """``path``'s sha256, read from ``digests`` when the file is unchanged
    since it was hashed (same size, mtime, ctime and inode), else hashed
    (streamed) and remembered there. A digest that cannot be remembered is
    only hashed again next time."""
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    resolved = str(path.resolve())
    record = digests / (hashlib.sha256(resolved.encode()).hexdigest()[:32] + ".json")
    with contextlib.suppress(OSError, ValueError):
        # A regular file of a few hundred bytes, or none (a FIFO would hang).
        known = json.loads(read_regular(record, 4096))
        if (
            isinstance(known, dict)
            and known.get("path") == resolved
            and known.get("stamp") == stamp
            and isinstance(digest := known.get("sha256"), str)
            and len(digest) == 64
        ):
            return digest
    started = time.perf_counter()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    took = time.perf_counter() - started
    log.info(
        "hashed %s: %d MiB in %.2f s (%.0f MB/s), remembered in %s",
        path.name,
        st.st_size >> 20,
        took,
        st.st_size / 1e6 / max(took, 1e-9),
        digests,
    )
    try:
        digests.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.stem}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": resolved, "stamp": stamp, "sha256": digest}))
        os.replace(tmp, record)
    except OSError as exc:
        log.warning("cannot remember the digest of %s in %s: %s", path.name, digests, exc)
    return digest


def _without_template(path: Path) -> bytes:
    """``tokenizer_config.json`` without its chat template, canonical;
    its raw bytes where it is not a JSON object."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return b""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(data, dict):
        return raw
    data.pop("chat_template", None)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"
