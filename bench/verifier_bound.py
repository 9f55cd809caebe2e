"""Whether `cache.max_false_hit_rate` holds on pairs the calibration never saw.

For each pairs file: one pairwise sweep through the cache's own lookup (each pair's
`a` cached alone, its `b` asked; the verifier at operating point 0), then for each
bound the operating point the shipped calibration gives, the semantic hit rate and
the share of those hits that were wrong, beside the cosine threshold alone at the
same files (at 0.92, and at the threshold that serves as many semantic hits).
`--plot` draws precision and hit rate against the operating point. `--calibration`
takes another file from `satisfice cache calibrate` (e.g. one fitted on PAWS's
calibrate split, to be read on PAWS's held-out pairs).

    .venv/bin/python bench/verifier_bound.py bench/out/verifier_qqp_report.jsonl \\
        bench/out/verifier_paws_held.jsonl --plot docs/img/verifier_operating_point.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cache.calibration import BUNDLED as BUNDLED_CALIBRATION
from cache.calibration import NEVER, OperatingPoints, read_calibration
from cache.pairs import Sweep, SweepPoint, read_pairs, sweep
from cache.settings import CacheSettings
from cache.verifier import BUNDLED, Verification, Verifier
from router.embedder import Embedder, EmbedderSettings

BOUNDS = (0.01, 0.05, 0.08, 0.1, 0.15, 0.2)


def _point(result: Sweep, threshold: float) -> dict[str, float]:
    point = result.at(threshold)
    return {
        "semantic_hit_rate": round(point.semantic_hit_rate, 4),
        "semantic_wrong_share": round(point.semantic_wrong_share, 4),
        "precision": round(point.precision, 4),
        "hit_rate": round(point.hit_rate, 4),
    }


def _as_many(cosine: Sweep, point: SweepPoint) -> dict[str, float] | None:
    """The cosine threshold alone, at the threshold that serves as many semantic hits."""
    semantic = np.sort(cosine.score[np.isfinite(cosine.score) & (cosine.score >= 0)])[::-1]
    served = round(point.semantic_hit_rate * len(cosine.score))
    if not 0 < served <= len(semantic):
        return None
    threshold = float(semantic[served - 1])
    return {"threshold": round(threshold, 4), **_point(cosine, threshold)}


def _plot(curves: dict[str, Sweep], points: OperatingPoints, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0.3, 1.0, 141)
    figure, axes = plt.subplots(figsize=(7.5, 4.8))
    for colour, (name, result) in zip(("C0", "C1", "C2"), curves.items(), strict=False):
        at = [result.at(float(t)) for t in grid]
        axes.plot(grid, [1 - p.semantic_wrong_share for p in at], color=colour,
                  label=f"{name}: semantic precision")  # fmt: skip
        axes.plot(grid, [p.semantic_hit_rate for p in at], "--", color=colour,
                  label=f"{name}: semantic hit rate")  # fmt: skip
    for bound in (0.08, 0.1, 0.15, 0.2):
        threshold = points.threshold(bound)
        if threshold != NEVER:
            axes.axvline(threshold, color="grey", linewidth=0.6, linestyle=":")
            axes.text(threshold, 0.02, f" {bound:.0%}", fontsize=7, color="grey")
    axes.set_xlabel("verifier operating point (P); dotted: the point each bound sets")
    axes.set_ylim(0, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    axes.set_title("Pairwise, held-out pairs: precision and hit rate of semantic hits")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+")
    parser.add_argument("--plot")
    parser.add_argument(
        "--calibration", default=str(BUNDLED_CALIBRATION), help="default: the shipped calibration"
    )
    args = parser.parse_args()
    embedder = Embedder(EmbedderSettings(threads=2, max_batch=128))
    embedder.load()
    points = OperatingPoints(read_calibration(args.calibration))
    # The sweeps below score with the shipped verifier: refuse another's calibration.
    Verification(Verifier.load(BUNDLED), points)
    report: dict[str, object] = {"calibration": points.calibration.pairs}
    curves: dict[str, Sweep] = {}
    for path in args.pairs:
        pairs = read_pairs(path)
        kwargs = {"encode": embedder.encode, "embedding_model": embedder.fingerprint}
        verified = sweep(pairs, CacheSettings(), pairwise=True, **kwargs)  # type: ignore[arg-type]
        cosine = sweep(pairs, CacheSettings(verifier=None), pairwise=True, **kwargs)  # type: ignore[arg-type]
        curves[Path(path).stem] = verified
        rows = {}
        for bound in BOUNDS:
            threshold = points.threshold(bound)
            row: dict[str, object] = {"operating_point": threshold, **_point(verified, threshold)}
            row["held"] = verified.at(threshold).semantic_wrong_share <= bound
            row["cosine_at_as_many_hits"] = _as_many(cosine, verified.at(threshold))
            rows[str(bound)] = row
        report[Path(path).name] = {
            "pairs": len(pairs),
            "bounds": rows,
            "cosine_0.92": _point(cosine, 0.92),
        }
    if args.plot:
        _plot(curves, points, args.plot)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
