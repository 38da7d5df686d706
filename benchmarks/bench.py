"""One benchmark harness: `python benchmarks/bench.py SUITE [--shape ...] [--steps N] [--warmup N] [--out DIR]`.

Each suite drives the product (prepare, the stages) in this process, writes OUT/SUITE.json (default
benchmarks/results) and regenerates the RESULTS.md table from every JSON there. BENCHMARKS.md describes the suites.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, log, record_memory_at_oom, write_suite  # noqa: E402
from benchmarks.suites import SUITES  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, module_name in SUITES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        p.add_argument("--shape", default="tiny", help="tiny (CPU, seconds) or a GPU shape the suite names")
        p.add_argument("--steps", type=int, default=12, help="timed steps (medians over them)")
        p.add_argument("--warmup", type=int, default=3, help="steps run before the timed ones")
        p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where SUITE.json and RESULTS.md go")
        p.add_argument("--work", type=Path, default=None, help="scratch folder for data and runs (default: a temp)")
        p.add_argument("--memory-at-oom", action="store_true",
                       help="record the allocator's history; at an out-of-memory write OUT/SUITE.oom_memory.txt")
        module.add_arguments(p)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    module = importlib.import_module(SUITES[args.suite])
    if args.memory_at_oom:
        where = RESULTS_DIR.parent if args.out.resolve() == RESULTS_DIR.resolve() else args.out  # results: JSONs only
        where.mkdir(parents=True, exist_ok=True)
        record_memory_at_oom(where / f"{args.suite}.oom_memory.txt")
    with tempfile.TemporaryDirectory(prefix=f"stitch-bench-{args.suite}-") as tmp:
        args.work = args.work or Path(tmp)
        args.work.mkdir(parents=True, exist_ok=True)
        payload = module.run(args)
    write_suite(args, payload)
    for row in payload["rows"]:
        log(f"{args.suite} {row['shape']}: {row['figures']}")


if __name__ == "__main__":
    main()
