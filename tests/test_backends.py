"""Backend contract: every backend importable here computes what the fake-quant torch variant computes.

Parametrized over backends (torch on CPU, onnxruntime, tensorrt, torch-cuda); one that does not import here, or
needs a GPU that is not here, is skipped with the reason. The ONNX backends run the exported
graph (fp16 casts, FP8 Q/DQ), so a pass proves the graph TensorRT gets computes the recipe.
Tiny random-init FNet models (the embedded default's), window 128 for values, 512 for the
fp16 overflow (NaN) pattern.
"""

from __future__ import annotations

import copy
import dataclasses


import pytest
import torch

from quantstudy import backends, export, families, quantization, registry, timing, transforms
from quantstudy.families.base import Setting

from helpers import ON_GPU, backend_or_skip, observed_amax, reference_qdq, target_for, tiny_checkpoint

RECIPE = {"quantize": ["fnet.encoder.layer.*.intermediate.dense", "fnet.encoder.layer.*.output.dense"],
          "dequantize_dtype": "float16"}
FP8 = {"fp8": {}}
VARIANTS = {
    "fp32": {"precision": "float32", "transforms": []},
    "fp16": {"precision": "float16", "transforms": []},
    "fp16-hs": {"precision": "float16", "transforms": [{"hidden_scaling": {"factor": 64}}]},
    "fp8": {"precision": "float16", "transforms": [FP8]},
    "fp8-no-output-dense": {"precision": "float16", "transforms": [{"fp8": {"exclude": ["*.output.dense"]}}]},
    "fp8-fp32-dequantize": {"precision": "float16", "transforms": [FP8, {"fp32_dequantize": {}}]},
    # All of it in fp32 but the FP8 rounding: checks the Q/DQ math to float32 rounding (the
    # recipe's fp16 Dequantize is checked layer by layer in test_export).
    "fp32-fp8-fp32-dequantize": {"precision": "float32", "transforms": [FP8, {"fp32_dequantize": {}}]},
}
MODELS = {"fnet-base": ("tiny-fnet-base", {"seed": 0, "mixing_input_offset": 2.5}),
          "fnet-large": ("tiny-fnet-large", {"seed": 1, "mixing_input_offset": 2.5})}
WINDOW = 128
CASES = [(model, variant) for model in MODELS for variant in VARIANTS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny FNet checkpoints of the embedded default, written as files (loaded like real ones)."""
    fam = families.get("fnet")
    out = {}
    for model, (arch, tiny) in MODELS.items():
        out[model] = tiny_checkpoint(fam, arch, tmp_path_factory.mktemp(model), tiny)
    return out


class Case:
    """One variant of one tiny model at one window: its torch module, inputs and (lazily) its ONNX."""

    def __init__(self, checkpoint, model: str, variant: str, window: int, tmp):
        fam = families.get("fnet")
        self.checkpoint, self.spec, self.tmp = checkpoint, VARIANTS[variant], tmp
        self.setting = Setting(f"w{window}", 1, {"window": window})
        self.ids = fam.stress_inputs(fam.processor(checkpoint), window, 4, seed=0)["input_ids"]
        self.amax = observed_amax(fam.module(checkpoint, "main", self.setting), [{"input_ids": self.ids}])
        self.module = self.fresh()
        with torch.no_grad():
            self.expected = torch.cat([self.module(input_ids=self.ids[i:i + 1])["features"]
                                       for i in range(len(self.ids))]).float()
        self._onnx: dict[int, str] = {}

    def fresh(self) -> torch.nn.Module:
        fam = families.get("fnet")
        model = fam.module(self.checkpoint, "main", self.setting)
        return transforms.apply_variant(model, self.spec, RECIPE, self.amax, fam.transforms())[0]

    def onnx(self, batch: int = 1) -> str:
        """The variant exported at a static batch."""
        if batch not in self._onnx:
            self._onnx[batch] = export.export(self.fresh(), {"input_ids": self.ids[:batch]},
                                              self.tmp / f"onnx-b{batch}")["onnx"]
        return self._onnx[batch]


@pytest.fixture(scope="module")
def cases(checkpoints, tmp_path_factory):
    made = {}

    def get(model: str, variant: str, window: int = WINDOW) -> Case:
        key = (model, variant, window)
        if key not in made:
            made[key] = Case(checkpoints[model], model, variant, window, tmp_path_factory.mktemp(f"{model}-{variant}"))
        return made[key]
    return get


def _scrambled(module: torch.nn.Module) -> torch.nn.Module:
    """The module with every floating-point tensor of its state (what an engine file holds) replaced by
    noise: a skeleton that gives the right answer only once the engine file's weights are loaded into it.
    Non-persistent buffers (FNet's DFT matrices) come from the code, as in a real skeleton."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return module


def _run(name: str, case: Case, tmp, batch: int = 1) -> tuple[torch.Tensor, object]:
    """Build the case's engine on a backend at a static batch, open it, run all inputs through it."""
    backend = backend_or_skip(name)
    target = target_for(name)
    example = {"input_ids": case.ids[:batch]}
    if backend.builds_from == "onnx":
        info = backend.build(case.onnx(batch), tmp, target, backends.Shapes((example,)))
        runner = backend.open(tmp, example, target, None)
    else:
        info = backend.build(case.fresh(), tmp, target, backends.Shapes((example,)))
        runner = backend.open(tmp, example, target, _scrambled(case.fresh()))
    assert info["engine_bytes"] > 0
    return runner({"input_ids": case.ids})["features"].float().cpu(), runner


def _tolerance(name: str, spec: dict) -> float:
    """How far a backend may be from torch fake-quant.

    fp32 graphs: float32 rounding. fp16 graphs: ONNX Runtime's CPU kernels compute fp16 ops in
    fp32 (it inserts casts) where torch rounds each op to fp16; over two layers that is a few
    fp16 ulps of outputs of magnitude ~4 (measured max 0.025). The torch backend runs the very
    module, but the whole batch at once where the expected rows were computed one by one: CPU
    GEMMs may block a batch of 4 differently (measured on a 16-core H200 host: 5.3e-6 for fp32,
    0.004 where that moves an FP8 rounding), so it gets the same bounds, and is checked bit for
    bit at the expected rows' shape.
    """
    if name == "torch-cuda":  # cuBLAS / Triton accumulation order, and real FP8 GEMMs
        return 1e-3 if spec["precision"] == "float32" and not spec["transforms"] else 0.05
    if spec["precision"] == "float32":
        return 1e-4
    return 0.05


BACKENDS = ["torch", "onnxruntime", "tensorrt", "torch-cuda"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model,variant", CASES)
def test_backend_matches_torch_fake_quant(backend, model, variant, cases, tmp_path):
    case = cases(model, variant)
    got, runner = _run(backend, case, tmp_path)
    want = case.expected
    if backend == "torch":  # the very module: at the expected rows' shape (batch 1), bit for bit
        assert torch.equal(runner({"input_ids": case.ids[:1]})["features"].float(), want[:1])
    assert got.shape == want.shape
    assert torch.isfinite(want).all(), "at 128 tokens every variant of the tiny models is finite"
    diff = (got - want).abs()
    tol = _tolerance(backend, case.spec)
    print(f"{backend} {model} {variant}: max abs diff {diff.max().item():.3g} (tolerance {tol:g})")
    if case.spec["precision"] == "float32" and any("fp8" in t for t in case.spec["transforms"]):
        # A value on an FP8 rounding boundary may round the other way after float32 reordering
        # upstream (measured: 0.4% of the elements, repeated-token rows repeat a flip): allow
        # such flips, each bounded, and no more.
        assert (diff > tol).float().mean() < 1e-2, f"{variant}: too many elements beyond {tol}"
        assert diff.max() < 1e-2
    else:
        assert diff.max() <= tol, f"{backend} {model} {variant}: max abs diff {diff.max():.4g} > {tol}"


# Each FP8 variant's FP8 layers and dequantize dtype, read off VARIANTS and RECIPE by hand (the tiny
# models have two encoder layers): what apply_variant must give, for the backends to be compared with.
PROJECTIONS = [f"fnet.encoder.layer.{i}.{p}.dense" for i in range(2) for p in ("intermediate", "output")]
THE_RECIPE = {
    "fp8": (PROJECTIONS, torch.float16),
    "fp8-no-output-dense": ([n for n in PROJECTIONS if "intermediate" in n], torch.float16),
    "fp8-fp32-dequantize": (PROJECTIONS, torch.float32),
    "fp32-fp8-fp32-dequantize": (PROJECTIONS, torch.float32),
}


class ReferenceFP8Linear(torch.nn.Module):
    """An FP8 layer worked out apart from quantization.FP8Linear: input and weight through reference_qdq with
    scales amax / 448 rounded to the dequantize dtype, dequantized to it, the GEMM and bias in it."""

    def __init__(self, linear: torch.nn.Linear, amax: dict, dequantize: torch.dtype, work: torch.dtype):
        super().__init__()
        scale = lambda a: float(torch.tensor(a / 448).to(dequantize))  # noqa: E731
        self.input_scale, self.dequantize = scale(amax["input_amax"]), dequantize
        self.weight = reference_qdq(linear.weight.detach().float(), scale(amax["weight_amax"])).float().to(dequantize)
        self.bias = linear.bias.detach().to(work).to(dequantize)

    def forward(self, x):
        xq = reference_qdq(x, self.input_scale).float().to(self.dequantize)
        return torch.nn.functional.linear(xq, self.weight, self.bias).to(x.dtype)


@pytest.mark.parametrize("variant", sorted(THE_RECIPE))
def test_the_fake_quant_variants_are_the_recipe(variant, cases):
    """The backends are compared with apply_variant's module (case.expected): that module must be the recipe,
    or every backend agrees with a wrong variant. Against the fp32 module in the variant's precision with
    the hand-listed layers replaced by ReferenceFP8Linear: equal, bit for bit (one op order, one rounding)."""
    case = cases("fnet-base", variant)
    layers, dequantize = THE_RECIPE[variant]
    work = quantization.DTYPES[case.spec["precision"]]
    fp8 = [n for n, m in case.module.named_modules() if isinstance(m, quantization.FP8Linear)]
    assert sorted(fp8) == sorted(layers), f"{variant}: FP8 layers {sorted(fp8)}, the recipe's {sorted(layers)}"
    dtypes = {str(case.module.get_submodule(n).dequantize_dtype) for n in fp8}
    assert dtypes == {str(dequantize)}, f"{variant}: its FP8 layers dequantize to {dtypes}, the recipe's to {dequantize}"
    reference = families.get("fnet").module(case.checkpoint, "main", case.setting)
    fp32 = {n: copy.deepcopy(reference.get_submodule(n)) for n in layers}
    reference = reference.to(work)
    for name in layers:
        parent, _, child = name.rpartition(".")
        setattr(reference.get_submodule(parent), child, ReferenceFP8Linear(fp32[name], case.amax["amax"][name],
                                                                           dequantize, work))
    with torch.no_grad():
        want = torch.cat([reference.eval()(input_ids=case.ids[i:i + 1])["features"]
                          for i in range(len(case.ids))]).float()
    diff = (case.expected - want).abs().max().item()
    assert torch.equal(case.expected, want), f"{variant}: apply_variant's module is {diff:.3g} from the recipe's"


@pytest.mark.parametrize("backend", ["onnxruntime", "tensorrt"])
def test_fp8_graph_computes_fp8_not_fp32(backend, cases, tmp_path):
    """Discriminating: the graph with the recipe's Q/DQ is far closer to the FP8 recipe than to
    the same graph without them (in fp32 graphs, where fp16 rounding noise does not hide FP8's)."""
    fp8, fp32 = cases("fnet-base", "fp32-fp8-fp32-dequantize"), cases("fnet-base", "fp32")
    got, _ = _run(backend, fp8, tmp_path)
    to_recipe = (got - fp8.expected).abs().mean()
    to_fp32 = (got - fp32.expected).abs().mean()
    assert to_recipe * 100 < to_fp32, f"mean diff to the FP8 recipe {to_recipe:.3g}, to fp32 {to_fp32:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["fp16", "fp16-hs"])
def test_fp16_overflow_pattern_at_512(backend, variant, cases, tmp_path):
    """fp16 at 512 tokens overflows (NaN) on the tiny base model, as on the real ones; the 1/64
    probe removes it. Every backend must show the same non-finite rows as torch."""
    case = cases("fnet-base", variant, 512)
    got, _ = _run(backend, case, tmp_path)
    bad = lambda x: (~torch.isfinite(x)).flatten(1).any(1)
    assert bad(got).tolist() == bad(case.expected).tolist()
    assert bad(case.expected).any() == (variant == "fp16")


def test_onnxruntime_sessions_skip_the_qdq_fusion(tmp_path):
    """ONNX Runtime 1.30's QDQ fusion turns a float8 DQ -> MatMul into MatMulIntegerToFloat, which
    rejects float8, so the backend turns the fusion off by name. A uint8 DQ -> MatMul (one the fusion
    takes on any version) stays a MatMul in the backend's sessions: the name is the transformer's.
    The record says so."""
    import importlib

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    backend = backend_or_skip("onnxruntime")
    module = importlib.import_module("quantstudy.backends.onnxruntime_backend")
    import onnxruntime as ort

    z, s = numpy_helper.from_array(np.uint8(3), "z"), numpy_helper.from_array(np.float32(0.1), "s")
    w = numpy_helper.from_array(np.arange(12, dtype=np.uint8).reshape(4, 3), "w")
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["xd"]),
         helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wd"]),
         helper.make_node("MatMul", ["xd", "wd"], ["y"])],
        "uint8-dq-matmul", [helper.make_tensor_value_info("x", TensorProto.UINT8, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w, s, z])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "model.onnx")

    def optimized_ops(so) -> list[str]:
        so.optimized_model_filepath, so.log_severity_level = str(tmp_path / "optimized.onnx"), 3
        ort.InferenceSession(str(tmp_path / "model.onnx"), so, providers=module.PROVIDERS)
        return [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]

    assert "MatMulIntegerToFloat" in optimized_ops(ort.SessionOptions()), "the fusion no longer takes this graph"
    assert "MatMulIntegerToFloat" not in optimized_ops(module._session_options(target_for("onnxruntime").builder))
    assert backend.builder_options(target_for("onnxruntime"))["disabled_optimizers"] == ["QDQSelectorActionTransformer"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_interface(backend, cases, tmp_path):
    """replay/profile_call/synchronize/device, and a call with more rows than the static batch (chunked)."""
    case = cases("fnet-base", "fp8")
    _, runner = _run(backend, case, tmp_path)
    assert isinstance(runner, backends.Runner)  # the declared protocol, FP8 layer attributes included
    assert registry.missing_members(runner, backends.Runner) == []
    runner.replay()
    runner.profile_call()
    runner.synchronize()
    assert timing.fp8_proof(runner)["gemm"] in ("torch._scaled_mm", "fake-quant", "none")  # it profiles any runner
    assert runner.device.type == ("cuda" if backend in ON_GPU else "cpu")
    five = torch.cat([case.ids, case.ids[:1]])
    out = runner({"input_ids": five})["features"].float().cpu()
    assert out.shape[0] == 5
    assert torch.equal(out[4], out[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_static_batch_of_3_runs_5_rows_in_two_chunks(backend, cases, tmp_path):
    """An engine built at batch 3 runs 5 rows as 3 + 2 (the second chunk padded with its last row, the
    pad dropped): each row's output is its own, as the module computes it row by row."""
    case = cases("fnet-base", "fp8")
    five = torch.cat([case.ids, case.ids[:1]])
    _, runner = _run(backend, case, tmp_path, batch=3)
    out = runner({"input_ids": five})["features"].float().cpu()
    assert out.shape[0] == 5
    expected = torch.cat([case.expected, case.expected[:1]])
    assert (out - expected).abs().max() <= _tolerance(backend, case.spec)


@pytest.mark.parametrize("backend", ["onnxruntime", "tensorrt"])
def test_kernel_profile_groups(backend, cases, tmp_path):
    """The backend's own profiler puts the FP8 layers' nodes in the FP8 group, tells the two DFT
    stages apart by their operands' shapes (an exported graph keeps no regions), and accounts
    for its time."""
    case = cases("fnet-base", "fp8")
    _, runner = _run(backend, case, tmp_path)
    fam = families.get("fnet")
    result = backend_or_skip(backend).profile(runner, 2, lambda *a: fam.kernel_group(*a, setting=case.setting),
                                              {quantization.FP8_REGION})
    assert set(result["groups_ms"]) <= set(fam.kernel_groups)
    for group in ("FP8 feed-forward GEMMs", "sequence-axis DFT", "other GEMMs"):
        assert result["groups_ms"].get(group, 0) > 0, group
    assert result["total_ms"] == pytest.approx(sum(result["groups_ms"].values()))


def _tensorrt_module():
    """The TensorRT backend's module (its helpers besides the contract), or a skip saying why not."""
    import importlib

    backend_or_skip("tensorrt")
    return importlib.import_module("quantstudy.backends.tensorrt_backend")


def _no_shapes(case) -> backends.Shapes:
    return backends.Shapes(({"input_ids": case.ids[:1]},))


def test_tensorrt_reports_fp8_layers(cases, tmp_path):
    """The engine inspector finds every recipe layer running as an FP8 GEMM (no fp16 fallback)."""
    backend = _tensorrt_module()
    case = cases("fnet-base", "fp8")
    info = backend.build(case.onnx(), tmp_path, target_for("tensorrt"), _no_shapes(case))
    inspector = info["inspector"]
    assert inspector["recipe_fp8_layers"] == 4
    assert not inspector["fp8_fell_back"], inspector["fp8_fallback"]
    assert info["tensorrt"]["strongly_typed"]


def test_tensorrt_timing_cache_keeps_every_builds_tactics(cases, tmp_path):
    """Two builds that started from the same (empty) cache, saved one after the other: the file
    ends with the tactics of both, not only the last writer's."""
    backend = _tensorrt_module()
    files, sizes = {}, {}
    for variant in ("fp16", "fp8"):
        target = dataclasses.replace(target_for("tensorrt"), builder={"timing_cache_dir": str(tmp_path / variant)})
        case = cases("fnet-base", variant)
        backend.build(case.onnx(), tmp_path / f"engine-{variant}", target, _no_shapes(case))
        files[variant] = backend.timing_cache_path(target)
        sizes[variant] = files[variant].stat().st_size
    config = backend.trt.Builder(backend.LOGGER).create_builder_config()
    fp8_cache = config.create_timing_cache(files["fp8"].read_bytes())
    backend._save_timing_cache(config, fp8_cache, files["fp16"])  # the fp8 build saving second
    assert files["fp16"].stat().st_size > max(sizes.values())


def test_tensorrt_build_failure_carries_tensorrt_text(tmp_path):
    """A graph TensorRT rejects raises BuildError with the parser's own words."""
    backend = _tensorrt_module()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(backend.BuildError, match="could not parse"):
        backend.build(bad, tmp_path / "engine", target_for("tensorrt"), backends.Shapes(()))


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown backend"):
        backends.get("tflite")
    ok, why = backends.available("tensorrt")
    assert ok or why  # not importable here: the reason says why


def test_every_declared_backend_is_registered_and_implements_the_contract():
    """Each `<name>_backend` module registers a Backend under its own name that implements the declared
    protocol: what it builds from, builder options, build, open and profile. The ones that do not
    import here are listed with the reason, not silently left out."""
    declared = backends.names()
    assert {"torch", "onnxruntime", "tensorrt"} <= set(declared)
    report = []
    for name in declared:
        ok, why = backends.available(name)
        if not ok:
            report.append(f"{name}: does not import here ({why.splitlines()[0]})")
            continue
        backend = backends.get(name)
        assert isinstance(backend, backends.Backend), name
        assert backend.name == name and backend.builds_from in ("module", "onnx")
        report.append(f"{name}: builds from {backend.builds_from}; build, open, profile, builder_options")
    print("\n".join(report))
    assert backends.get("torch").builds_from == "module"


def test_a_backend_missing_part_of_the_contract_is_not_one():
    class NoProfile:
        name, builds_from = "x", "module"

        def builder_options(self, target): ...

        def build(self, source, out_dir, target, shapes): ...

        def open(self, out_dir, example, target, skeleton=None): ...

    assert not isinstance(NoProfile(), backends.Backend)


def test_a_pinned_backend_that_does_not_import_fails_instead_of_skipping(monkeypatch):
    """A broken install of a pinned library turns the suite red, not green with skips; TensorRT,
    which cannot be installed here, skips."""
    monkeypatch.setattr(backends, "available", lambda name: (False, f"No module named {name!r}"))
    with pytest.raises(pytest.fail.Exception, match="onnxruntime is pinned"):
        backend_or_skip("onnxruntime")
    with pytest.raises(pytest.skip.Exception, match="No module named 'tensorrt'"):
        backend_or_skip("tensorrt")
