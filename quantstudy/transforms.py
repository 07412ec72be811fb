"""A variant's transforms: a precision plus a list of transforms, applied to a family's graph module
(apply_variant). The generic ones:
  fp8             replace the recipe's linear layers by FP8Linear (static per-tensor scales);
                  `include` / `exclude` patterns narrow the recipe, `add` patterns extend it,
                  `keep_edge_blocks: N` keeps the layers of the first and last N blocks in the
                  work precision
  fp32_dequantize the FP8 layers dequantize to fp32 instead of the recipe's dtype
  widen_scales    activation scales widened by `factor` (amax x factor)
  microscaling    the recipe's layers (narrowed as fp8's are) fake-quantized to a block-scaled `format`,
                  nvfp4 or mxfp8 (MicroscaledLinear): quality anywhere, no speed before Blackwell
A family adds its own (FNet: `hidden_scaling`), as fn(model, params) -> summary entries. The layers
themselves are in quantization.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from quantstudy.quantization import DTYPES, MICROSCALING_BLOCK, FP8Linear, MicroscaledLinear, linear_names, select
from quantstudy.study_values import BLACKWELL, Target

TRANSFORMS = {"fp8", "fp32_dequantize", "widen_scales", "microscaling"}  # generic; families add their own


def _block_index(name: str) -> int | None:
    """The block a layer belongs to: the first numeric component of its name (`encoder.layer.3.…`)."""
    return next((int(p) for p in name.split(".") if p.isdigit()), None)


def fp8_layers(model_layers: list[str], recipe: dict[str, Any], params: dict[str, Any],
               outlier_layers: list[str]) -> list[str]:
    """The layers a variant's fp8 transform quantizes: recipe (or its own include) plus its `add`,
    minus excludes, edge blocks and outliers."""
    # `add`: patterns on top of the recipe's (or the variant's own `include`), without repeating them.
    chosen = select(model_layers, [*params.get("include", recipe["quantize"]), *params.get("add", [])],
                    params.get("exclude", []))
    edge = int(params.get("keep_edge_blocks", 0))
    if edge:
        blocks = sorted({b for b in map(_block_index, model_layers) if b is not None})
        kept = set(blocks[:edge] + blocks[-edge:])
        chosen = [n for n in chosen if _block_index(n) not in kept]
    return [n for n in chosen if n not in outlier_layers]


def transform_names(family_transforms: dict[str, Callable] | None = None) -> set[str]:
    return TRANSFORMS | set(family_transforms or {})


def _microscale(model: nn.Module, params: dict[str, Any], recipe: dict[str, Any], amax_doc: dict[str, Any] | None,
                work: torch.dtype, with_fp8: bool) -> dict[str, Any]:
    """The microscaling transform: the recipe's layers (fp8_layers, with the transform's include / exclude /
    add) replaced by MicroscaledLinear in `params["format"]`."""
    if with_fp8:
        raise ValueError("a variant quantizes its layers by fp8 or by microscaling, not both")
    if amax_doc is None:
        raise ValueError("the microscaling transform needs an amax file (NVFP4's per-tensor activation scale)")
    fmt = params.get("format")
    layers = fp8_layers(linear_names(model), recipe, params, amax_doc["outliers"]["layers"])
    if not layers:
        raise ValueError("the microscaling transform selects no layer")
    block = MICROSCALING_BLOCK.get(fmt)
    uneven = [f"{n} ({model.get_submodule(n).in_features})" for n in layers
              if block and model.get_submodule(n).in_features % block]
    if uneven:  # raised, so that the build records it as this variant's failure
        raise ValueError(f"{fmt} scales blocks of {block} along a layer's input width, which these layers' widths "
                         f"are no multiple of: {', '.join(uneven)}")
    # A layer's declared extra call sites (linear_call) are microscaled too, but for those the recipe (or the
    # transform) keeps out, as for its FP8 layers.
    excluded = set(params.get("exclude_calls", recipe.get("exclude_calls", [])))
    unquantized = {}
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        parent, old = model.get_submodule(parent_name), model.get_submodule(name)
        sites = tuple(getattr(old, "call_sites", ()))
        if excluded & set(sites):
            unquantized[name] = sorted(excluded & set(sites))
        setattr(parent, child, MicroscaledLinear(old.weight.detach().float(), old.bias, fmt,
                                                 amax_doc["amax"][name]["input_amax"], work, sites, excluded & set(sites)))
    return {"microscaled_layers": sorted(layers), "microscaling_format": fmt,
            **({"unquantized_calls": unquantized} if unquantized else {})}


def refuse_block_scaled_engine(spec: dict[str, Any], target: Target) -> None:
    """A microscaled variant on a Blackwell target, where it is timed (`timed: blackwell`): no backend builds
    an NVFP4 or MXFP8 engine yet, and MicroscaledLinear's fake-quant would be timed as one. Raised, so that
    the build records it; elsewhere the variant builds as fake-quant, for its quality."""
    formats = [next(iter(t.values())).get("format") for t in spec["transforms"] if "microscaling" in t]
    if formats and target.gpu.lower() in BLACKWELL:
        raise NotImplementedError(
            f"no backend implements an {' / '.join(f.upper() for f in formats)} engine yet: target {target.name} "
            f"({target.gpu}, {target.backend}) would time ModelOpt's fake-quant (block-scaled round trips and a "
            f"{spec['precision']} GEMM), not the block-scaled tensor-core GEMMs a Blackwell GPU runs")


def apply_variant(model: nn.Module, spec: dict[str, Any], recipe: dict[str, Any], amax_doc: dict[str, Any] | None,
                  family_transforms: dict[str, Callable[[nn.Module, dict], dict]] | None = None
                  ) -> tuple[nn.Module, dict[str, Any]]:
    """Turn an fp32 graph module into a variant (precision + transforms). Returns the model and a summary."""
    work = DTYPES[spec["precision"]]
    transforms = [(next(iter(t)), next(iter(t.values())) or {}) for t in spec["transforms"]]
    names = dict(transforms)
    family_transforms = family_transforms or {}
    unknown = sorted(set(names) - transform_names(family_transforms))
    if unknown:
        raise ValueError(f"unknown transform(s) {', '.join(unknown)}")
    summary: dict[str, Any] = {"precision": spec["precision"], "fp8_layers": []}
    fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    call_sites: dict[str, tuple[str, ...]] = {}
    excluded_calls: set[str] = set()
    if "fp8" in names:
        if amax_doc is None:
            raise ValueError("the fp8 transform needs an amax file")
        layers = fp8_layers(linear_names(model), recipe, names["fp8"], amax_doc["outliers"]["layers"])
        if not layers:
            raise ValueError("the fp8 transform selects no layer")
        modules = dict(model.named_modules())
        fp8_weights = {n: (modules[n].weight.detach().float().clone(),
                           None if modules[n].bias is None else modules[n].bias.detach().clone()) for n in layers}
        call_sites = {n: tuple(getattr(modules[n], "call_sites", ())) for n in layers}
        excluded_calls = set(names["fp8"].get("exclude_calls", recipe.get("exclude_calls", [])))
        declared = {s for m in modules.values() for s in getattr(m, "call_sites", ())}
        if excluded_calls - declared:
            raise ValueError(f"exclude_calls names {', '.join(sorted(excluded_calls - declared))}, which no layer "
                             f"declares; declared call sites: {', '.join(sorted(declared)) or 'none'}")
    if "microscaling" in names:  # from the fp32 weights, before the cast
        summary.update(_microscale(model, names["microscaling"], recipe, amax_doc, work, "fp8" in names))
    model = model.to(work)
    dequant = torch.float32 if "fp32_dequantize" in names else DTYPES[recipe["dequantize_dtype"]]
    fp8_params = names.get("fp8") or {}
    granularity = (fp8_params.get("weight_scales", "per_tensor"), fp8_params.get("activation_scales", "static"))
    if granularity != ("per_tensor", "static"):
        summary["fp8_scales"] = {"weights": granularity[0], "activations": granularity[1]}
    widen = float(names.get("widen_scales", {}).get("factor", 1.0))
    for name, (weight, bias) in fp8_weights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        a = amax_doc["amax"][name]
        setattr(parent, child, FP8Linear(weight, bias, a["input_amax"] * widen, a["weight_amax"], dequant, work,
                                         call_sites[name], excluded_calls & set(call_sites[name]), *granularity))
    summary["fp8_layers"] = sorted(fp8_weights)
    unquantized = {n: sorted(excluded_calls & set(s)) for n, s in call_sites.items() if excluded_calls & set(s)}
    if unquantized:
        summary["unquantized_calls"] = unquantized
    summary["dequantize_dtype"] = str(dequant).removeprefix("torch.") if fp8_weights else None
    if "widen_scales" in names:
        summary["activation_scale_factor"] = widen
    for name, params in transforms:
        if name in family_transforms:
            summary.update(family_transforms[name](model, params))
    return model.eval(), summary
