"""PNG plot of a report: time vs batch per op, and recovery / full-state ratios.

matplotlib is an optional dependency (``pip install vllm-recoverssm[bench]``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .report import FUSED_TARGET_LARGE, RATIO_TARGET_LARGE, RATIO_TARGET_SMALL, SHORT
from .runner import OPS


def matplotlib_available() -> bool:
    """True when matplotlib can be imported (checked before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _rows(report: dict[str, Any], S: int, L: int) -> list[dict[str, Any]]:
    return sorted((r for r in report["rows"] if r["num_spec"] == S and r["layers"] == L),
                  key=lambda r: r["batch"])


def _batch_axis(ax: Any, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    if batches:
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.minorticks_off()


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Draw one time panel per (layers, S) and one ratio panel per S; save as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = sorted({r["num_spec"] for r in report["rows"]})
    layers = sorted({r["layers"] for r in report["rows"]})
    nrows, ncols = len(layers) + 1, len(specs)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    roof = report["roof"]["gbps"]
    styles = {"fla_full": "k-", "ours_full": "C7-", "verify": "C0--", "commit_all": "C1--",
              "commit_2": "C1:", "total_all": "C2-", "total_2": "C2:", "fused_all": "C3-",
              "fused_2": "C3:"}
    for j, S in enumerate(specs):
        for i, L in enumerate(layers):
            ax = axes[i][j]
            rows = _rows(report, S, L)
            for n in OPS:
                pts = [(r["batch"], r["ops"][n]["ms"]) for r in rows if n in r["ops"]]
                if pts:
                    ax.plot(*zip(*pts, strict=True), styles[n], marker="o", ms=3,
                            label=SHORT[n])
            pts = [(r["batch"], r["ops"]["total_all"]["bytes"] / (roof * 1e6))
                   for r in rows if "total_all" in r["ops"]]
            if pts:
                ax.plot(*zip(*pts, strict=True), "C2", lw=0.8, alpha=0.5,
                        label="total-all at copy roof")
            _batch_axis(ax, [r["batch"] for r in rows])
            ax.set_yscale("log")
            ax.set_title(f"S = {S}, {L} layer{'s' if L > 1 else ''}")
            ax.set_xlabel("batch")
            ax.set_ylabel("ms per step (median)")
            ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
        ax = axes[-1][j]
        for k, L in enumerate(layers):
            rows = _rows(report, S, L)
            for key, style, marker in (("total_all/fla", "-", "o"), ("total_2/fla", ":", "o"),
                                       ("fused_all/fla", "-", "s"), ("fused_2/fla", ":", "s")):
                pts = [(r["batch"], r["ratios"][key]) for r in rows
                       if r["ratios"].get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), f"C{k}{style}", marker=marker, ms=3,
                            label=f"{key}, L={L}")
        if S in RATIO_TARGET_LARGE:
            ax.axhline(RATIO_TARGET_LARGE[S], color="r", lw=0.8, ls="--",
                       label=f"recovery target {RATIO_TARGET_LARGE[S]} (batch >= 128)")
        if S in FUSED_TARGET_LARGE:
            ax.axhline(FUSED_TARGET_LARGE[S], color="m", lw=0.8, ls="--",
                       label=f"fused target {FUSED_TARGET_LARGE[S]} (batch >= 128)")
        ax.axhline(RATIO_TARGET_SMALL, color="0.5", lw=0.8)
        _batch_axis(ax, sorted({r["batch"] for r in report["rows"]}))
        ax.set_title(f"S = {S}: recovery and fused / fla-core full-state")
        ax.set_xlabel("batch")
        ax.set_ylabel("time ratio")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = report["machine"]
    title = textwrap.wrap(report["command"], 70 * ncols)
    title.append(f"{m['device']}, {report['date']}, copy roof {roof:.0f} GB/s")
    fig.suptitle("\n".join(title), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
