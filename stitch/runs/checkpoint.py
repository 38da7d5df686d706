"""Training checkpoints: ``checkpoints/step_N/`` (adapter, projector artifact, optimizer, RNG, data state, the
intra-op thread count), and ``checkpoints/LATEST`` naming the newest complete one, written atomically and last."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stitch.runs.atomic import write_text_atomic
from stitch.runs.digest import file_sha256
from stitch.runs.diskspace import check_free_space, named_when_full

log = logging.getLogger("stitch")


def random_to_json(rng: random.Random) -> list[Any]:
    """A ``random.Random`` state as JSON (for data-order state in checkpoints)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def random_from_json(rng: random.Random, state: list[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def seed_all(seed: int) -> None:
    """Seed every global generator a step may draw from (torch CPU and CUDA, python ``random``, numpy): a fresh
    run's state then depends on the seed alone, as a resumed run's depends on its checkpoint."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def numpy_to_tensors(state: tuple[Any, ...]) -> dict[str, Any]:
    """numpy's legacy global state as tensors and ints (``torch.load(weights_only=True)`` reads no ndarray)."""
    kind, keys, pos, has_gauss, gauss = state
    return {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
            "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}


def numpy_from_tensors(state: dict[str, Any]) -> tuple[Any, ...]:
    keys = state["keys"].numpy().astype(np.uint32)
    return state["kind"], keys, state["pos"], state["has_gauss"], state["gauss"]


def rng_state() -> dict[str, Any]:
    """The CPU torch, python and numpy generators, and with CUDA the generator of every visible device (dropout
    and sampling on a GPU draw from those, not from the CPU one)."""
    state = {"torch": torch.get_rng_state(), "python": random_to_json(random),
             "numpy": numpy_to_tensors(np.random.get_state())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` saved. CUDA generators are restored for the devices both runs see; a CPU-only
    process resuming a CUDA run has no CUDA generator to restore."""
    torch.set_rng_state(state["torch"])
    random_from_json(random, state["python"])
    if "numpy" in state:  # checkpoints written before numpy's state was kept
        np.random.set_state(numpy_from_tensors(state["numpy"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def step_number(step_dir: Path) -> int:
    """N of a ``step_N`` checkpoint directory."""
    return int(Path(step_dir).name.split("_")[1])


def latest_step_dir(root: Path) -> Path | None:
    """The step directory ``root/LATEST`` names, or None when there is no checkpoint yet."""
    latest = Path(root) / "LATEST"
    if not latest.is_file():
        return None
    try:
        name = latest.read_bytes().decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointIntegrityError(f"{latest} is not a step name (it holds binary bytes); it should read "
                                       f"step_N, the newest complete step directory beside it") from None
    step_dir = (Path(root) / name).resolve()
    if step_dir.parent != Path(root).resolve() or not step_dir.is_dir():
        raise FileNotFoundError(f"{latest} names {name!r}, which is not a step directory under {root}")
    return step_dir


def save_step(
    root: Path,
    step: int,
    write_payload: Any,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    keep: int = 2,
    needed: int = 0,
) -> Path:
    """Write ``root/step_N`` in a temp dir, rename it into place, then point LATEST at it.

    ``write_payload(dir)`` writes the model parts (adapter, projector artifact). ``needed`` is the step's expected
    size in bytes (its tensors); the newest step already written, when larger, stands for it. A step that cannot
    fit is refused before anything is written, and a full disk mid-write is a ``DiskFullError`` naming the step;
    either way LATEST and the steps already written are untouched.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    sweep_partial_steps(root)
    final = root / f"step_{step}"
    needed = max(needed, _newest_step_bytes(root))
    check_free_space(root, needed, f"checkpoint {final.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{step}.", dir=root))
    try:
        with named_when_full(tmp, needed, f"checkpoint {final.name}"):
            write_payload(tmp)
            if optimizer is not None:
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(rng_state(), tmp / "rng.pt")
            record = {"step": step, **state, "intra_op_threads": torch.get_num_threads()}
            (tmp / "trainer_state.json").write_text(json.dumps(record, indent=1))
            write_checksums(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_text_atomic(root / "LATEST", final.name + "\n")
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)  # LATEST still names the previous step: this one never completed
        raise
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=step_number)
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


PARTIAL_PREFIX = ".step_"  # a step being written: ``.step_N.XXXXXXXX`` until it is renamed to ``step_N``


def sweep_partial_steps(root: Path) -> list[Path]:
    """Remove the temp dirs of step writes a killed process left in ``root`` (the caller holds the run's lock, so
    no live writer owns one); returns what was removed."""
    swept = [p for p in Path(root).glob(f"{PARTIAL_PREFIX}*") if p.is_dir()]
    for path in swept:
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, a checkpoint write that did not finish", path)
    return swept


def _newest_step_bytes(root: Path) -> int:
    try:
        step_dir = latest_step_dir(root)
    except (CheckpointIntegrityError, FileNotFoundError):  # a broken LATEST is for resume to refuse, not saving
        return 0
    return sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()) if step_dir else 0


def load_step_state(step_dir: Path, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Restore optimizer and RNG from ``step_dir`` (tensors only: weights_only=True); return its state. The caller
    verifies the step's checksums first (``verify_checksums``), before any of its tensors are read."""
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(step_dir / "optimizer.pt", weights_only=True))
    set_rng_state(torch.load(step_dir / "rng.pt", weights_only=True))
    state = json.loads((step_dir / "trainer_state.json").read_text())
    use_threads_of(state, step_dir)
    return state


def use_threads_of(state: dict[str, Any], step_dir: Path) -> None:
    """Continue with the intra-op thread count the checkpoint was written with. CPU kernels split reductions by
    thread count, so a process resuming with another count (another OMP_NUM_THREADS, another machine) drifts
    from the uninterrupted run from the first update on (~1e-7 relative): exact resume needs the same count.
    ``run_stage`` gives the caller's count back when the stage ends."""
    threads = state.get("intra_op_threads")
    if threads and threads != torch.get_num_threads():
        log.info("resuming %s with %d intra-op threads, as it was written (this process had %d)", step_dir, threads,
                 torch.get_num_threads())
        torch.set_num_threads(threads)


CHECKSUMS = "SHA256SUMS.json"


class CheckpointIntegrityError(ValueError):
    """A checkpoint file differs from what was written; the message names the file."""


def write_checksums(step_dir: Path) -> None:
    """``step_dir/SHA256SUMS.json``: the sha256 of every file of the step, recorded as it is written."""
    files = sorted(p for p in Path(step_dir).rglob("*") if p.is_file() and p.name != CHECKSUMS)
    sums = {str(p.relative_to(step_dir)): file_sha256(p) for p in files}
    (Path(step_dir) / CHECKSUMS).write_text(json.dumps(sums, indent=1))


def verify_checksums(step_dir: Path) -> None:
    """Refuse a step directory whose files differ from the recorded sha256s (tampered, truncated, missing),
    naming the file. Every checkpoint stitch writes records them, so a step without the record is refused too:
    deleting it must not switch the check off."""
    record = Path(step_dir) / CHECKSUMS
    if not record.is_file():
        raise CheckpointIntegrityError(
            f"checkpoint {step_dir}: {CHECKSUMS} is missing, so its files cannot be checked against what was "
            f"written; it was deleted, or the directory was not written by stitch's checkpointing")
    for name, want in json.loads(record.read_text()).items():
        path = Path(step_dir) / name
        if not path.is_file():
            raise CheckpointIntegrityError(f"checkpoint {step_dir}: {name} is missing (recorded in {CHECKSUMS})")
        got = file_sha256(path)
        if got != want:
            raise CheckpointIntegrityError(f"checkpoint {step_dir}: {name} has sha256 {got}, but {want} was recorded "
                                           f"when it was written; the file was modified")
