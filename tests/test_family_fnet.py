"""The FNet family (quantstudy/families/fnet.py) on the embedded default's tiny model: its masked-LM
agreement checked against an engine's own outputs, with the expected values computed here from
Transformers' FNetForPreTraining and the engine's features, not with the family's code."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from quantstudy import families, steps, transforms
from quantstudy.families.base import Setting

from helpers import assert_declares_its_quality_columns

FP16 = {"precision": "float16", "transforms": []}
SETTING = Setting("w128", 1, {"window": 128})


@pytest.fixture(scope="module")
def fam():
    return families.get("fnet")


@pytest.fixture(scope="module")
def evaluation_inputs(tiny_inputs, fam):
    """The tiny checkpoint's snapshot, the held-out and STS sample lists, and the reference on them."""
    study = tiny_inputs["study"]
    samples = {name: steps.read_samples(tiny_inputs["samples"][name], study.family) for name in ("heldout", "sts")}
    snapshot = json.loads(tiny_inputs["checkpoint"].read_text())["snapshot"]
    tensors, blocks = fam.reference(snapshot, samples, SETTING, study.metrics, study.seeds, "cpu")
    return {"snapshot": snapshot, "samples": samples, "reference": tensors, "reference_blocks": blocks, "study": study}


def test_masked_lm_agreement_is_that_of_the_engines_own_features(fam, evaluation_inputs):
    """The fp16 engine's features at the masked positions through the pretrained MLM head, against
    Transformers' own prediction logits on the masked passages: top-1 agreement and mean KL by hand."""
    from transformers import FNetForPreTraining

    snapshot, reference, study = evaluation_inputs["snapshot"], evaluation_inputs["reference"], evaluation_inputs["study"]
    engine = transforms.apply_variant(fam.module(snapshot, "main", SETTING), FP16, study.recipe.as_params(), {},
                                      fam.transforms())[0].eval()

    def run(inputs, what="", whole=False):
        with torch.no_grad():
            return {"features": torch.cat([engine(input_ids=inputs["input_ids"][i:i + 1])["features"]
                                           for i in range(inputs["input_ids"].shape[0])])}

    evaluation = fam.evaluate(snapshot, run, reference, evaluation_inputs["samples"], SETTING, study.metrics,
                              study.seeds, "cpu", {"fp16": run})
    assert_declares_its_quality_columns(fam, evaluation, evaluation_inputs["reference_blocks"], ["heldout", "sts"],
                                        ["fp16"])
    got = evaluation.blocks["mlm"]

    hf = FNetForPreTraining.from_pretrained(snapshot).eval()
    masked, positions = reference["masked_ids"].long(), reference["mask_positions"]
    with torch.no_grad():
        want_logits = hf(input_ids=masked).prediction_logits[positions[:, 0], positions[:, 1]].double()
        features = run({"input_ids": masked})["features"].float()[positions[:, 0], positions[:, 1]]
        engine_logits = hf.cls.predictions(features).double()
    top1 = (want_logits.argmax(-1) == engine_logits.argmax(-1)).double().mean().item()
    p_ref = F.softmax(want_logits, -1)
    kl = (p_ref * (F.log_softmax(want_logits, -1) - F.log_softmax(engine_logits, -1))).sum(-1).mean().item()
    assert got["tokens"] == len(positions) > 20
    assert got["top1_agreement"] == pytest.approx(top1, abs=1e-12) and 0 < top1 <= 1
    assert got["kl_mean"] == pytest.approx(kl, rel=1e-3) and kl > 0  # fp16 features move the distribution
