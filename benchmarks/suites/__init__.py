"""The suites of benchmarks/bench.py: name -> module. Adding a suite is one entry here plus its module, which
defines ``add_arguments(parser)`` (its own options) and ``run(args) -> dict`` (the JSON payload, with ``rows``:
one ``{"shape": ..., "figures": {...}}`` per line of RESULTS.md)."""

SUITES: dict[str, str] = {
    "sft": "benchmarks.suites.sft",
    "grpo": "benchmarks.suites.grpo",
    "prepare": "benchmarks.suites.prepare",
    "encode": "benchmarks.suites.encode",
    "real-size": "benchmarks.suites.real_size",
    "models": "benchmarks.suites.models",
    "serve": "benchmarks.suites.serve",
}
