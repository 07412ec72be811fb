"""Deformable DETR's encoder attention, one formulation at a time, on one GPU (issue 11).

At 800 x 800 the project's Deformable DETR engine is 5% slower than plain Transformers, and
at 800 x 1067 it is 25% faster (results/h200-torch-vs-plain/). In all four engines the encoder's
deformable attention ends in one persistent-reduction kernel (softmax, weighted sum over levels
and points, part of the sampling), and that kernel is either fast or slow. This script measures
one real-size encoder layer (random weights, fp16; the workflow's Runner, so torch.compile and
CUDA-graph replay; the workflow's interleaved timing) with each formulation of the attention:

- `transformers`: Transformers' MultiScaleDeformableAttention, no mask;
- `transformers-masked`: the same with an all-ones mask as a layer input (plain torch's model);
- `weighted-stack`: the project's engine: each level's samples weighted before the levels are
  stacked (`quantstudy.families.deformable_detr_model.WeightedStackAttention`), so the stack feeds only
  the sum;
- `level-sum`: each level's samples weighted and summed over points on their own, the levels
  added in fp32 (no stack of all levels' samples);
- `gather`: bilinear sampling written out as indexed loads, channels innermost (no grid_sample).

Each formulation compiles `--compiles` times afresh, each time with an empty inductor cache
under --work (the kernels' source and autotuning choice stay there), so a reader sees whether a
slow kernel belongs to the graph or to the compile. Each output is checked against the fp32
layer; each compile is profiled kernel by kernel.

    python benchmarks/detr_attention.py --out OUT.json > OUT.md   # on a GPU; --device cpu to try

Under `timeout -s INT` a run cut short still prints the rows it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from quantstudy import artifacts, metrics, timing as qt  # noqa: E402
from quantstudy import families as family_registry  # noqa: E402
from quantstudy.backends import torch_backend  # noqa: E402
from quantstudy.families import deformable_detr_model as detr  # noqa: E402

ARCHITECTURE = ROOT / "config" / "architectures" / "deformable-detr.json"
FORMULATIONS = ["transformers", "transformers-masked", "weighted-stack", "level-sum", "gather"]


class LevelSumAttention(nn.Module):
    """MultiScaleDeformableAttention's math, each level's samples weighted and summed over the
    points on their own and the levels added in fp32, instead of one stack of all samples."""

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                sampling_locations, attention_weights, im2col_step=None):
        batch, _, heads, dim = value.shape
        _, queries, _, levels, points, _ = sampling_locations.shape
        weights = attention_weights.transpose(1, 2).reshape(batch * heads, 1, queries, levels, points)
        out = None
        for level, sampled in enumerate(detr.level_samples(value, value_spatial_shapes_list, sampling_locations)):
            part = (sampled * weights[..., level, :]).sum(-1, dtype=torch.float32)  # [batch*heads, dim, queries]
            out = part if out is None else out + part
        return out.to(value.dtype).view(batch, heads * dim, queries).transpose(1, 2).contiguous()


class GatherAttention(nn.Module):
    """MultiScaleDeformableAttention's math with bilinear sampling (zero padding, align_corners
    false) written as four indexed loads per sample, each of a head's channels at once."""

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                sampling_locations, attention_weights, im2col_step=None):
        batch, _, heads, dim = value.shape
        _, queries, _, levels, points, _ = sampling_locations.shape
        b = torch.arange(batch, device=value.device).view(batch, 1, 1, 1)
        head = torch.arange(heads, device=value.device).view(1, 1, heads, 1)
        out = torch.zeros(batch, queries, heads, dim, device=value.device, dtype=torch.float32)
        start = 0
        for level, (h, w) in enumerate(value_spatial_shapes_list):
            loc = sampling_locations[:, :, :, level].float()  # [batch, queries, heads, points, 2]
            x, y = loc[..., 0] * w - 0.5, loc[..., 1] * h - 0.5
            x0, y0 = x.floor(), y.floor()
            fx, fy = x - x0, y - y0
            attn = attention_weights[:, :, :, level].float()
            for dx, dy, corner in ((0, 0, (1 - fx) * (1 - fy)), (1, 0, fx * (1 - fy)),
                                   (0, 1, (1 - fx) * fy), (1, 1, fx * fy)):
                xi, yi = x0 + dx, y0 + dy
                inside = (xi >= 0) & (xi <= w - 1) & (yi >= 0) & (yi <= h - 1)
                index = start + (yi.clamp(0, h - 1) * w + xi.clamp(0, w - 1)).long()
                sampled = value[b, index, head]  # [batch, queries, heads, points, dim]
                out = out + (sampled.float() * (corner * inside * attn)[..., None]).sum(-2)
            start += h * w
        return out.to(value.dtype).reshape(batch, queries, heads * dim)


ATTENTION = {"weighted-stack": detr.WeightedStackAttention, "level-sum": LevelSumAttention, "gather": GatherAttention}


def hf_config():
    return family_registry.get("deformable_detr").hf_config_without_timm(json.loads(ARCHITECTURE.read_text()))


def level_shapes(cfg, height: int, width: int) -> list[tuple[int, int]]:
    """The engine's feature-level sizes at an image size: its own `_levels` on the meta device."""
    from transformers import DeformableDetrForObjectDetection

    with torch.device("meta"):
        engine = detr.DetectorEngine(DeformableDetrForObjectDetection(cfg))
        return [tuple(s.shape[-2:]) for s in engine._levels(torch.empty(1, 3, height, width))]


class EncoderLayer(nn.Module):
    """One Transformers encoder layer as the project's engine calls it: the engine's reference
    points, level shapes and start indices; an attention mask only where one is given."""

    def __init__(self, layer: nn.Module, shapes: list[tuple[int, int]]):
        super().__init__()
        self.layer, self.shapes = layer, shapes
        points, spatial_shapes, level_start = detr.encoder_geometry(shapes, 1, "cpu", torch.float32)
        self.register_buffer("points", points.contiguous())
        self.register_buffer("spatial_shapes", spatial_shapes)
        self.register_buffer("level_start", level_start)

    def forward(self, hidden: torch.Tensor, position: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.layer(hidden, attention_mask, spatial_position_embeddings=position,
                         reference_points=self.points.to(hidden.dtype), spatial_shapes=self.spatial_shapes,
                         spatial_shapes_list=self.shapes, level_start_index=self.level_start)
        return {"hidden": out}


def build(cfg, shapes, formulation: str, dtype: torch.dtype, device: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The seeded layer with this formulation's attention, and its inputs (seeded too)."""
    from transformers.models.deformable_detr.modeling_deformable_detr import DeformableDetrEncoderLayer

    torch.manual_seed(0)
    layer = DeformableDetrEncoderLayer(cfg)
    # Sampling offsets as the trained model's spread them (Transformers initializes them to 0
    # in _init_weights, not in the constructor): some samples fall outside the map.
    nn.init.normal_(layer.self_attn.sampling_offsets.weight, std=0.02)
    if formulation in ATTENTION:
        layer.self_attn.attn = ATTENTION[formulation]()
    model = EncoderLayer(layer, shapes).to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)
    tokens = sum(h * w for h, w in shapes)
    inputs = {"hidden": torch.randn(1, tokens, cfg.d_model, generator=g),
              "position": torch.randn(1, tokens, cfg.d_model, generator=g)}
    if formulation == "transformers-masked":
        inputs["attention_mask"] = torch.ones(1, tokens, dtype=torch.bool)
    return model, {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def best_configs(cache: Path, names: list[str]) -> dict[str, Any]:
    """The autotuning choice of each named kernel, from the `.best_config` beside its source."""
    found = {}
    for source in cache.rglob("*.py"):
        text = source.read_text(errors="replace")
        for name in names:
            if f"def {name}(" in text and source.with_suffix(".best_config").exists():
                found[name] = json.loads(source.with_suffix(".best_config").read_text())
    return found


def fp32_reference(cfg, shapes: list[tuple[int, int]], device: str) -> torch.Tensor:
    """The layer's output with Transformers' attention in fp32, eager: what every formulation computes."""
    model, inputs = build(cfg, shapes, "transformers", torch.float32, device)
    with torch.no_grad():
        return model(**inputs)["hidden"]


def measure(cfg, size: str, shapes: list[tuple[int, int]], reference: torch.Tensor, formulation: str,
            compiles: int, device: str, work: Path, timing: dict[str, int], say):
    """Each fresh compile's row, as it is measured."""
    fam = family_registry.get("deformable_detr")
    # fp16 as in the engines; fp32 on a CPU, where grid_sample in fp16 on a strided input returns
    # NaN at random (torch 2.14).
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    for n in range(1, compiles + 1):
        cache = work / "inductor" / f"{size}-{formulation}-{n}"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # empty: a fresh compile and autotune
        torch._dynamo.reset()
        model, inputs = build(cfg, shapes, formulation, dtype, device)
        started = time.perf_counter()
        runner = torch_backend.Runner(model, inputs, device, compile=True)
        open_s = time.perf_counter() - started
        out = runner(inputs)["hidden"]
        times = qt.time_interleaved({"layer": runner}, **timing)["layer"]
        profile = qt.kernel_profile(runner, 5, fam.kernel_group, set())
        top = [k["name"] for k in profile["top_kernels"][:6]]
        row = {"size": size, "levels": shapes, "formulation": formulation, "compile": n,
               "open_s": round(open_s, 2), "timing": times, "finite": bool(torch.isfinite(out).all()),
               "rel_l2_vs_fp32": float(metrics.relative_l2(reference.reshape(1, -1), out.float().reshape(1, -1))), "profile": profile,
               "best_configs": best_configs(cache, top)}
        say(f"{size} {formulation} compile {n}: {times['median_ms']:.4f} ms, open {open_s:.1f} s, "
            f"rel. L2 {row['rel_l2_vs_fp32']:.2e}")
        del runner, model
        yield row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| size | formulation | compile | layer ms | GridSample ms | elementwise ms | top kernel (ms) | rel. L2 vs fp32 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        groups, top = r["profile"]["groups_ms"], r["profile"]["top_kernels"][0]
        lines.append(f"| {r['size']} | {r['formulation']} | {r['compile']} | {r['timing']['median_ms']:.4f} | "
                     f"{groups.get('GridSample', 0.0):.4f} | {groups.get('normalization and elementwise', 0.0):.4f} | "
                     f"`{top['name'][:60]}` ({top['ms']:.4f}) | {r['rel_l2_vs_fp32']:.2e} |")
    return "\n".join(lines)


def kernels(rows: list[dict[str, Any]], top: int = 6) -> str:
    out = []
    for r in rows:
        out += [f"\n{r['size']} {r['formulation']} compile {r['compile']}:\n", "| ms | count | kernel | autotuned config |",
                "|---|---|---|---|"]
        for k in r["profile"]["top_kernels"][:top]:
            config = r["best_configs"].get(k["name"], {})
            chosen = ", ".join(f"{key} {v}" for key, v in config.items()
                               if key in ("XBLOCK", "YBLOCK", "R0_BLOCK", "RBLOCK", "num_warps", "num_stages"))
            out.append(f"| {k['ms']:.4f} | {k['count']:g} | `{k['name']}` | {chosen} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["800x800", "800x1067"])
    parser.add_argument("--formulations", nargs="+", default=FORMULATIONS, choices=FORMULATIONS)
    parser.add_argument("--compiles", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--work", type=Path, default=Path("/tmp/detr-attention"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)

    cfg = hf_config()
    timing = {"warmup": args.warmup, "rounds": args.rounds, "calls": args.calls}
    doc = {"schema": "detr_attention", "rows": [], "params": {k: str(v) for k, v in vars(args).items()},
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    rows = doc["rows"]
    try:
        for size in args.sizes:
            shapes = level_shapes(cfg, *(int(v) for v in size.split("x")))
            reference = fp32_reference(cfg, shapes, args.device)
            for formulation in args.formulations:
                for row in measure(cfg, size, shapes, reference, formulation, args.compiles, args.device,
                                   args.work, timing, say):
                    rows.append(row)
                    if args.out:  # after every row: a run cut short keeps what it measured
                        artifacts.atomic_write(args.out, json.dumps(doc, indent=1, default=str) + "\n")
    except KeyboardInterrupt:  # `timeout -s INT`: print what was measured
        say(f"interrupted after {len(rows)} rows")
    print("## Deformable DETR encoder layer, by attention formulation\n")
    print(table(rows))
    print("\nTop kernels of each compile, kernel by kernel (no graph replay):")
    print(kernels(rows))
    return doc


if __name__ == "__main__":
    main()
