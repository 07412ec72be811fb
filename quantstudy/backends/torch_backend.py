"""PyTorch backend: the variant module itself is the engine.

On CPU, FP8 layers are fake-quant (float8_e4m3fn casts). On a GPU with FP8 (sm_89+) they are
real FP8 GEMMs (torch._scaled_mm, static per-tensor scales), and a target with `compile`
runs the module through torch.compile and times it by CUDA graph replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

ENGINE_FILE = "engine.safetensors"


def build(model: nn.Module, out_dir: str | Path) -> dict[str, Any]:
    """Save the variant's weights (FP8 weights stay float8_e4m3fn) as the engine file."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Tied weights (an LM head and its embedding) share memory, which safetensors refuses: each
    # tensor after the first of a shared storage is stored as a copy, and loads as its own tensor.
    state, seen = {}, set()
    for k, v in model.state_dict().items():
        ptr = v.untyped_storage().data_ptr()
        state[k] = v.contiguous().clone() if ptr in seen else v.contiguous()
        seen.add(ptr)
    tmp = out_dir / f".{ENGINE_FILE}.tmp"
    save_file(state, str(tmp))
    tmp.replace(out_dir / ENGINE_FILE)
    return {"engine": str(out_dir / ENGINE_FILE), "engine_bytes": (out_dir / ENGINE_FILE).stat().st_size,
            "weight_dtypes": sorted({str(v.dtype).removeprefix("torch.") for v in state.values()})}


def builder_options(target: dict[str, Any]) -> dict[str, Any]:
    """How this target runs a variant module: device, torch.compile, CUDA graph, and the FP8 GEMM path."""
    from quantstudy.quantization import fp8_gemm_supported

    device = target["device"]
    fp8 = ("real FP8 GEMMs: torch._scaled_mm with static per-tensor scales (a layer whose K or N is not a multiple "
           "of 16 stays fake-quant)" if fp8_gemm_supported(device) else
           "fake-quant: float8_e4m3fn round trip of weights and activations, GEMM in the work precision")
    return {"device": device, "torch_compile": bool(target.get("compile", False)),
            "cuda_graph": torch.device(device).type == "cuda", "fp8_path": fp8}


def load(skeleton: nn.Module, out_dir: str | Path, device: str = "cpu") -> nn.Module:
    """Fill a variant skeleton (same structure, any weights) with the engine file's weights.

    On a GPU with FP8 (sm_89+) its FP8 layers then run as real FP8 GEMMs (torch._scaled_mm).
    """
    from safetensors.torch import load_file

    from quantstudy.quantization import use_fp8_gemm

    state = load_file(str(Path(out_dir) / ENGINE_FILE), device=device)
    skeleton.load_state_dict(state, strict=True, assign=True)
    model = skeleton.to(device).eval()
    use_fp8_gemm(model, device)
    return model


def open(out_dir: str | Path, example: dict[str, torch.Tensor], target: dict[str, Any], skeleton: nn.Module) -> "Runner":
    """The engine in `out_dir` as a runner at the example inputs' shapes (the skeleton gives its structure)."""
    model = load(skeleton, out_dir, target["device"])
    return Runner(model, example, target["device"], target.get("compile", False))


class Runner:
    """Runs a graph module ({name: tensor} -> {name: tensor}) at fixed input shapes; on CUDA, by CUDA
    graph replay (compiled if asked).

    `fp8_layers` names its FP8 layers, `fp8_gemm` those that run real FP8 GEMMs (none on CPU, where
    they are fake-quant).
    """

    def __init__(self, model: nn.Module, example: dict[str, torch.Tensor], device: str = "cpu", compile: bool = False):
        from quantstudy.quantization import FP8Linear

        self.device = torch.device(device)
        self.model = self.eager = model
        self.fp8_layers = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
        self.fp8_gemm = [n for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.fp8_gemm]
        self.static_inputs = {k: v.to(self.device) for k, v in example.items()}
        self.graph = None
        if compile:
            self.model = torch.compile(model, dynamic=False)
        if self.device.type == "cuda":
            self._capture()

    @torch.no_grad()
    def _capture(self) -> None:
        from quantstudy.timing import device_lock

        with device_lock(self.device, shared=True):  # not while another job measures
            self._capture_graph()

    def _capture_graph(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up: compile, autotune, allocator
                self.model(**self.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_outputs = self.model(**self.static_inputs)
        torch.cuda.synchronize()

    @torch.no_grad()
    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.graph is not None and all(v.shape == self.static_inputs[k].shape for k, v in inputs.items()):
            for k, v in inputs.items():
                self.static_inputs[k].copy_(v.to(self.device))
            self.graph.replay()
            return {k: v.clone() for k, v in self.static_outputs.items()}
        # Other shapes (e.g. the batch-of-8 scan of a batch-1 engine) run eagerly: the same
        # math, no recompile. Inputs take the engine's dtypes (an fp16 variant's KV cache is fp16).
        return self.eager(**{k: v.to(self.device, self.static_inputs[k].dtype) for k, v in inputs.items()})

    def replay(self) -> None:
        """One timed call: graph replay (no data transfer) on CUDA, a plain forward on CPU."""
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.no_grad():
                self.model(**self.static_inputs)

    @torch.no_grad()
    def profile_call(self) -> None:
        """One profiled call: the same (compiled) forward launched kernel by kernel, not as a graph,
        so that the profiler links every kernel to the op that launched it. Kernel times are the
        graph's; only the launch gaps differ."""
        self.model(**self.static_inputs)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
