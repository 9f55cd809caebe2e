"""Quality against the share of large-model calls, as RouteLLM draws it."""

from __future__ import annotations

from pathlib import Path

from router.metrics import RoutingReport


def plot_quality_curve(reports: dict[str, RoutingReport], path: str | Path, *, title: str) -> None:
    """One curve per router; the reports must come from the same outcome data."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, report in reports.items():
        axes.plot(
            [p.large_pct for p in report.curve],
            [p.accuracy for p in report.curve],
            marker=".",
            label=f"{name} (APGR {report.apgr:.3f})",
        )
    # A random router's expected quality is the straight line between the two models.
    axes.plot(
        [0, 100],
        [report.small_accuracy, report.large_accuracy],
        linestyle=":",
        color="grey",
        label=f"random (APGR {report.random_apgr:.3f})",
    )
    axes.plot(
        [p.large_pct for p in report.oracle],
        [p.accuracy for p in report.oracle],
        marker="x",
        linestyle="--",
        color="green",
        label="oracle",
    )
    axes.axhline(report.small_accuracy, color="grey", linestyle="--", linewidth=0.8)
    axes.axhline(report.large_accuracy, color="red", linestyle="--", linewidth=0.8)
    axes.set_xlabel("large-model calls (%)")
    axes.set_ylabel("quality (% correct)")
    axes.set_title(title)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
