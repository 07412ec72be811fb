"""The artifact layout (quantstudy.paths): what the rules write is what the package finds again."""

from __future__ import annotations

from quantstudy import paths

VARIANT = {"study": "fnet", "target": "cpu-torch", "model": "fnet-base", "setting": "w64", "variant": "fp8"}


def test_a_repeat_names_its_job_and_back():
    names = [paths.TIMING.format(**VARIANT, repeat=paths.repeat_suffix(r)) for r in (1, 2, 12)]
    assert [n.rsplit("/", 1)[1] for n in names] == ["timing.json", "timing-r2.json", "timing-r12.json"]
    assert [paths.repeat_number(paths.repeat_suffix(r)) for r in (1, 2, 12)] == [1, 2, 12]


def test_layout_gives_back_the_variant_and_the_setting_of_a_file():
    assert paths.variant_of(paths.QUALITY.format(**VARIANT, repeat="-r3")) == {k: VARIANT[k] for k in paths.VARIANT_FIELDS}
    assert paths.setting_of(paths.GEMM.format(**VARIANT)) == ("cpu-torch", "fnet-base", "w64")


def test_an_engine_folder_leads_back_to_its_build():
    build = paths.BUILD.format(**VARIANT)
    assert str(paths.build_of_engine(paths.graph_dir(build, "main"))) == build
    assert str(paths.beside(build, paths.MEASUREMENTS)) == paths.MEASUREMENTS.format(**VARIANT)


def test_glob_finds_a_pattern_in_a_copied_results_folder(tmp_path):
    wanted = []
    for study, repeat in (("fnet", ""), ("fnet", "-r2"), ("timm_xcit", "")):
        path = tmp_path / paths.TIMING.format(**{**VARIANT, "study": study}, repeat=repeat).removeprefix("results/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
        wanted.append(path)
    (tmp_path / "fnet" / "other.json").write_text("{}")
    assert paths.glob(tmp_path, paths.TIMING) == sorted(wanted)
    assert paths.glob(tmp_path, paths.TIMING, study="fnet") == sorted(wanted[:2])
