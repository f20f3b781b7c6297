"""Loss curves of the bf16 training runs (issue 12) in one figure, and the noise statistics printed beside.

    python docs/bench/h200-numerics/plot_training.py docs/bench/h200-numerics/raw

Each raw JSON is one ``examples/train_moe.py --report-json`` run: eager a2a (a) and a compiled copy (b) from
the same initialization on the same batches. Run-to-run noise: the two eager a2a runs on different data
orders (``--data-seed 0`` and ``1``). Curves are means over windows of ``WINDOW`` steps.
"""
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WINDOW = 25


def windows(losses: list[float]) -> list[float]:
    return [statistics.mean(losses[i : i + WINDOW]) for i in range(0, len(losses) - WINDOW + 1, WINDOW)]


def gap(a: list[float], b: list[float]) -> float:
    """Mean |difference| of the windowed curves."""
    return statistics.mean(abs(x - y) for x, y in zip(windows(a), windows(b), strict=True))


def main() -> None:
    raw = Path(sys.argv[1])
    runs = {name: json.loads((raw / f"train_{name}.json").read_text())["losses"]
            for name in ("data0_relaymoe", "data1_relaymoe", "data0_inductor")}
    curves = {
        "a2a eager, data order 0": runs["data0_relaymoe"]["a2a"],
        "relaymoe, data order 0": runs["data0_relaymoe"]["relaymoe"],
        "a2a eager, data order 1": runs["data1_relaymoe"]["a2a"],
        "relaymoe, data order 1": runs["data1_relaymoe"]["relaymoe"],
        "a2a inductor, data order 0": runs["data0_inductor"]["relaymoe"],  # (b) compiled with inductor alone
    }
    stats = {
        "noise: a2a eager, data order 0 vs 1": gap(curves["a2a eager, data order 0"], curves["a2a eager, data order 1"]),
        "relaymoe vs a2a eager, data order 0": gap(curves["relaymoe, data order 0"], curves["a2a eager, data order 0"]),
        "relaymoe vs a2a eager, data order 1": gap(curves["relaymoe, data order 1"], curves["a2a eager, data order 1"]),
        "a2a inductor vs a2a eager, data order 0": gap(curves["a2a inductor, data order 0"],
                                                       curves["a2a eager, data order 0"]),
    }
    last = {name: statistics.mean(c[-100:]) for name, c in curves.items()}
    for name, value in stats.items():
        print(f"mean |gap| of {WINDOW}-step means, {name}: {value:.3f}")
    for name, value in last.items():
        print(f"mean loss of the last 100 steps, {name}: {value:.3f}")
    fig, ax = plt.subplots(figsize=(9, 5))
    styles = ["-", "-", "--", "--", ":"]
    for (name, losses), style in zip(curves.items(), styles, strict=True):
        xs = [i + WINDOW / 2 for i in range(0, len(losses) - WINDOW + 1, WINDOW)]
        ax.plot(xs, windows(losses), style, label=name, linewidth=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({WINDOW}-step mean)")
    ax.set_title("bf16 training, simulated EP=8 on one H200 (torch 2.11): eager a2a vs backend='relaymoe'")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(raw.parent / "training_loss.png", dpi=120)
    (raw.parent / "training_stats.json").write_text(json.dumps({"window": WINDOW, "gaps": stats, "last100": last}, indent=1))
    print(f"wrote {raw.parent / 'training_loss.png'}")


if __name__ == "__main__":
    main()
