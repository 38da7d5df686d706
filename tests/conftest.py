"""Shared fixtures: an isolated stitch cache per test session (tiny snapshots are built once there)."""

from __future__ import annotations

import os

import pytest

if "PYTEST_XDIST_WORKER" in os.environ:  # one thread a worker: `-n auto` starts one worker per core, and two
    # threads a worker on the same cores spin against each other (the suite ran 2x slower on two cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from stitch.host.host import get_host  # noqa: E402

GPU_WORDS = ("CUDA", "GPU", "gpu", "nvjpeg")


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n auto --dist loadscope`` (README), modules go to the workers in collection order, which
    ``pytest_collection_modifyitems`` starts with the slow modules, not by test count (xdist's default): the longest
    module, the video acceptance test, holds one test."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: xdist's count (a worker per core, or ``PYTEST_XDIST_AUTO_NUM_WORKERS``), capped by the memory
    free for workers unless that variable names the count."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # the caller's own count: xdist's hook reads it
    from xdist.plugin import pytest_xdist_auto_num_workers as per_core

    from tests.stitch_testing import auto_workers, available_gib

    return auto_workers(per_core(config), available_gib())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``gpu`` every test that a CUDA skip condition guards (its reason names CUDA, a GPU or nvjpeg), so that
    ``pytest -m gpu`` on a GPU machine runs exactly the tests a CPU run skips for want of one. Under pytest-xdist,
    the modules holding a ``slow`` test go first (in collection order), so that none is left running alone at the
    end while the other workers idle."""
    for item in items:
        if any(any(w in str(m.kwargs.get("reason", "")) for w in GPU_WORDS) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
    if "PYTEST_XDIST_WORKER" in os.environ:
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)  # stable: each module's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def settled_cpu_math():
    """MKL's first-call kernel choices made on one thread before any test's CPU math, as the CLI does
    (``stitch.kernels.cpu_math``): a test comparing two paths on its process's first forward compares exact math."""
    from stitch.kernels.cpu_math import settle_cpu_math

    settle_cpu_math()


@pytest.fixture(scope="session", autouse=True)
def stitch_cache(tmp_path_factory: pytest.TempPathFactory):
    """Point ``STITCH_CACHE`` at a session directory unless the caller set one (CI may reuse it)."""
    if "STITCH_CACHE" in os.environ:
        yield os.environ["STITCH_CACHE"]
        return
    path = tmp_path_factory.mktemp("stitch-cache")
    os.environ["STITCH_CACHE"] = str(path)
    try:
        yield str(path)
    finally:
        os.environ.pop("STITCH_CACHE", None)


@pytest.fixture
def host():
    """A freshly loaded PluginHost (installed plugins, env filters applied)."""
    from stitch.host.host import load_plugins

    return load_plugins()


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, stitch_cache):
    """A small prepared run directory (the demo base, tiny CLIP) with a finished alignment stage."""
    from stitch.config.recipe import load_recipe
    from stitch.stages.loop import run_stage
    from tests.stitch_testing import prepare_resolved, write_recipe

    root = tmp_path_factory.mktemp("prepared")
    recipe = load_recipe(write_recipe(root / "small.yaml"))
    prepare_resolved(recipe, root / "run" / "data", progress=False)
    run_stage(recipe, "alignment", root / "run", progress=False, registry=get_host())
    return root


@pytest.fixture(scope="session")
def sft_run(prepared, tmp_path_factory):
    """``prepared`` plus a 4-step SFT stage: a donor for GRPO, DPO and inference tests."""
    import shutil

    from stitch.config.recipe import load_recipe
    from stitch.stages.loop import run_stage
    from tests.stitch_testing import write_recipe

    root = tmp_path_factory.mktemp("sft-run")
    shutil.copytree(prepared / "run", root / "run")
    recipe = load_recipe(write_recipe(root / "small.yaml", stages__sft__steps=4))
    run_stage(recipe, "sft", root / "run", progress=False, registry=get_host())
    return root / "run"
