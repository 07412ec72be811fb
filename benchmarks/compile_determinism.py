"""Does every job that opens one torch engine get the same answer? (issue 27, build once; issue 24)

    python benchmarks/compile_determinism.py --work /tmp/cd [--opens 4] [--model detr-tiny]
        [--dtype float32] [--size 320] [--modes jobs inductor-benchmarks cudnn-free eager]

On a GPU: for each mode, build one engine with the workflow's own TorchBackend (a fresh process),
then open it in `--opens` fresh processes at once (as jobs open an engine side by side). Each prints
one JSON line: the cache artifacts it loaded by kind, the sha256 of its outputs on one seeded input,
whether 3 calls in the process gave the same bits, and its time per CUDA-graph replay (50 replays).

Modes, each with the process settings of a workflow job (steps.job_settings) and then:
  jobs                  nothing else (what the workflow runs)
  inductor-benchmarks   compiled without inductor's deterministic mode (torch_backend.INDUCTOR_OPTIONS
                        empty): inductor benchmarks choices that change numerics when a process first
                        runs the engine (the workflow until 2026-12-05)
  cudnn-free            that, and torch.backends.cudnn.deterministic off (the first Deformable DETR run)
  eager                 no torch.compile (the module itself, CUDA graph replay)
Models: `reductions`, a module whose column mean over 20000 rows is a split reduction (its configs
autotune at run time); `detr-tiny` and `detr`, the project's Deformable DETR engine
(families/deformable_detr_model.DetectorEngine) of config/architectures/tiny-deformable-detr.json or
deformable-detr.json, random weights (Transformers' ResNet in place of timm's), at --size x --size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROWS, WIDTH, KEYS, LAYERS = 20000, 256, 300, 8
MODES = ("jobs", "inductor-benchmarks", "cudnn-free", "eager")
ARGS = argparse.Namespace(model="reductions", dtype="float16", size=320, mode="jobs")


def _settings() -> None:
    """The process settings of a workflow job, then the mode's change."""
    import torch

    from quantstudy.steps import job_settings

    job_settings()
    if ARGS.mode in ("inductor-benchmarks", "cudnn-free"):
        from quantstudy.backends import torch_backend

        torch_backend.INDUCTOR_OPTIONS = {}
    if ARGS.mode == "cudnn-free":
        torch.backends.cudnn.deterministic = False


def _module():
    import torch
    from torch import nn

    torch.manual_seed(0)
    if ARGS.model.startswith("detr"):
        from transformers import DeformableDetrForObjectDetection

        from quantstudy.families.deformable_detr import DeformableDetr
        from quantstudy.families.deformable_detr_model import DetectorEngine

        name = "tiny-deformable-detr" if ARGS.model == "detr-tiny" else "deformable-detr"
        architecture = json.loads((Path(__file__).parents[1] / f"config/architectures/{name}.json").read_text())
        detector = DeformableDetrForObjectDetection(DeformableDetr().hf_config_without_timm(architecture)).eval()
        return DetectorEngine(detector).to(getattr(torch, ARGS.dtype)).cuda().eval()

    class Reductions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(LAYERS))
            self.linears = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

        def forward(self, x):
            for norm, linear in zip(self.norms, self.linears):
                x = x + linear(norm(x)).relu()
                keys = x[:, :KEYS]
                x = x + torch.softmax(x @ keys.transpose(1, 2) / 16, dim=-1) @ keys
                x = x - x.mean(dim=1, keepdim=True)  # over 20000 rows: a split reduction
            return {"out": x}

    return Reductions().to(getattr(torch, ARGS.dtype)).cuda().eval()


def _example():
    import torch

    g = torch.Generator().manual_seed(1)
    shape = (1, 3, ARGS.size, ARGS.size) if ARGS.model.startswith("detr") else (1, ROWS, WIDTH)
    name = "pixel_values" if ARGS.model.startswith("detr") else "x"
    return {name: torch.randn(*shape, generator=g).to(getattr(torch, ARGS.dtype)).cuda()}


def _target():
    return SimpleNamespace(compile=ARGS.mode != "eager", device="cuda", backend="torch")


def build(out: Path) -> None:
    from quantstudy.backends import Shapes
    from quantstudy.backends.torch_backend import TorchBackend

    _settings()
    info = TorchBackend().build(_module(), out, _target(), Shapes(examples=(_example(),)))
    print(json.dumps({"mode": ARGS.mode, "built": str(out), "compile_seconds": info.get("compile_seconds")}), flush=True)


def open_and_run(out: Path) -> None:
    import torch
    from torch.compiler._cache import CacheArtifactManager

    from quantstudy.backends.torch_backend import COMPILED_FILE, TorchBackend

    _settings()
    compiled = out / COMPILED_FILE
    loaded = CacheArtifactManager.deserialize(compiled.read_bytes()) if compiled.exists() else {}
    runner = TorchBackend.open(out, _example(), _target(), skeleton=_module())

    def answer() -> str:
        outputs = runner(_example())
        flat = torch.cat([outputs[k].float().flatten() for k in sorted(outputs)])
        return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()[:16]
    answers = [answer() for _ in range(3)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        runner.replay()
    end.record()
    torch.cuda.synchronize()
    print(json.dumps({"mode": ARGS.mode, "pid": os.getpid(), "outputs_sha256": answers[0],
                      "same_in_process": len(set(answers)) == 1,
                      "artifacts": {kind: len(items) for kind, items in (loaded or {}).items()},
                      "ms_per_replay": round(start.elapsed_time(end) / 50, 4)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--opens", type=int, default=4)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--model", choices=["reductions", "detr-tiny", "detr"], default="detr-tiny")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float32")
    parser.add_argument("--size", type=int, default=320)
    parser.add_argument("--role", choices=["build", "open"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    ARGS.__dict__.update(model=args.model, dtype=args.dtype, size=args.size, mode=args.mode)
    if args.role == "build":
        return build(args.work)
    if args.role == "open":
        return open_and_run(args.work)
    for mode in args.modes:
        out = args.work / mode
        me = [sys.executable, __file__, "--work", str(out), "--model", args.model, "--dtype", args.dtype,
              "--size", str(args.size), "--mode", mode]
        print(f"## {args.model} {args.dtype} {args.size} {mode}", flush=True)
        subprocess.run(me + ["--role", "build"], check=True)
        opens = [subprocess.Popen(me + ["--role", "open"]) for _ in range(args.opens)]
        if any(p.wait() for p in opens):
            sys.exit(f"{mode}: an open failed")


if __name__ == "__main__":
    main()
