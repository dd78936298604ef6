"""Learning-curve figure for one or several training runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from matplotlib.figure import Figure  # no pyplot: never touches the user's backend


def learning_curves(runs: Mapping[str, Mapping[str, Any]]) -> Figure:
    """Validation accuracy against step for each run's metrics (as written to metrics.json)."""
    fig = Figure(figsize=(6, 3.6), layout="constrained")
    ax = fig.subplots()
    chance = None
    for name, m in runs.items():
        steps = [h["step"] for h in m["history"]]
        ax.plot(steps, [100 * h["val_acc"] for h in m["history"]], marker="o", ms=3, label=name)
        chance = m["chance"]
    if chance is not None:
        ax.axhline(100 * chance, color="grey", ls=":", lw=1, label="chance")
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="training step", ylabel="validation accuracy (%)", ylim=(0, 100))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig
