"""benchmarks/detr_attention.py on the CPU: its formulations of the deformable attention compute
Transformers' MultiScaleDeformableAttention, samples outside the map included, and the script
measures one formulation end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("detr_attention", ROOT / "benchmarks" / "detr_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["detr_attention"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("formulation", ["weighted-stack", "level-sum", "gather"])
def test_formulation_computes_transformers_attention(bench, formulation):
    from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention

    g = torch.Generator().manual_seed(0)
    shapes = [(7, 9), (4, 5), (2, 3)]
    batch, heads, dim, points = 2, 3, 4, 2
    queries = 11
    value = torch.randn(batch, sum(h * w for h, w in shapes), heads, dim, generator=g)
    # Locations from -0.3 to 1.3 of the map: about a third of the samples are partly or wholly outside.
    locations = torch.rand(batch, queries, heads, len(shapes), points, 2, generator=g) * 1.6 - 0.3
    weights = torch.softmax(torch.randn(batch, queries, heads, len(shapes) * points, generator=g), -1)
    weights = weights.view(batch, queries, heads, len(shapes), points)
    spatial = torch.tensor(shapes)
    start = torch.cat((spatial.new_zeros(1), spatial.prod(1).cumsum(0)[:-1]))
    args = (value, spatial, shapes, start, locations, weights, 64)
    expected = MultiScaleDeformableAttention()(*args)
    got = bench.ATTENTION[formulation]()(*args)
    assert got.shape == expected.shape == (batch, queries, heads * dim)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got - expected).abs().max()
    if formulation == "weighted-stack":  # the same products, summed in the same order
        assert torch.equal(got, expected)
    # The check can fail: a sample one pixel off does not pass it.
    shifted = bench.ATTENTION[formulation]()(value, spatial, shapes, start, locations + 0.5 / 9, weights, 64)
    assert not torch.allclose(shifted, expected, rtol=1e-5, atol=1e-6)


def test_level_shapes_are_the_engines(bench):
    # ResNet-50's strides 8, 16, 32 and one more stride-2 convolution, each rounding up.
    assert bench.level_shapes(bench.hf_config(), 800, 1067) == [(100, 134), (50, 67), (25, 34), (13, 17)]


def test_measures_one_formulation_on_cpu(bench, tmp_path):
    out = tmp_path / "out.json"
    bench.main(["--device", "cpu", "--sizes", "130x170", "--formulations", "level-sum", "--compiles", "1",
                "--warmup", "1", "--rounds", "2", "--calls", "1", "--work", str(tmp_path / "work"), "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["size"], row["formulation"], row["compile"]) == ("130x170", "level-sum", 1)
    assert row["levels"] == [[17, 22], [9, 11], [5, 6], [3, 3]]
    assert row["finite"] and row["rel_l2_vs_fp32"] < 1e-5
    assert len(row["timing"]["samples_ms"]) == 2 and row["timing"]["median_ms"] > 0
    assert row["profile"]["top_kernels"]
