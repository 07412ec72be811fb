"""FP8 vs fp16 GEMM speed on one target, beside the model-level x of an evidence run.

    python benchmarks/fp8_gemm.py [--tables results/h200-torch/results/fnet/tables.json] [--device cuda]

A thin CLI over quantstudy.gemm.time_shapes, the timing the `gemm` rule runs for every target,
model and setting (gemm.json: g of the Amdahl bound rendered beside each x): fp16 linears against
the recipe's FP8Linear (on a GPU with FP8: quantize, then torch._scaled_mm with per-tensor scales;
on a CPU: fake-quant), built, opened and timed side by side by the torch backend (on CUDA compiled
and replayed as a CUDA graph), median of 9 interleaved rounds of 20 calls. At 8192^3 and at FNet's
feed-forward shapes: M = batch x window and (K, N) = (768, 3072), (3072, 768) for fnet-base,
(1024, 4096), (4096, 1024) for fnet-large, as many GEMMs a call as the model has layers. With
--tables, prints the model-level x (fp16 or fp16-hs time over FP8 time) of the same settings and
its Amdahl bound next to the GEMM gain, so that the gap between the two is visible.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from quantstudy import gemm

FNET = {"fnet-base": (768, 3072, 12), "fnet-large": (1024, 4096, 24)}  # hidden, intermediate, layers
SETTINGS = {"fnet-base": [(1, 128), (1, 256), (1, 512), (8, 512)], "fnet-large": [(1, 256), (1, 512), (8, 512)]}
TIMING = {"warmup": 5, "rounds": 9, "calls_per_round": 20}


def shape(batch: int, window: int, k: int, n: int) -> dict:
    """A GEMM call as the gemm rule records it: the layer's input [batch, window, K], K, N, bias."""
    return {"input_shape": [batch, window, k], "dims": [batch * window, k, n], "bias": True,
            "dequantize_dtype": "float16"}


def model_rows(tables: Path | None) -> dict[tuple[str, int, int], dict]:
    """(model, batch, window) -> the candidate's speed row (x and its bound), from tables.json."""
    if tables is None or not tables.exists():
        return {}
    t = json.loads(tables.read_text())
    cand = t["spec"]["candidate"]
    return {(r["model"], r["batch"], r["window"]): r for r in t["speed"]
            if r["variant"] == cand and r.get("status") == "ok" and r.get("x")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=Path, default=None, help="an evidence run's tables.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    target = {"backend": "torch", "device": args.device, "compile": args.device == "cuda"}
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("x = fp16 time / FP8 time; ms per GEMM, median of 9 interleaved rounds of 20 calls\n")
    r = gemm.time_shapes([(shape(1, 8192, 8192, 8192), 1, "float16")], target, TIMING)[0]
    flops = 2 * 8192 ** 3
    print(f"8192^3: fp16 {r['fp16_gemm_ms']:.3f} ms ({flops / r['fp16_gemm_ms'] / 1e9:.0f} TFLOP/s), FP8 "
          f"{r['fp8_gemm_ms']:.3f} ms ({flops / r['fp8_gemm_ms'] / 1e9:.0f} TFLOP/s), x {r['g']:.2f} ({r['fp8_gemm']})\n")
    rows = model_rows(args.tables)
    print("| Model | batch x window | M | GEMM K x N | fp16 ms | FP8 ms | GEMM x | both FF GEMMs x (g) | model x | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, (hidden, inter, layers) in FNET.items():
        for batch, window in SETTINGS[model]:
            up, down = gemm.time_shapes([(shape(batch, window, k, n), layers, "float16")
                                         for k, n in ((hidden, inter), (inter, hidden))], target, TIMING)
            both = (up["fp16_gemm_ms"] + down["fp16_gemm_ms"]) / (up["fp8_gemm_ms"] + down["fp8_gemm_ms"])
            row = rows.get((model, batch, window), {})
            for i, (k, n, g) in enumerate([(hidden, inter, up), (inter, hidden, down)]):
                tail = (f"{both:.2f} | {row['x']:.3f} | {row['bound']:.3f} |" if row.get("bound") else
                        f"{both:.2f} | {row['x']:.3f} | - |" if row else f"{both:.2f} | - | - |") if i == 0 else " | | |"
                print(f"| {model} | {batch} x {window} | {batch * window} | {k} x {n} | {g['fp16_gemm_ms']:.4f} | "
                      f"{g['fp8_gemm_ms']:.4f} | {g['g']:.2f} | {tail}")


if __name__ == "__main__":
    main()
