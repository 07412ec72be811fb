"""ModelOpt's calibration for FP8: the static amax of every linear layer's input and weight, by max
calibration (the recipe's, the write-ups' method) or by another method a variant names, and the
outlier rule over those amax values. A method that does not apply to FP8 raises NotApplicable."""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

import torch
from torch import nn


class NotApplicable(ValueError):
    """A calibration method that does not apply to FP8 layers (ModelOpt refuses or skips them): recorded as
    the calibration's failure, never replaced by another method."""


# ModelOpt's calibration methods for FP8 a variant may name (`calibration: {method: ..., <params>}`):
# - max: the largest |x| seen (FP8_DEFAULT_CFG's algorithm; the write-ups' method);
# - mse, local_hessian: ModelOpt's weight-scale searches (activations by max);
# - percentile, histogram_mse: activation amax from a histogram of |x| (percentile: `percentile`, default
#   99.99), weights by max;
# - entropy: the histogram's KL-optimal amax, which 0.47 computes for integer formats only;
# - smoothquant: per-channel smoothing with migration strength `alpha`, which 0.47 applies to int8 only.
CALIBRATION_METHODS = ("max", "mse", "local_hessian", "percentile", "histogram_mse", "entropy", "smoothquant")
HISTOGRAM_METHODS = {"percentile": "percentile", "histogram_mse": "mse", "entropy": "entropy"}


def calibrate(model: nn.Module, batches: list[dict[str, torch.Tensor]],
              progress: Callable[[int, int], None] | None = None,
              method: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """Static per-tensor amax of every linear layer's input and weight by a ModelOpt calibration method
    (CALIBRATION_METHODS; default max, FP8_DEFAULT_CFG's), for FP8. Raises NotApplicable for a method
    that 0.47 does not carry out on FP8 quantizers.

    Calibration collects statistics only, so calibrating all linears gives the recipe layers the
    same amax as enabling them alone; the recipe picks its layers from the result.
    """
    import copy

    import modelopt.torch.quantization as mtq

    spec = dict(method or {"method": "max"})
    name = spec.pop("method")
    if name not in CALIBRATION_METHODS:
        raise ValueError(f"calibration method {name!r} is not one of {', '.join(CALIBRATION_METHODS)}")

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                m(**batch)
                if progress:
                    progress(i + 1, len(batches))

    config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if name in HISTOGRAM_METHODS:
        _histogram_calibrate(model, config, forward_loop, HISTOGRAM_METHODS[name], spec)
    else:
        if name != "max":
            config["algorithm"] = {"method": name, **spec}
        mtq.quantize(model, config, forward_loop)
    if name == "smoothquant" and not any(getattr(m, "_amax_for_smoothing", None) is not None for m in model.modules()):
        raise NotApplicable("ModelOpt 0.47's smoothquant smooths int8 quantizers only: it skipped every FP8 layer "
                            "(\"Only int8 smoothing is supported\")")
    amax = {}
    for layer, module in model.named_modules():
        iq, wq = getattr(module, "input_quantizer", None), getattr(module, "weight_quantizer", None)
        if iq is None or wq is None or getattr(iq, "amax", None) is None or getattr(wq, "amax", None) is None:
            continue
        amax[layer] = {"input_amax": float(iq.amax.float().max()), "weight_amax": float(wq.amax.float().max())}
    return amax


def calibrate_method(model: nn.Module, batches: list[dict[str, torch.Tensor]], method: dict[str, Any],
                     progress: Callable[[int, int], None] | None = None
                     ) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """A variant's own method (`calibrate`) beside max calibration of the same module: its amax, and the
    layers whose input or weight amax it moved from max's. Raises NotApplicable where it moves none: 0.47's
    local_hessian, for one, calibrates no FP8 per-tensor weight, and a method that changes nothing is max."""
    import copy

    reference = calibrate(copy.deepcopy(model), batches)
    amax = calibrate(model, batches, progress, method)
    changed = {kind: sorted(n for n in amax if n in reference
                            and not math.isclose(amax[n][kind], reference[n][kind], rel_tol=1e-6))
               for kind in ("input_amax", "weight_amax")}
    if not any(changed.values()):
        raise NotApplicable(f"{method['method']} gives every layer max calibration's amax: ModelOpt 0.47 "
                            "calibrated nothing else with it on FP8 per-tensor quantizers")
    return amax, changed


def _histogram_calibrate(model: nn.Module, config: dict[str, Any], forward_loop: Callable[[nn.Module], None],
                         method: str, params: dict[str, Any]) -> None:
    """Activation amax from ModelOpt's histogram calibrator (`method`: percentile, mse or entropy), weights by
    max. 0.47's finish_stats_collection passes no method to a histogram calibrator but entropy's, so each
    quantizer loads its amax here, as that function does otherwise."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.model_calib import enable_stats_collection
    from modelopt.torch.quantization.nn import TensorQuantizer

    for entry in config["quant_cfg"]:
        if entry.get("quantizer_name") == "*input_quantizer":
            entry["cfg"] = {**entry["cfg"], "calibrator": "histogram"}
    config["algorithm"] = None  # quantizers inserted, nothing calibrated yet
    mtq.quantize(model, config, forward_loop=None)
    enable_stats_collection(model)
    forward_loop(model)
    for layer, quantizer in model.named_modules():
        if not isinstance(quantizer, TensorQuantizer) or quantizer._disabled:
            continue
        # an input's histogram calibrator by `method`; a weight's max calibrator as it is
        args, kwargs = ((method,), params) if layer.endswith("input_quantizer") else ((), {})
        try:  # as finish_stats_collection: a layer this graph never calls keeps no amax (not ModelOpt's NaN)
            if quantizer._calibrator.compute_amax(*args, **kwargs) is not None:
                quantizer.load_calib_amax(*args, **kwargs)
        except TypeError as e:  # the histogram's bins come from an integer num_bits; FP8's is (4, 3)
            raise NotApplicable(f"ModelOpt 0.47's histogram calibrator computes {method} for integer formats only: "
                                f"on FP8 (num_bits {quantizer.num_bits}) it raised {type(e).__name__}: {e}") from e
        quantizer.enable_quant()
        quantizer.disable_calib()


def outliers(amax: dict[str, dict[str, float]], layers: list[str], ratio: float) -> dict[str, Any]:
    """The outlier rule: a scale above `ratio` x the median of its kind (input or weight) stays fp16."""
    report: dict[str, Any] = {"ratio": ratio, "largest_ratio": {}, "layers": []}
    for kind in ("input_amax", "weight_amax"):
        values = [amax[n][kind] for n in layers]
        median = statistics.median(values) if values else 0.0
        ratios = {n: (amax[n][kind] / median if median > 0 else 0.0) for n in layers}
        report["largest_ratio"][kind] = max(ratios.values(), default=0.0)
        report["layers"] += [n for n, r in ratios.items() if r > ratio and n not in report["layers"]]
    return report
