"""Build once, measure that build: a compiling torch target compiles in `build`, and every job opens that.

On the CPU with `compile: true` (inductor's C++ backend), on the tiny FNet FP8 variant: the build
writes the compiled program beside the weights, a fresh process opens it with every graph found in
it (no compile), and gets the very outputs the build's own compile gives; a shape the build did not
compile, or a compiled file that is not the build's, is refused with the build to rerun.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quantstudy import backends, config, families, steps, transforms
from quantstudy.backends import inductor_cache, torch_backend
from quantstudy.families.base import Setting

from helpers import ROOT, observed_amax, skip_without_gpu

RECIPE = {"quantize": ["fnet.encoder.layer.*.intermediate.dense", "fnet.encoder.layer.*.output.dense"],
          "dequantize_dtype": "float16"}
FP8 = {"precision": "float32", "transforms": [{"fp8": {}}]}
TARGET = config.Target(name="cpu-torch-compiled", backend="torch", device="cpu", compile=True)
CUDA_TARGET = dataclasses.replace(TARGET, name="cuda-torch-compiled", device="cuda")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny FNet checkpoint, its FP8 variant at window 32, batch 2, and a variant maker."""
    fam = families.get("fnet")
    folder = tmp_path_factory.mktemp("fnet")
    for name, data in fam.tiny_checkpoint_files(config.load_architecture("tiny-fnet-base"),
                                                {"seed": 0, "mixing_input_offset": 2.5}).items():
        (folder / name).write_bytes(data)
    setting = Setting("b2-w32", 2, {"window": 32})
    ids = fam.stress_inputs(fam.processor(folder), 32, 3, seed=0)["input_ids"]
    amax = observed_amax(fam.module(folder, "main", setting), [{"input_ids": ids}])

    def variant():
        return transforms.apply_variant(fam.module(folder, "main", setting), FP8, RECIPE, amax, fam.transforms())[0]
    return {"variant": variant, "ids": ids, "example": {"input_ids": ids[:2]}}


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """The compiled engine, and what the build's own compiled program gives on three rows. Here and in
    the opening process, the process settings every workflow job sets (steps.job_settings: one
    intra-op thread on a CPU host, TF32 off): inductor's code, and so its cache key, depends on them."""
    steps.job_settings()
    out = tmp_path_factory.mktemp("engine")
    info = backends.get("torch").build(tiny["variant"](), out, TARGET, backends.Shapes((tiny["example"],)))
    runner = torch_backend.Runner(torch_backend.load(tiny["variant"](), out), tiny["example"], compile=True)
    return {"dir": out, "info": info, "outputs": runner({"input_ids": tiny["ids"]})["features"]}


def _open_in_a_fresh_process(engine_dir, example_rows: int, tmp_path, opens: int = 1, target: str = "TARGET") -> dict:
    """Open the engine in a new interpreter (nothing compiled in memory), as a measurement job does, on
    `target` (this module's TARGET or CUDA_TARGET)."""
    script = textwrap.dedent(f"""
        import json, logging, sys, torch
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_compiled_engine import RECIPE, FP8, {target} as TARGET
        from quantstudy import backends, config, families, quantization, transforms
        from quantstudy.families.base import Setting
        from helpers import observed_amax
        logging.basicConfig(level=logging.INFO)
        from quantstudy import steps
        steps.job_settings()
        fam = families.get("fnet")
        folder = {str(engine_dir.parent / 'checkpoint')!r}
        setting = Setting("b2-w32", 2, {{"window": 32}})
        ids = torch.load({str(tmp_path / 'ids.pt')!r}, weights_only=True)
        amax = json.load(open({str(tmp_path / 'amax.json')!r}))
        example = {{"input_ids": ids[:{example_rows}]}}
        opened = []
        for _ in range({opens}):  # a job may open two engines (an evaluation against another engine)
            skeleton = transforms.apply_variant(fam.module(folder, "main", setting), FP8, RECIPE, amax,
                                                fam.transforms())[0]
            try:
                runner = backends.get("torch").open({str(engine_dir)!r}, example, TARGET, skeleton)
            except Exception as e:
                print(json.dumps({{"error": f"{{type(e).__name__}}: {{e}}"}}))
                sys.exit(0)
            opened.append({{"open_seconds": runner.open_seconds, "open_phases": runner.open_phases,
                           "open_redone": runner.open_redone}})
        torch.save(runner({{"input_ids": ids}})["features"], {str(tmp_path / 'out.pt')!r})
        print(json.dumps({{**opened[0], "opened": opened}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


@pytest.fixture(scope="module")
def opened_elsewhere(tiny, built, tmp_path_factory):
    """The checkpoint, inputs and amax where a fresh process can read them (beside the engine)."""
    tmp = tmp_path_factory.mktemp("fresh")
    fam = families.get("fnet")
    ckpt = built["dir"].parent / "checkpoint"
    ckpt.mkdir(exist_ok=True)
    for name, data in fam.tiny_checkpoint_files(config.load_architecture("tiny-fnet-base"),
                                                {"seed": 0, "mixing_input_offset": 2.5}).items():
        (ckpt / name).write_bytes(data)
    torch.save(tiny["ids"], tmp / "ids.pt")
    setting = Setting("b2-w32", 2, {"window": 32})
    (tmp / "amax.json").write_text(json.dumps(observed_amax(fam.module(ckpt, "main", setting),
                                                            [{"input_ids": tiny["ids"]}])))
    return tmp


def test_the_build_writes_its_compiled_program(built):
    info = built["info"]
    assert info["compiled"].endswith(torch_backend.COMPILED_FILE) and info["compiled_bytes"] > 0
    # What the program holds: one compiled graph (one shape); no Triton configs on a CPU.
    held = info["compiled_artifacts"]
    assert held["inductor"] == 1 and "autotune" not in held, held
    assert info["shapes"] == [{"input_ids": [2, 32]}]


def test_a_fresh_process_opens_it_without_compiling_and_runs_the_same_program(built, opened_elsewhere):
    result = _open_in_a_fresh_process(built["dir"], 2, opened_elsewhere)
    assert "error" not in result, result
    assert "0 misses" in result["log"] and result["open_seconds"] > 0
    assert f"from {torch_backend.COMPILED_FILE} (artifacts: 1 aot_autograd, 1 inductor; " in result["log"]
    # Three rows on a batch-2 engine: two calls, the second padded; the build's own program gives the same bits.
    assert torch.equal(torch.load(opened_elsewhere / "out.pt", weights_only=True), built["outputs"])


def test_opening_says_where_its_seconds_went(built, opened_elsewhere):
    """An opening is split into its parts: loading the weights and the compiled artifacts, dynamo's
    trace, the compiler loading the graphs from those artifacts, the first calls beyond those,
    CUDA-graph capture and waiting for the device (none on a CPU). Apart: the work it redid, C++
    compiled (on a CPU, inductor's kernels: the artifacts hold their source) and Triton configs
    benchmarked (none on a CPU). dynamo's timers are summed over the process: a second opening in
    one job (which reuses the first one's trace here) has only its own share."""
    result = _open_in_a_fresh_process(built["dir"], 2, opened_elsewhere, opens=2)
    assert "error" not in result, result
    for one in result["opened"]:
        phases, total = one["open_phases"], one["open_seconds"]
        assert list(phases) == ["weights", "artifacts", "trace", "compiler", "calls", "capture", "waiting"]
        assert phases["capture"] == phases["waiting"] == 0 and min(phases.values()) >= 0, phases
        assert 0.8 * total <= sum(phases.values()) <= total, (phases, total)
        assert list(one["open_redone"]) == ["compiling", "autotuning"] and one["open_redone"]["autotuning"] == 0
    first, second = result["opened"]
    assert all(first["open_phases"][k] > 0 for k in ("weights", "artifacts", "trace", "compiler")), first
    assert first["open_redone"]["compiling"] > 0 and second["open_redone"]["compiling"] == 0
    assert result["log"].count("; weights ") == 2 and "; of which compiling " in result["log"]


def test_an_opening_puts_the_autotune_choices_where_the_build_compiled(built, tmp_path):
    """A compiled Triton kernel (a GPU's; a CPU has none) looks up the build's autotune choice beside
    its own path in the folder the build compiled in: an opening copies each choice it loaded there."""
    compiled_in = inductor_cache.build_folder(built["dir"])
    assert any(compiled_in.rglob("*.py")), "the build compiled elsewhere"
    assert (compiled_in / "engine").read_text() == str(built["dir"].resolve())
    loaded = tmp_path / "opened"
    (loaded / "ab").mkdir(parents=True)
    (loaded / "ab" / "k.best_config").write_text('{"XBLOCK": 128}')
    inductor_cache.place_autotune_choices(loaded, built["dir"])
    assert (compiled_in / "ab" / "k.best_config").read_text() == '{"XBLOCK": 128}'


def test_a_build_removes_the_build_folders_of_engines_that_are_gone(tmp_path):
    for name in ("kept", "gone", "unnamed", "another"):
        (tmp_path / name).mkdir()  # a build makes its engine's folder first
    kept, gone, unnamed = (inductor_cache.new_build_folder(tmp_path / name) for name in ("kept", "gone", "unnamed"))
    (unnamed / "engine").unlink()  # as a folder an opening on another node made: it names no engine
    (tmp_path / "unnamed").rmdir()
    inductor_cache.new_build_folder(tmp_path / "another")
    assert kept.is_dir() and gone.is_dir() and unnamed.is_dir()
    (tmp_path / "gone").rmdir()
    inductor_cache.new_build_folder(tmp_path / "another")
    assert kept.is_dir() and not gone.exists() and unnamed.is_dir()
    for folder in (kept, unnamed, inductor_cache.build_folder(tmp_path / "another")):
        shutil.rmtree(folder)


@pytest.mark.gpu
def test_a_gpu_opening_benchmarks_no_triton_config_again(tiny, built, opened_elsewhere):
    """On a GPU the build benchmarks its Triton kernels' configs once, and its compiled program holds
    the choices (autotune artifacts): an opening in a fresh process compiles and benchmarks nothing
    (an opening that does fails its job's audit)."""
    if not torch.cuda.is_available():
        skip_without_gpu("needs a CUDA GPU")
    out = built["dir"].parent / "engine-cuda"  # beside the checkpoint the opening process reads
    info = backends.get("torch").build(tiny["variant"](), out, CUDA_TARGET, backends.Shapes((tiny["example"],)))
    result = _open_in_a_fresh_process(out, 2, opened_elsewhere, target="CUDA_TARGET")
    assert "error" not in result, result
    assert result["open_redone"] == {"compiling": 0.0, "autotuning": 0.0}, (info["compiled_artifacts"],
                                                                           result["log"][-3000:])


def test_a_shape_the_build_did_not_compile_is_refused(built, opened_elsewhere):
    result = _open_in_a_fresh_process(built["dir"], 1, opened_elsewhere)  # batch 1: not built
    assert result.get("error", "").startswith("NotBuilt:"), result
    assert f"rerun it: snakemake --force {built['dir'].parent / 'build.json'}" in result["error"]


class _TwoGraphs(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x) + 1
        torch._dynamo.graph_break()
        return {"features": y.sum(0)}


def test_every_graph_of_a_compiled_engine_is_compiled_in_inductor_deterministic_mode():
    """Without inductor's deterministic mode, jobs that open one build on a GPU benchmark choices that
    change numerics when they first run it, and disagree (torch_backend.INDUCTOR_OPTIONS). The mode must
    hold for every graph of an engine: set in torch._inductor.config, torch.compile turns it off again."""
    modes = []
    # config.patch, not monkeypatch: deleting a config attribute (monkeypatch's undo) hides it for good.
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: modes.append(
            torch._inductor.config.deterministic)):
        torch.compiler.reset()
        torch_backend.Runner(_TwoGraphs(), {"x": torch.randn(8, 4)}, compile=True)
    assert modes == [True, True]
    assert backends.get("torch").builder_options(TARGET)["inductor_options"] == {"deterministic": True}


def test_an_engine_built_without_compiling_is_refused(tiny, tmp_path):
    backends.get("torch").build(tiny["variant"](), tmp_path, dataclasses.replace(TARGET, compile=False),
                                backends.Shapes((tiny["example"],)))
    with pytest.raises(torch_backend.NotBuilt, match="without compiling"):
        backends.get("torch").open(tmp_path, tiny["example"], TARGET, tiny["variant"]())


def test_a_runner_refuses_a_shape_it_was_not_built_for(tiny, tmp_path):
    backends.get("torch").build(tiny["variant"](), tmp_path, dataclasses.replace(TARGET, compile=False),
                                backends.Shapes((tiny["example"],)))
    runner = backends.get("torch").open(tmp_path, tiny["example"], dataclasses.replace(TARGET, compile=False),
                                        tiny["variant"]())
    with pytest.raises(ValueError, match=r"the engine runs input_ids \[2, 32\]"):
        runner({"input_ids": tiny["ids"][:, :16]})
    # More rows than the batch: chunks of 2, the last padded, each row what it gives alone.
    three = runner({"input_ids": tiny["ids"]})["features"]
    assert three.shape[0] == 3
    assert torch.equal(three[2], runner({"input_ids": tiny["ids"][2:3]})["features"][0])


def test_inductor_cache_folders_of_ended_processes_are_removed():
    """Each job's inductor caches live in a folder of its process; a job server's worker ends by
    os._exit, which cleans nothing, so the next process that opens or builds an engine removes the
    folders of processes that have ended, and keeps its own and those of live ones."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = inductor_cache.CACHE_ROOT / ended.stdout.strip()
    live = inductor_cache.CACHE_ROOT / str(os.getppid())  # pytest's parent shell: alive
    for folder in (stale, live):
        (folder / "kernels").mkdir(parents=True, exist_ok=True)
    fresh = Path(inductor_cache.fresh_cache_dir())
    assert not stale.exists() and live.exists()
    assert fresh.is_dir() and fresh.parent == inductor_cache.CACHE_ROOT / str(os.getpid())
    shutil.rmtree(live)
