"""FP8 vs fp16 GEMM speed on this GPU, beside the model-level x of an evidence run.

    python benchmarks/fp8_gemm.py [--tables results/h200-torch/results/fnet/tables.json]

Times torch._scaled_mm (float8_e4m3fn inputs, per-tensor fp32 scales, fp16 output) against
torch.mm in fp16 (fp32 accumulation), each as a CUDA graph of 20 GEMMs, median of 9 interleaved
rounds: at 8192^3 and at FNet's feed-forward shapes, M = batch x window and (K, N) =
(768, 3072), (3072, 768) for fnet-base, (1024, 4096), (4096, 1024) for fnet-large. With
--tables, prints the model-level x (fp16 or fp16-hs time over FP8 time) of the same settings
next to the GEMM gain, so that the gap between the two is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

FNET = {"fnet-base": (768, 3072), "fnet-large": (1024, 4096)}
SETTINGS = {"fnet-base": [(1, 128), (1, 256), (1, 512), (8, 512)], "fnet-large": [(1, 256), (1, 512), (8, 512)]}


def _graph(fn, reps: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def gemm_ms(m: int, k: int, n: int, reps: int = 20, rounds: int = 9) -> dict[str, float]:
    """Median ms per GEMM of fp16 mm and FP8 _scaled_mm at [m, k] x [k, n], interleaved rounds."""
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    one = torch.ones((), device="cuda")
    a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    graphs = {"fp16": _graph(lambda: torch.mm(a, w.t()), reps),
              "fp8": _graph(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one,
                                                     out_dtype=torch.float16), reps)}
    samples = {name: [] for name in graphs}
    for r in range(rounds):
        for name in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graphs[name].replay()  # warm
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / reps)
    out = {name: statistics.median(s) for name, s in samples.items()}
    out["x"] = out["fp16"] / out["fp8"]
    out["fp8_tflops"] = 2 * m * k * n / out["fp8"] / 1e9
    out["fp16_tflops"] = 2 * m * k * n / out["fp16"] / 1e9
    return out


def model_x(tables: Path | None) -> dict[tuple[str, int, int], float]:
    """(model, batch, window) -> x of the candidate against its baseline, from tables.json."""
    if tables is None or not tables.exists():
        return {}
    t = json.loads(tables.read_text())
    cand = t["spec"]["candidate"]
    return {(r["model"], r["batch"], r["window"]): r["x"] for r in t["speed"]
            if r["variant"] == cand and r.get("status") == "ok" and r.get("x")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=Path, default=None, help="an evidence run's tables.json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("x = fp16 time / FP8 time; ms per GEMM, median of 9 interleaved rounds of 20 (CUDA graph)\n")
    r = gemm_ms(8192, 8192, 8192, reps=5)
    print(f"8192^3: fp16 {r['fp16']:.3f} ms ({r['fp16_tflops']:.0f} TFLOP/s), "
          f"FP8 {r['fp8']:.3f} ms ({r['fp8_tflops']:.0f} TFLOP/s), x {r['x']:.2f}\n")
    xs = model_x(args.tables)
    print("| Model | batch x window | M | GEMM K x N | fp16 ms | FP8 ms | GEMM x | both FF GEMMs x | model x |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, (hidden, inter) in FNET.items():
        for batch, window in SETTINGS[model]:
            m = batch * window
            up, down = gemm_ms(m, hidden, inter), gemm_ms(m, inter, hidden)
            both = (up["fp16"] + down["fp16"]) / (up["fp8"] + down["fp8"])
            mx = xs.get((model, batch, window))
            for i, (k, n, g) in enumerate([(hidden, inter, up), (inter, hidden, down)]):
                tail = f"{both:.2f} | {mx:.3f} |" if (i == 0 and mx) else (f"{both:.2f} | - |" if i == 0 else " | |")
                print(f"| {model} | {batch} x {window} | {m} | {k} x {n} | {g['fp16']:.4f} | {g['fp8']:.4f} | "
                      f"{g['x']:.2f} | {tail}")


if __name__ == "__main__":
    main()
