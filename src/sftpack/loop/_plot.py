"""Loss (and eval loss) and real tokens/s curves of one or several runs, as a PNG (matplotlib, Agg);
for a preference objective (DPO, SimPO) also the mean chosen / rejected rewards and the reward accuracy."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._optional import pyplot

__all__ = ["plot_training", "read_log"]


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSONL training log (one dict per step)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_training(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    out: str | os.PathLike[str],
    *,
    title: str | None = None,
) -> Path:
    """Draw ``runs`` (name -> per-step records with ``step``, ``loss``, ``tokens_per_s``)
    side by side: loss per step (left, with the ``eval_loss`` of the records that have one),
    real tokens/s per step (second). Records of a preference objective (with ``chosen_reward``,
    ``rejected_reward`` and ``reward_accuracy``, as the step log writes them) add two panels:
    the mean rewards per step (chosen solid, rejected dashed, in the run's colour) and the reward
    accuracy. Returns ``out``."""
    plt = pyplot("the training curves (--plot)")
    rewards = any(r.get("chosen_reward") is not None for recs in runs.values() for r in recs)
    fig, axes = plt.subplots(1, 4 if rewards else 2, figsize=(22 if rewards else 11, 4))
    ax_loss, ax_speed = axes[0], axes[1]
    for name, recs in runs.items():
        steps = [r["step"] for r in recs]
        (line,) = ax_loss.plot(steps, [r["loss"] for r in recs], label=name, linewidth=1.5)
        evals = [(r["step"], r["eval_loss"]) for r in recs if r.get("eval_loss") is not None]
        if evals:  # the held-out loss, in the run's colour, dashed with a dot per evaluation
            ax_loss.plot(*zip(*evals), label=f"{name} (eval)", color=line.get_color(), linestyle="--", marker="o")
        ax_speed.plot(steps, [r["tokens_per_s"] for r in recs], label=name, linewidth=1.5)
        paired = [r for r in recs if r.get("chosen_reward") is not None]
        if paired:
            colour, at = line.get_color(), [r["step"] for r in paired]
            axes[2].plot(at, [r["chosen_reward"] for r in paired], label=f"{name} chosen", color=colour)
            axes[2].plot(at, [r["rejected_reward"] for r in paired], label=f"{name} rejected", color=colour, ls="--")
            axes[3].plot(at, [r["reward_accuracy"] for r in paired], label=name, color=colour, linewidth=1.5)
    ax_loss.set(xlabel="step", ylabel="loss (pair mean)" if rewards else "token-mean loss", title="loss")
    ax_speed.set(xlabel="step", ylabel="real tokens / s", title="throughput")
    if rewards:
        axes[2].set(xlabel="step", ylabel="mean implicit reward", title="rewards")
        axes[3].set(xlabel="step", ylabel="chosen reward > rejected", title="reward accuracy", ylim=(-0.05, 1.05))
    from matplotlib.ticker import MaxNLocator  # optional: matplotlib (the plot extra), after pyplot() checked it

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 1.5
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
