"""GPT-Neo's ARC scoring at real size: scored on the CPU (outputs gathered there) or where the engine ran.

An evaluation of real-size GPT-Neo took about 420 s on an H100, almost all of it after the teacher-forced
chunks: ARC's 1,200 prefill rows brought 50,257-way logits and every K/V cache to the CPU and checked them
there. This times that loop both ways (steps_measure.batched_run with and without `on_device`) on the
fp16 prefill engine of the real-size architecture with random weights, and checks that both give the
same scores and non-finite count.

    python benchmarks/gpt_neo_arc.py [--rows 1200]      # on a CUDA GPU
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from quantstudy import steps, steps_measure
from quantstudy.backends.torch_backend import Runner
from quantstudy.config import load_architecture
from quantstudy.families import base, get
from quantstudy.families.gpt_neo_metrics import ARC_ROWS_PER_CALL, arc_scores

SETTING = base.Setting("p256-c256", 1, {"prefill": 256, "cache": 256})


def score(run, ids: torch.Tensor, starts: list[int], on_device: bool) -> tuple[list[float], int, float]:
    """The family's ARC loop (four-token choices): scores, non-finite rows and seconds."""
    started = time.perf_counter()
    scores, bad = arc_scores(run, ids, starts, [s + 4 for s in starts], on_device)
    return scores, bad, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1200, help="ARC rows (choices); the study has 1,200")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: on a CPU both ways are the same")
    steps.job_settings()
    fam = get("gpt_neo")
    arch = load_architecture("gpt-neo-125m")
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        for name, data in fam.tiny_checkpoint_files(arch, {"seed": 0}).items():
            (Path(folder) / name).write_bytes(data)
        module = fam.module(folder, "prefill", SETTING).half().cuda()
        example = fam.example_inputs(folder, "prefill", SETTING)
        run = steps_measure.batched_run({"prefill": Runner(module, example, "cuda")}, SETTING.batch)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, arch["vocab_size"], (args.rows, SETTING["prefill"]), generator=g)
        starts = torch.randint(64, SETTING["prefill"] - 4, (args.rows,), generator=g).tolist()
        score(run, ids[:ARC_ROWS_PER_CALL], starts, True)  # warm-up
        on_cpu, bad_cpu, s_cpu = score(run, ids, starts, False)
        on_gpu, bad_gpu, s_gpu = score(run, ids, starts, True)
    worst = max(abs(a - b) for a, b in zip(on_cpu, on_gpu))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"{args.rows} rows of {SETTING['prefill']} tokens, {ARC_ROWS_PER_CALL} rows a call")
    print(f"scored on the CPU:  {s_cpu:7.1f} s  non-finite rows {bad_cpu}")
    print(f"scored on the GPU:  {s_gpu:7.1f} s  non-finite rows {bad_gpu}")
    print(f"largest score difference: {worst:.3g} (log-likelihood, float64 over fp16 logits)")


if __name__ == "__main__":
    main()
