"""PNG plots of a run's curves: loss per stage, GRPO reward, and accuracy after each stage, read against the
majority-answer baseline of the eval partition (and the zeroed-feature control when it was measured)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from stitch.config.options import STAGE_OPTIONS


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def baseline_accuracy(summary: dict[str, Any]) -> float | None:
    """The majority-answer baseline ``stitch run`` measured on the eval partition, if any."""
    evaluation = summary.get("evaluation") or {}
    return (evaluation.get("majority_baseline") or {}).get("accuracy")


def plot_run(out_dir: Path, summary: dict[str, Any]) -> list[Path]:
    """The run's PNGs; none (with a note) when matplotlib, the ``[plots]`` extra, is not installed."""
    try:
        import matplotlib  # optional: matplotlib ([plots] extra)
    except ImportError:
        logging.getLogger("stitch").warning("no plots: matplotlib is not installed (pip install 'stitch-lm[plots]'); "
                                            "metrics.jsonl and summary.json hold the same numbers")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib ([plots] extra)

    out_dir = Path(out_dir)
    written = []
    losses = {stage: [r for r in _read(out_dir / stage / "metrics.jsonl") if "loss" in r]
              for stage in STAGE_OPTIONS}
    losses = {stage: rows for stage, rows in losses.items() if rows}
    if losses:
        # one panel per stage: their losses live on different scales (captions vs answers vs policy loss)
        fig, axes = plt.subplots(1, len(losses), figsize=(3.6 * len(losses), 3.4), squeeze=False)
        for ax, (stage, rows) in zip(axes[0], losses.items(), strict=True):
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], linewidth=0.8)
            ax.set_title(f"{stage} loss")
            ax.set_xlabel("step")
        fig.tight_layout()
        written.append(out_dir / "loss.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)

    grpo = _read(out_dir / "grpo" / "metrics.jsonl")
    if grpo:
        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [r["step"] for r in grpo]
        grpo = [r for r in grpo if "reward" in r]
        steps = [r["step"] for r in grpo]
        rewards = [r["reward"] for r in grpo]
        ax.plot(steps, rewards, alpha=0.4, label="mean reward")
        window = max(1, len(rewards) // 10)
        smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"moving average ({window})")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title("GRPO reward")
        ax.legend()
        fig.tight_layout()
        written.append(out_dir / "reward.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)

    curves = {stage: [r for r in _read(out_dir / stage / "metrics.jsonl") if "eval_accuracy" in r]
              for stage in ("sft", "grpo")}
    if any(len(v) > 1 for v in curves.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        offset = 0
        for stage in ("sft", "grpo"):
            rows = curves[stage]
            start = (summary.get("stages", {}).get(stage) or {}).get("eval_accuracy_start")
            if rows and start is not None:  # GRPO's line starts at its donor, where SFT's ends
                rows = [{"step": 0, "eval_accuracy": start}, *rows]
            if rows:
                ax.plot([offset + r["step"] for r in rows], [r["eval_accuracy"] for r in rows], marker="o",
                        label=stage)
                offset += rows[-1]["step"]
        baseline = baseline_accuracy(summary)
        if baseline is not None:
            ax.axhline(baseline, color="gray", linestyle="--", label=f"majority answer {baseline:.1%}")
        control = (summary.get("evaluation") or {}).get("zeroed_features_accuracy")
        if control is not None:
            ax.axhline(control, color="red", linestyle=":", label=f"zeroed features {control:.1%}")
        ax.set_ylim(0, 1)
        ax.set_xlabel("step (SFT, then GRPO)")
        ax.set_ylabel("held-out accuracy")
        ax.set_title("accuracy during training")
        ax.legend()
        fig.tight_layout()
        written.append(out_dir / "accuracy_curve.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)

    stages = [(s, v["eval_accuracy"]) for s, v in summary.get("stages", {}).items()
              if v.get("eval_accuracy") is not None]
    control = (summary.get("evaluation") or {}).get("zeroed_features_accuracy")
    if control is not None:
        stages.append((f"{summary['evaluation']['stage']}\nzeroed features", control))
    if stages:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([s for s, _ in stages], [a for _, a in stages])
        baseline = baseline_accuracy(summary)
        if baseline is not None:
            ax.axhline(baseline, color="gray", linestyle="--", label=f"majority answer {baseline:.1%}")
            ax.legend()
        ax.set_ylim(0, 1)
        ax.set_ylabel("held-out accuracy")
        ax.set_title("accuracy after each stage")
        fig.tight_layout()
        written.append(out_dir / "accuracy.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
