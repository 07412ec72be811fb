"""Plain torch implementations of the studies' engines, the reference the torch backend is timed against
(quantstudy.torch_vs_plain). Each is the family's Transformers or timm model as it is, in fp16,
with the recipe's FP8 layers as a minimal FP8 linear (plain.fp8: torch._scaled_mm, static per-tensor
scales), the same weights and the same amax as the project's engine; no code of the project's graph
modules, variant transforms or backend. Per family:

- fnet: FNetModel's embeddings and layers; the Fourier block replaced by the sequence-axis DFT in
  fp32 as one GEMM of the stacked [cos; sin] matrix, then the hidden-axis DFT in fp16 as one GEMM
  (plain.fnet); the 1/64 hidden scaling where the variant has it.
- deberta_v2: DebertaV2Model's forward as Transformers writes it; positional products in fp16 where
  the recipe keeps them out of FP8 (plain.deberta_v2).
- timm_xcit: the timm Xcit model's forward (plain.timm_xcit).
- gpt_neo: GPTNeoForCausalLM's forward over Transformers' StaticCache, prefill and decode
  (plain.gpt_neo, which says where that is exact).
- deformable_detr: DeformableDetrForObjectDetection's forward as it is (plain.deformable_detr).

A family has a plain implementation when this package has a module of its name (`names()`), as a
backend is a `<name>_backend` module; the module is the implementation (`Implementation`, checked as
it loads by quantstudy.registry). Each module names the prefix its model puts before the project's
layer names (LAYER_PREFIX), so that the FP8 layers can be paired one by one. A plain
model is built from what the project's build of the variant says it computes (build.json: precision,
transforms, FP8 layers with their amax, dequantize dtype, calls kept out of FP8); a transform the
plain model does not implement is refused, not ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Protocol

from quantstudy import families, registry


class Implementation(Protocol):
    """What a plain module declares, as module attributes."""

    LAYER_PREFIX: str  # what its model puts before the project's layer names
    GRAPHS: Collection[str]  # the project graphs it has a plain model of
    EXTRA_TRANSFORMS: set[str]  # the variant transforms beside fp8 that it implements

    def model(self, checkpoint, setting, variant: "Variant", device: str, graph: str) -> Any:
        """The plain fp16 model of one graph: forward(**inputs) -> {output: tensor}."""


IMPLEMENTATIONS: registry.Registry[Implementation] = registry.Registry(
    "plain implementation", __name__, Implementation, helpers=("fp8",), modules=True)


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str
    params: dict[str, dict[str, Any]]  # transform -> its params
    fp8: dict[str, dict[str, float]]  # FP8 layer -> {input_amax, weight_amax}
    dequantize_dtype: str | None
    unquantized_calls: dict[str, list[str]]  # FP8 layer -> call sites kept in the work precision

    @classmethod
    def of_build(cls, doc: dict[str, Any]) -> "Variant":
        params = {next(iter(t)): next(iter(t.values())) or {} for t in doc["spec"]["transforms"]}
        amax = (doc.get("calibration") or {}).get("amax", {})
        return cls(doc["variant"], doc["spec"]["precision"], params, {n: amax[n] for n in doc["fp8_layers"]},
                   doc.get("dequantize_dtype"), doc.get("unquantized_calls", {}))


def names() -> list[str]:
    """The registered families with a plain implementation: a module of this package named after one."""
    return sorted(set(families.names()) & set(IMPLEMENTATIONS.declared()))


def _implementation(family: str) -> Implementation:
    if family not in names():
        raise KeyError(f"no plain implementation of {family!r}; there are {', '.join(names())}")
    return IMPLEMENTATIONS.get(family)


def layer_prefix(family: str) -> str:
    """What the plain model puts before the project's layer names (plain XCiT holds timm's model as
    `xcit`: its `xcit.blocks.0.attn.qkv` is the project's `blocks.0.attn.qkv`)."""
    return _implementation(family).LAYER_PREFIX


def model(family: str, checkpoint: str, setting, build_doc: dict[str, Any], device: str, graph: str = "main"):
    """The plain fp16 model of one graph of the variant that `build_doc` (a project build.json)
    describes: forward(**inputs) -> {output: tensor}, the project graph's inputs and outputs."""
    impl = _implementation(family)
    if graph not in impl.GRAPHS:
        raise KeyError(f"the plain {family} model has graphs {', '.join(impl.GRAPHS)}, not {graph!r}")
    variant = Variant.of_build(build_doc)
    if variant.precision != "float16":
        raise ValueError(f"{variant.name}: the plain models are fp16 engines, not {variant.precision}")
    unknown = sorted(set(variant.params) - {"fp8"} - impl.EXTRA_TRANSFORMS)
    if unknown:
        raise ValueError(f"{variant.name}: the plain {family} model does not implement {', '.join(unknown)}")
    return impl.model(checkpoint, setting, variant, device, graph)
