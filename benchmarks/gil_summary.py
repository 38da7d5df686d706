"""Who holds the GIL: a summary of py-spy's raw (collapsed) stacks recorded with ``--gil --threads``.

py-spy then samples only the thread holding the GIL, so a thread's share of the samples is its share of the
interpreter. Prints the samples per thread and, for each of the busiest threads, the innermost frames (with their
file and line) that took the most. Reads a plain or an xz-compressed file:

    python3 benchmarks/gil_summary.py benchmarks/results/logs/round11c_prepare_65536_gil.txt.xz
"""

from __future__ import annotations

import argparse
import collections
import lzma


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    opener = lzma.open if path.endswith(".xz") else open
    stacks = []
    with opener(path, "rt") as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack:
                stacks.append((stack.split(";"), int(count)))
    return stacks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--threads", type=int, default=6, help="busiest threads to list")
    ap.add_argument("--frames", type=int, default=10, help="innermost frames to list per thread")
    args = ap.parse_args()
    stacks = read_stacks(args.path)
    total = sum(n for _, n in stacks)
    per_thread: collections.Counter = collections.Counter()
    innermost: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for frames, n in stacks:
        per_thread[frames[0]] += n
        innermost[frames[0]][frames[-1]] += n
    print(f"{total} samples")
    for thread, n in per_thread.most_common(args.threads):
        print(f"{n:7d} {100 * n / total:5.1f} %  {thread}")
        for frame, m in innermost[thread].most_common(args.frames):
            print(f"        {m:6d}  {frame[:160]}")


if __name__ == "__main__":
    main()
