"""Where the torch backend's compiled programs live while they are built and opened: inductor's caches.

A build compiles in a folder named by its engine's path (build_folder), which its openings can name
on any node; each job loads a build's cache artifacts into a folder of its own (fresh_cache_dir,
own_inductor_cache), and puts the build's autotune choices where its Triton kernels look for them
(place_autotune_choices). What an opening did is counted from inductor's FX graph cache
(fx_graph_cache) and dynamo's timers (dynamo_seconds: REDONE is the work a build should have done),
and what a compiled program holds from its artifacts (artifact_counts). quantstudy.backends.torch_backend
builds and opens engines with these.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from quantstudy.artifacts import atomic_write

# Each process's inductor caches, in a folder named by its pid (fresh_cache_dir); each build's, in
# builds/, in a folder named by its engine's path (build_folder), kept for its openings while the
# engine exists (new_build_folder).
CACHE_ROOT = Path(tempfile.gettempdir()) / f"quantstudy-inductor-{os.getuid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def fresh_cache_dir() -> str:
    """A fresh folder for inductor's on-disk caches, in this process's folder under CACHE_ROOT. It must
    last as long as the process (compiled kernels load lazily from it), and a job may end by os._exit
    (the job server's workers), which runs no clean-up: so each call removes the folders of processes
    that have ended instead."""
    CACHE_ROOT.mkdir(exist_ok=True)
    for folder in CACHE_ROOT.iterdir():
        if folder.name.isdigit() and int(folder.name) != os.getpid() and not _alive(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)
    mine = CACHE_ROOT / str(os.getpid())
    mine.mkdir(exist_ok=True)
    return tempfile.mkdtemp(dir=mine)


def build_folder(out_dir: str | Path) -> Path:
    """The folder the build of the engine in `out_dir` compiles in: a path its openings can name too, on
    any node (from the engine's path). torch keeps each compiled Triton kernel, with its launcher, in the
    compiled program, and the kernel looks up the build's choice among its configs (an autotune artifact)
    beside its own path, in the build's folder. An opening loads the artifacts into a folder of its own,
    where the kernel would not find the choice and would benchmark its configs again: so an opening
    also puts the choices where the kernels look (place_autotune_choices)."""
    return CACHE_ROOT / "builds" / hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:16]


def new_build_folder(out_dir: Path) -> Path:
    """An empty build folder for the engine in `out_dir`, which names its engine (a file `engine`); and
    the build folders of engines that are gone are removed (a build folder outlives its job: the
    engine's openings use it)."""
    for named in (CACHE_ROOT / "builds").glob("*/engine"):
        with contextlib.suppress(FileNotFoundError):  # another build removing it too
            if not Path(named.read_text()).exists():
                shutil.rmtree(named.parent, ignore_errors=True)
    folder = build_folder(out_dir)
    shutil.rmtree(folder, ignore_errors=True)  # compiled from nothing, as its build's record says
    folder.mkdir(parents=True)
    atomic_write(folder / "engine", str(out_dir.resolve()))  # another build reads it to decide on removing
    return folder


def place_autotune_choices(loaded: Path, out_dir: str | Path) -> None:
    """Copy the autotune choices an opening loaded (`*.best_config`, by their place in its cache folder)
    to the same places in the engine's build folder. Openings on one node write the same bytes there,
    each atomically."""
    build = build_folder(out_dir)
    for choice in loaded.glob("*/*.best_config"):
        atomic_write(build / choice.relative_to(loaded), choice.read_bytes())


@contextlib.contextmanager
def own_inductor_cache(folder: Path | None = None) -> Iterator[Path]:
    """Inductor's on-disk caches in a folder of their own (a fresh one, or `folder`), and a fresh record
    of cache artifacts: a build compiles from nothing (all it made is recorded), and an opening job finds
    only what it loaded."""
    from torch.compiler._cache import CacheArtifactManager

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = folder or Path(fresh_cache_dir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    try:
        with CacheArtifactManager.with_fresh_cache():
            yield folder
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@contextlib.contextmanager
def fx_graph_cache() -> Iterator[dict[str, int]]:
    """Inductor's FX graph cache lookups inside the block, by outcome: hit, miss (compiled), bypass
    (compiled, not cacheable). The dict is filled when the block ends."""
    from torch._dynamo.utils import counters

    def counts() -> dict[str, int]:
        return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}
    before, found = counts(), {}
    yield found
    found.update({k: v - before[k] for k, v in counts().items()})


# dynamo's own timers (torch._dynamo.utils.compile_times, seconds summed over the process). The parts
# of an opening: all of dynamo's work on a frame (`dynamo`), of which the backend's (AOTAutograd and
# inductor: on an opening job, loading the compiled graphs and kernels from the cache artifacts), or,
# where dynamo's own output was cached too (torch's experimental caching precompile), the loading of
# that in place of a trace. And two kinds of work an opening should not do again, summed wherever they
# ran (a compile thread pool's seconds may exceed the wall time): the C++ sources compiled (inductor's
# CPU kernels, whose source is what the artifacts hold; none on a GPU, whose Triton kernels they hold
# compiled), and the benchmarking of a Triton kernel's configs when it first runs (none where the
# artifacts hold the autotuning's choice).
DYNAMO_TIMERS = {"dynamo": "_compile.compile_inner", "compiler": "OutputGraph.call_user_compiler",
                 "precompiled": "after_deserialization",
                 "compiling": "compile_file", "autotuning": "CachingAutotuner.benchmark_all_configs"}
REDONE = ("compiling", "autotuning")


def dynamo_seconds() -> dict[str, float]:
    """dynamo's DYNAMO_TIMERS so far in this process (0 for a timer that has not run)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    timed = dict(zip(names, values))
    return {k: float(timed.get(name, 0.0)) for k, name in DYNAMO_TIMERS.items()}


def artifact_counts(info) -> dict[str, int]:
    """What a compiled program holds, by kind of cache artifact (inductor: compiled graphs; autotune: the
    Triton configs chosen by benchmarking, which an opening then need not benchmark again)."""
    return {kind: len(keys) for kind, keys in sorted(info.artifacts.items())} if info is not None else {}


def artifact_summary(counts: dict[str, int]) -> str:
    return "artifacts: " + (", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none")
