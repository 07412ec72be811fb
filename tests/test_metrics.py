"""Quality metrics on small cases whose answers are known by hand."""

from __future__ import annotations

import math

import pytest
import torch

from quantstudy import metrics as qm


def test_identical_logits_give_kl_zero_and_full_agreement():
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    m = qm.mlm_agreement(logits, logits.clone())
    assert m["kl_mean"] == 0.0 and m["kl_p99"] == 0.0 and m["top1_agreement"] == 1.0 and m["tokens"] == 20


def test_kl_of_two_known_distributions():
    ref = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    eng = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(PyTorch || engine)
    m = qm.mlm_agreement(ref, eng)
    assert abs(m["kl_mean"] - want) < 1e-12 and m["top1_agreement"] == 0.0


def test_nonfinite_rows_are_counted_and_left_out():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    eng = torch.tensor([[1.0, 0.0], [math.nan, 1.0]])
    m = qm.mlm_agreement(ref, eng)
    assert m["tokens"] == 1 and m["nonfinite_tokens"] == 1 and m["top1_agreement"] == 1.0
    assert qm.finite_rows(eng).tolist() == [True, False]


def test_cosine_and_relative_error_by_hand():
    ref = torch.tensor([[3.0, 4.0]])
    eng = torch.tensor([[3.0, 4.5]])  # |eng - ref| = 0.5, |ref| = 5
    c = qm.cls_agreement(ref, eng)
    assert abs(c["relative_error"] - 0.1) < 1e-12
    assert abs(c["cosine_mean"] - (9 + 18) / (5 * math.hypot(3, 4.5))) < 1e-12


def test_a_nan_row_fails_the_quality_bar():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    eng = torch.tensor([[1.0, 0.0], [math.nan, 1.0], [1.0, 1.03]])  # rel. error 0, inf, 0.03/sqrt(2)
    bar = qm.quality_bar(ref, eng, max_relative_l2=0.04)
    assert bar == {"max_relative_l2": 0.04, "sentences": 3, "passed": 2, "failed": 1}


def test_spearman_of_a_monotone_and_a_reversed_ranking():
    first = torch.tensor([[1.0, 0.0]] * 4)
    second = torch.tensor([[1.0, 0.0], [1.0, 0.5], [1.0, 1.0], [0.0, 1.0]])  # cosine falls row by row
    assert abs(qm.sts_spearman(first, second, [4, 3, 2, 1]) - 1.0) < 1e-12
    assert abs(qm.sts_spearman(first, second, [1, 2, 3, 4]) + 1.0) < 1e-12
    assert qm.sts_spearman(first, torch.full((4, 2), math.nan), [1, 2, 3, 4]) is None


# --- image classifiers ---------------------------------------------------------------------------

def test_top1_agreement_by_hand_and_a_nan_row_disagrees():
    ref = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # row 0: same top class (other values); row 1: another class; row 2: same; row 3: NaN, whose
    # argmax would be any class (torch picks the NaN's index, here 0, the reference's class).
    eng = torch.tensor([[5.0, 1.0, 2.0], [0.0, 0.0, 1.0], [0.0, -1.0, 3.0], [math.nan, 0.0, 0.0]])
    assert qm.top1_agreement(ref, eng) == {"top1_agreement": 0.5, "rows": 4, "disagree": 2}
    assert qm.top1_agreement(ref, ref.clone())["top1_agreement"] == 1.0


def test_logit_kl_by_hand_over_the_finite_rows():
    """p = (1/2, 1/2) against q = (3/4, 1/4): KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3); against
    itself 0; a NaN row is left out of the mean and of the interval's rows."""
    ref = torch.zeros(3, 2)
    eng = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0], [math.nan, 0.0]], dtype=torch.float64)
    m = qm.logit_kl(ref, eng)
    assert abs(m["kl_mean"] - 0.5 * math.log(4 / 3) / 2) < 1e-12
    interval = m["intervals"]["kl_mean"]
    assert interval["n"] == 2 and interval["unit"] == "images"
    assert interval["low"] <= m["kl_mean"] <= interval["high"]
    assert qm.logit_kl(ref, torch.full((3, 2), math.nan)) == {"kl_mean": None}


def test_top1_agreement_refuses_logits_of_another_shape():
    with pytest.raises(ValueError, match="differ in shape"):
        qm.top1_agreement(torch.zeros(3, 10), torch.zeros(3, 11))


def test_top1_accuracy_by_hand():
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [math.inf, 0.0]])
    labels = torch.tensor([1, 1, 1, 0])  # right, wrong, right, non-finite (wrong)
    assert qm.top1_accuracy(logits, labels) == 0.5
    assert qm.top1_accuracy(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)) is None


def test_nonfinite_rows_counts_nan_and_inf_rows_once():
    x = torch.zeros(5, 2, 3)
    x[1, 0, 0], x[3, 1, 2], x[3, 0, 1] = math.nan, math.inf, -math.inf
    assert qm.nonfinite_rows(x) == 2
    assert qm.nonfinite_rows(torch.ones(4, 7)) == 0

# --- token-feature encoders with a head check (DeBERTa) ------------------------------------------

def test_token_relative_error_counts_real_tokens_only():
    """Text 0: real token [3, 4] against [3, 4.5] (error 0.5 / 5 = 0.1); its padded position is far off
    and must not count. Text 1: equal on its two real tokens (error 0)."""
    ref = torch.tensor([[[3.0, 4.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 2.0]]])
    eng = torch.tensor([[[3.0, 4.5], [100.0, -100.0]], [[1.0, 0.0], [0.0, 2.0]]])
    mask = torch.tensor([[1, 0], [1, 1]])
    e = qm.token_relative_error(ref, eng, mask)
    assert abs(e["max"] - 0.1) < 1e-12 and abs(e["mean"] - 0.05) < 1e-12
    assert e["texts"] == 2 and e["nonfinite_texts"] == 0
    # Frobenius over the text, not a mean of per-token errors: tokens [3, 4] (error 0.5) and [0, 1] (exact).
    two = qm.token_relative_error(torch.tensor([[[3.0, 4.0], [0.0, 1.0]]]), torch.tensor([[[3.0, 4.5], [0.0, 1.0]]]),
                                  torch.tensor([[1, 1]]))
    assert abs(two["mean"] - 0.5 / math.sqrt(26)) < 1e-12


def test_token_relative_error_leaves_out_and_counts_nonfinite_texts():
    ref = torch.ones(3, 2, 2)
    eng = ref.clone()
    eng[0, 0, 0] = math.nan  # a real token: the text is non-finite
    eng[1, 1, 0] = math.inf  # padding: does not count
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    e = qm.token_relative_error(ref, eng, mask)
    assert {k: v for k, v in e.items() if k != "intervals"} == {"mean": 0.0, "max": 0.0, "texts": 2, "nonfinite_texts": 1}
    assert e["intervals"]["mean"]["n"] == 2 and e["intervals"]["mean"]["unit"] == "texts"  # the finite texts
    assert qm.real_rows_finite(eng, mask).tolist() == [False, True, True]
    assert qm.token_relative_error(ref[:1], eng[:1], mask[:1])["mean"] is None


def test_label_map_matches_names_not_indices():
    assert qm.label_map({0: "contradiction", 1: "Entailment", 2: "neutral"},
                        ["entailment", "neutral", "contradiction"]) == [2, 0, 1]
    assert qm.label_map({"0": "entailment", "1": "neutral", "2": "contradiction"},
                        ["entailment", "neutral", "contradiction"]) == [0, 1, 2]
    with pytest.raises(ValueError, match="not the dataset's"):
        qm.label_map({0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}, ["entailment", "neutral", "contradiction"])


def test_head_agreement_and_accuracy_difference_by_hand():
    """Head classes in another order than the dataset's labels (to_label [2, 0, 1]). PyTorch predicts
    head classes 1, 2, 0, 1 = labels 0, 1, 2, 0; the engine 1, 2, 1, 0 = labels 0, 1, 0, 2. Gold 0, 1, 0, 1:
    agreement 2/4; PyTorch accuracy 2/4, engine accuracy 3/4: +25 points."""
    onehot = lambda classes: torch.nn.functional.one_hot(torch.tensor(classes), 3).double()
    gold = torch.tensor([0, 1, 0, 1])
    h = qm.head_agreement(onehot([1, 2, 0, 1]), onehot([1, 2, 1, 0]), gold, [2, 0, 1])
    assert h["agreement"] == 0.5 and h["reference_accuracy"] == 0.5 and h["accuracy"] == 0.75
    assert abs(h["accuracy_diff_points"] - 25.0) < 1e-9 and h["pairs"] == 4 and h["nonfinite_pairs"] == 0


def test_a_nonfinite_pair_disagrees_and_is_wrong():
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    eng = torch.tensor([[2.0, 1.0, 0.0], [math.nan, 9.0, 0.0]])  # a NaN beside the right top class
    h = qm.head_agreement(ref, eng, torch.tensor([0, 1]), [0, 1, 2])
    assert h["agreement"] == 0.5 and h["accuracy"] == 0.5 and h["reference_accuracy"] == 1.0
    assert h["nonfinite_pairs"] == 1 and abs(h["accuracy_diff_points"] + 50.0) < 1e-9


def test_token_cosine_over_real_tokens():
    """Real tokens: [1, 0] vs [1, 1] (cosine 1/sqrt 2) and [0, 2] vs [0, 5] (1); the padded one, opposite, is left out."""
    ref = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [1.0, 0.0]]])
    eng = torch.tensor([[[1.0, 1.0], [0.0, 5.0], [-1.0, 0.0]]])
    c = qm.token_cosine(ref, eng, torch.tensor([[1, 1, 0]]))
    assert abs(c["min"] - 1 / math.sqrt(2)) < 1e-12 and abs(c["mean"] - (1 / math.sqrt(2) + 1) / 2) < 1e-12
    assert c["tokens"] == 2 and c["nonfinite_tokens"] == 0
    eng[0, 1, 0] = math.nan
    worst = qm.token_cosine(ref, eng, torch.tensor([[1, 1, 0]]))
    assert worst["min"] == -1.0 and worst["nonfinite_tokens"] == 1


# --- causal language models (GPT-Neo study) ---------------------------------------------------

def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    """Every token equally likely among 50: each target costs log 50, so perplexity is 50."""
    assert qm.perplexity(torch.zeros(7, 50), torch.arange(7)) == pytest.approx(50)


def test_perplexity_by_hand_and_none_on_a_nan_row():
    """Two tokens, the targets' probabilities 1/2 and 1/8: exp(-(ln 1/2 + ln 1/8) / 2) = sqrt(16) = 4."""
    logits = torch.log(torch.tensor([[0.5, 0.5, 1e-30], [0.125, 0.875, 1e-30]]))
    assert qm.perplexity(logits, torch.tensor([0, 0])) == pytest.approx(4)
    logits[1, 2] = float("nan")
    assert qm.perplexity(logits, torch.tensor([0, 0])) is None


def test_next_token_agreement_gives_kl_top1_and_the_engines_perplexity():
    """Reference (0.5, 0.5) and (0.9, 0.1); engine (0.5, 0.5) and (0.1, 0.9): KL 0 and 0.8 ln 9,
    one top-1 of two the same (the first row ties; argmax takes index 0 in both), perplexity of
    targets [0, 0] under the engine = 1 / sqrt(0.5 * 0.1)."""
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    eng = torch.log(torch.tensor([[0.5, 0.5], [0.1, 0.9]]))
    block = qm.next_token_agreement(ref, eng, torch.tensor([0, 0]))
    assert block["kl_mean"] == pytest.approx((0 + 0.8 * math.log(9)) / 2)
    assert block["top1_agreement"] == 0.5 and block["tokens"] == 2
    assert block["perplexity"] == pytest.approx(1 / math.sqrt(0.05))


def test_continuation_loglik_sums_the_choice_tokens_given_the_tokens_before():
    """Tokens [3, 1, 2], continuation [1, 3): log p(1 | row 0) + log p(2 | row 1), read from the logits
    of the position before each."""
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]])
    got = qm.continuation_loglik(torch.log(probs), torch.tensor([3, 1, 2]), 1, 3)
    assert got == pytest.approx(math.log(0.2) + math.log(0.4))
    with pytest.raises(ValueError, match="needs a context"):
        qm.continuation_loglik(torch.log(probs), torch.tensor([3, 1, 2]), 0, 2)


def test_multiple_choice_accuracy_ties_and_a_nonfinite_question():
    """Q1 picks choice 2 (right); Q2 ties choices 0 and 1 and takes the first (wrong, the answer is 1);
    Q3 has a NaN score: wrong, and counted. Against the reference's choices [2, 1, 0]: Q1 agrees only."""
    scores = [[-3.0, -2.0, -1.0], [-1.0, -1.0, -5.0], [float("nan"), -1.0, -2.0]]
    block = qm.multiple_choice(scores, [2, 1, 1], reference_choices=[2, 1, 0])
    assert block["accuracy"] == pytest.approx(1 / 3) and block["questions"] == 3
    assert block["nonfinite_questions"] == 1
    assert block["agreement_with_reference"] == pytest.approx(1 / 3)
    assert qm.chosen(scores) == [2, 0, -1]


# --- detectors (Deformable DETR study) -----------------------------------------------------------

IMAGES = [{"id": 1, "width": 100, "height": 100}, {"id": 2, "width": 100, "height": 100}]
CATEGORIES = [{"id": 1, "name": "cat"}, {"id": 3, "name": "dog"}]
TRUTH = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40], "area": 1600, "iscrowd": 0},
         {"image_id": 2, "category_id": 3, "bbox": [0, 0, 50, 50], "area": 2500, "iscrowd": 0}]


@pytest.mark.parametrize("evaluator", qm.COCO_EVALUATORS)
def test_coco_ap_of_known_cases_by_both_evaluators(evaluator):
    """Exact boxes: AP 1. The dog's box cut to 62% of its area (IoU 0.62): matched at IoU 0.50, 0.55 and
    0.60 of the ten thresholds, so AP = (1 + 3/10) / 2 over the two categories, AP50 = 1 and
    AP75 = 1/2. A right box with the wrong category is no match: AP 1/2 (the cat only). Nothing detected: 0."""
    exact = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9}
             for a in TRUTH]
    assert qm.coco_box_ap(IMAGES, TRUTH, exact, CATEGORIES, evaluator)["ap"] == pytest.approx(1.0)
    cut = [exact[0], {**exact[1], "bbox": [0, 0, 50, 31]}]
    got = qm.coco_box_ap(IMAGES, TRUTH, cut, CATEGORIES, evaluator)
    assert got["ap"] == pytest.approx((1 + 0.3) / 2) and got["ap50"] == pytest.approx(1.0)
    assert got["ap75"] == pytest.approx(0.5)
    wrong = [exact[0], {**exact[1], "category_id": 1}]
    assert qm.coco_box_ap(IMAGES, TRUTH, wrong, CATEGORIES, evaluator)["ap"] == pytest.approx(0.5)
    assert qm.coco_box_ap(IMAGES, TRUTH, [], CATEGORIES, evaluator)["ap"] == 0.0


def test_the_two_coco_evaluators_agree_on_a_scattered_case():
    """Seeded noisy detections over 20 images: faster-coco-eval and pycocotools give the same AP, AP50, AP75."""
    import random

    rng = random.Random(0)
    images = [{"id": i, "width": 200, "height": 150} for i in range(1, 21)]
    truth, found = [], []
    for img in images:
        for _ in range(rng.randint(1, 4)):
            x, y, w, h = rng.uniform(0, 120), rng.uniform(0, 90), rng.uniform(10, 70), rng.uniform(10, 50)
            truth.append({"image_id": img["id"], "category_id": rng.choice([1, 3]), "bbox": [x, y, w, h],
                          "area": w * h, "iscrowd": 0})
            if rng.random() < 0.8:
                jitter = [v + rng.uniform(-6, 6) for v in (x, y, w, h)]
                found.append({"image_id": img["id"], "category_id": truth[-1]["category_id"], "bbox": jitter,
                              "score": rng.random()})
    a, b = (qm.coco_box_ap(images, truth, found, CATEGORIES, e) for e in qm.COCO_EVALUATORS)
    assert 0.1 < a["ap"] < 0.9
    for k in ("ap", "ap50", "ap75"):
        assert a[k] == pytest.approx(b[k], abs=1e-9)


@pytest.mark.parametrize("box, fmt, problem", [
    ([10, 20, 30, 40], "xywh", None),             # ends at 40, 60 inside 50 x 80
    ([10, 20, 30, 40], "xyxy", None),             # ends at 30, 40
    ([30, 10, 25, 60], "xywh", "outside"),        # ends at x 55 > 50
    ([30, 10, 25, 60], "xyxy", "left of"),        # x_max 25 < x_min 30
    ([0, 0, 50.4, 80.4], "xyxy", None),           # within half a pixel of the border
    ([0, 0, 50, float("nan")], "xywh", "not finite")])
def test_box_problems_in_each_format(box, fmt, problem):
    """A 50 x 80 image: the same four numbers are a box in one format and not in the other."""
    got = qm.box_problems(box, 50, 80, fmt)
    assert (got is None) if problem is None else (problem in got)


def test_box_format_conversion_and_an_unknown_format():
    assert qm.to_xywh([10, 20, 30, 60], "xyxy") == [10, 20, 20, 40]
    assert qm.to_xywh([10, 20, 30, 60], "xywh") == [10, 20, 30, 60]
    with pytest.raises(ValueError, match="box_format is one of"):
        qm.box_problems([0, 0, 1, 1], 5, 5, "cxcywh")


def test_category_map_is_by_name_not_by_index():
    """COCO's head numbers person 1, car 3 (2 is bicycle, 12 is "N/A"); a dataset with its 80 names
    from 0 lists them in its own order. Case does not matter; a name the head lacks is an error."""
    head = {0: "N/A", 1: "person", 2: "bicycle", 3: "car", 12: "N/A", 13: "stop sign"}
    assert qm.category_map(head, ["car", "Person", "stop sign"]) == {0: 3, 1: 1, 2: 13}
    with pytest.raises(ValueError, match=r"\['zebra'\] are not labels of the detector"):
        qm.category_map(head, ["person", "zebra"])


def test_top_detections_take_the_best_query_label_pairs_in_pixels():
    """Two queries, three labels (label 0 is "N/A", never a detection). Query 1's label 2 scores
    highest; k = 3 keeps it, query 0's label 1 and query 1's label 1, in that order. A query's box
    [cx, cy, w, h] = [0.5, 0.5, 0.2, 0.4] of a 200 x 100 image is [80, 30, 40, 40] in pixels."""
    logits = torch.tensor([[9.0, 1.0, -2.0], [9.0, 0.5, 3.0]])
    boxes = torch.tensor([[0.25, 0.5, 0.5, 0.2], [0.5, 0.5, 0.2, 0.4]])
    got = qm.top_detections(logits, boxes, 200, 100, {1, 2}, k=3)
    assert [(d["category_id"], round(d["score"], 4)) for d in got] == [
        (2, round(1 / (1 + math.exp(-3)), 4)), (1, round(1 / (1 + math.exp(-1)), 4)),
        (1, round(1 / (1 + math.exp(-0.5)), 4))]
    assert got[0]["bbox"] == pytest.approx([80, 30, 40, 40])
    assert got[1]["bbox"] == pytest.approx([0, 40, 100, 20])


def test_detection_agreement_counts_matches_of_label_and_iou():
    """Reference: a cat at [0, 0, 10, 10] and a dog at [20, 20, 10, 10], both above the 0.5 score
    threshold, and a faint cat below it. Engine: the cat box shifted by 2 (IoU 64/136 = 0.47, no
    match at 0.5, a match at 0.4), the dog exact, and a bird nowhere in the reference. At IoU 0.5:
    1 of 3 engine detections matched (precision 1/3), 1 of 2 reference ones (recall 1/2)."""
    ref = [[{"category_id": 1, "bbox": [0, 0, 10, 10], "score": 0.9},
            {"category_id": 2, "bbox": [20, 20, 10, 10], "score": 0.8},
            {"category_id": 1, "bbox": [50, 50, 10, 10], "score": 0.2}]]
    eng = [[{"category_id": 1, "bbox": [2, 2, 10, 10], "score": 0.9},
            {"category_id": 2, "bbox": [20, 20, 10, 10], "score": 0.7},
            {"category_id": 3, "bbox": [0, 0, 10, 10], "score": 0.6}]]
    got = qm.detection_agreement(ref, eng, 0.5, 0.5)
    assert (got["precision"], got["recall"]) == (pytest.approx(1 / 3), pytest.approx(1 / 2))
    loose = qm.detection_agreement(ref, eng, 0.5, 0.4)
    assert (loose["precision"], loose["recall"]) == (pytest.approx(2 / 3), pytest.approx(1.0))
    # One reference detection matches one engine detection only: two engine copies of the dog, one match.
    twice = qm.detection_agreement(ref, [eng[0] + [eng[0][1]]], 0.5, 0.5)
    assert twice["matched"] == 1 and twice["precision"] == pytest.approx(1 / 4)
    assert qm.detection_agreement([[]], [[]], 0.5, 0.5)["precision"] is None


def test_detection_agreement_thresholds_are_at_least():
    """A detection scoring exactly the score threshold counts, on either side; a box overlapping its
    reference with IoU exactly the threshold matches: [0, 0, 10, 10] and [0, 0, 10, 5] share 50 of
    100 pixels, IoU 0.5 (binary fractions, so no rounding)."""
    ref = [[{"category_id": 1, "bbox": [0, 0, 10, 10], "score": 0.5}]]
    eng = [[{"category_id": 1, "bbox": [0, 0, 10, 5], "score": 0.5}]]
    assert qm.box_iou(ref[0][0]["bbox"], eng[0][0]["bbox"]) == 0.5
    got = qm.detection_agreement(ref, eng, 0.5, 0.5)
    assert (got["reference_detections"], got["engine_detections"], got["matched"]) == (1, 1, 1)
    assert (got["precision"], got["recall"]) == (1.0, 1.0)


def test_logit_correlation_of_known_cases():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert qm.logit_correlation(a, 2 * a + 5) == pytest.approx(1.0)
    assert qm.logit_correlation(a, -a) == pytest.approx(-1.0)
    # [1, 2, 3, 4] against [1, 2, 4, 3]: centred dot 4.0 over 5.0
    assert qm.logit_correlation(a, torch.tensor([[1.0, 2.0], [4.0, 3.0]])) == pytest.approx(0.8)
    assert qm.logit_correlation(a, torch.tensor([[1.0, float("nan")], [3.0, 4.0]])) is None


def test_cls_cosine_min_is_the_worst_row_and_the_mean_their_mean():
    """Three rows whose cosines with the reference are 1, 0 and 1/sqrt(2) (by hand): min 0, mean 0.569."""
    ref = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    eng = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    got = qm.cls_agreement(ref, eng)
    assert got["cosine_min"] == pytest.approx(0.0, abs=1e-12)
    assert got["cosine_mean"] == pytest.approx((1 + 0 + 1 / math.sqrt(2)) / 3)
    # relative L2 per row: |(1,0)| = 1, |(-1,3)| = sqrt(10), |(0,1)| = 1; their mean
    assert got["relative_error"] == pytest.approx((1 + math.sqrt(10) + 1) / 3) and got["rows"] == 3


def test_the_quality_bar_passes_a_row_exactly_at_its_limit_and_fails_one_just_above():
    """Relative L2 0.25 (by hand: (1, 0) against (1, 0.25)) is within a bar of 0.25, not of 0.2499."""
    ref, eng = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.25]])
    assert qm.quality_bar(ref, eng, max_relative_l2=0.25)["passed"] == 1
    assert qm.quality_bar(ref, eng, max_relative_l2=0.2499)["failed"] == 1


def test_a_perplexitys_interval_draws_whole_texts_and_is_the_exp_of_the_mean_nlls():
    """Two texts of two tokens each, the engine sure of text 0's targets (NLL about 0) and uniform over 4
    classes on text 1's (NLL log 4): drawing texts, a replicate's mean NLL is 0, log(4)/2 or log 4, so the 95%
    interval of perplexity is [1, 4] (exp of the ends). Drawing tokens alone would give the same ends, but
    `n` counts texts, 2."""
    logits = torch.tensor([[50.0, 0, 0, 0], [0, 50.0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    targets = torch.tensor([0, 1, 2, 3])
    out = qm.next_token_agreement(logits, logits, targets, torch.tensor([0, 0, 1, 1]), "chunks")
    p = out["intervals"]["perplexity"]
    assert (p["low"], p["n"], p["unit"]) == (pytest.approx(1.0), 2, "chunks") and p["high"] == pytest.approx(4.0)
    assert out["perplexity"] == pytest.approx(2.0)  # exp(log(4) / 2)
    kl = out["intervals"]["kl_mean"]
    assert (kl["low"], kl["high"], kl["n"]) == (0.0, 0.0, 2)  # the engine is the reference
