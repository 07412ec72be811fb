"""timm XCiT's samples: images read back from their WebDataset shards and checked against their
sha256, transformed and fed to an engine in whole batches; and the tar shards of the tiny dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import tarfile
from typing import Any

import torch

IMAGE_EXTENSIONS = ("webp", "png", "jpg", "jpeg")  # what clip_benchmark reads from a wds shard
EVAL_CHUNK = 64  # images decoded and run at a time: 1,500 images at 224 px are 900 MB as pixels


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tar_bytes(members: dict[str, bytes]) -> bytes:
    """A tar of the members in order, with fixed metadata, so the same members give the same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def image_column(row: dict[str, Any]) -> str:
    found = [e for e in IMAGE_EXTENSIONS if row.get(e) is not None]
    if not found:
        raise ValueError(f"timm_xcit: WebDataset sample {row.get('__key__')!r} has no image "
                         f"({', '.join(IMAGE_EXTENSIONS)})")
    return found[0]


def image_bytes(samples: list[dict[str, Any]]):
    """Each sample's image bytes as stored in its shard (each shard opened once), in order."""
    open_shards = {}
    try:
        for s in samples:
            if s["shard"] not in open_shards:
                open_shards[s["shard"]] = tarfile.open(s["shard"])
            yield open_shards[s["shard"]].extractfile(s["member"]).read()
    finally:
        for t in open_shards.values():
            t.close()


def load_images(samples: list[dict[str, Any]]) -> list:
    """The samples' images (RGB PIL), read from their shards and checked against their sha256."""
    from PIL import Image

    images = []
    with contextlib.closing(image_bytes(samples)) as blobs:  # shards closed also when a check fails
        for s, data in zip(samples, blobs):
            if sha256_hex(data) != s["sha256"]:
                raise ValueError(f"timm_xcit: {s['member']} in {s['shard']} does not have the sample's sha256 "
                                 f"{s['sha256']}: the dataset snapshot is not the one the samples were drawn from")
            images.append(Image.open(io.BytesIO(data)).convert("RGB"))
    return images


def pixel_values(transform, images: list) -> torch.Tensor:
    """[n, 3, H, W] float32: the checkpoint's eval transform (`processor`) of each image."""
    return torch.stack([transform(img) for img in images])


def whole_batches(x: torch.Tensor, batch: int) -> torch.Tensor:
    """`x` padded with copies of its first rows to a multiple of `batch` rows: a static engine takes
    one batch size. The caller cuts the padding's outputs off."""
    pad = -len(x) % batch
    return torch.cat([x, x[torch.arange(pad) % len(x)]]) if pad else x


def engine_logits(run, transform, samples: list[dict[str, Any]], batch: int, what: str) -> torch.Tensor:
    """[images, classes] float32 logits of `run` (an engine, or the reference as one) on the samples'
    images, decoded and transformed about EVAL_CHUNK at a time, in whole batches of `batch`."""
    chunk, outs = batch * -(-EVAL_CHUNK // batch), []
    for i in range(0, len(samples), chunk):
        x = pixel_values(transform, load_images(samples[i:i + chunk]))
        with torch.no_grad():
            out = run({"pixel_values": whole_batches(x, batch)}, f"{what} {i + len(x)}/{len(samples)}")
        outs.append(out["logits"][:len(x)].float().cpu())
    return torch.cat(outs)
