"""bf16 training (issue 12) on four data orders: eager a2a and backend='relaymoe' per order, one figure, and the
run-to-run noise measured as the gaps between the a2a runs of different data orders.

    python docs/bench/h200-ep64/plot_training_seeds.py docs/bench/h200-ep64/raw-2-spread

Each raw JSON is one ``examples/train_moe.py --report-json`` run (``--data-seed s``): eager a2a and the relaymoe
copy from the same initialization on the same batches. Gap of two curves: mean |difference| of their
``WINDOW``-step means (docs/bench/h200-numerics/plot_training.py's, imported). Writes training_seeds.png and
training_seeds.json beside the raw folder.
"""
import itertools
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "h200-numerics"))
from plot_training import WINDOW, gap, windows  # noqa: E402  (session 3's script: the same windows and gap)

raw = Path(sys.argv[1])
runs = {int(p.stem.split("data")[1].split("_")[0]): json.loads(p.read_text())["losses"]
        for p in sorted(raw.glob("train_data*_relaymoe.json"))}
noise = {f"a2a {a} vs a2a {b}": gap(runs[a]["a2a"], runs[b]["a2a"]) for a, b in itertools.combinations(runs, 2)}
ring = {f"relaymoe vs a2a, data order {s}": gap(r["relaymoe"], r["a2a"]) for s, r in runs.items()}
summary = {
    "noise mean": statistics.mean(noise.values()), "noise min": min(noise.values()), "noise max": max(noise.values()),
    "relaymoe gap mean": statistics.mean(ring.values()), "relaymoe gap max": max(ring.values()),
}
last = {f"{kind}, data order {s}": statistics.mean(r[kind][-100:]) for s, r in runs.items() for kind in r}
for name, value in {**noise, **ring, **summary}.items():
    print(f"{name:36s} {value:.3f}")
fig, ax = plt.subplots(figsize=(9, 5))
for s, r in runs.items():
    xs = [i + WINDOW / 2 for i in range(0, len(r["a2a"]) - WINDOW + 1, WINDOW)]
    line, = ax.plot(xs, windows(r["a2a"]), "-", linewidth=1.4, label=f"a2a eager, data order {s}")
    ax.plot(xs, windows(r["relaymoe"]), "--", color=line.get_color(), linewidth=1.4, label=f"relaymoe, data order {s}")
ax.set_xlabel("step")
ax.set_ylabel(f"loss ({WINDOW}-step mean)")
ax.set_title("bf16 training, simulated EP=8 on one H200 (torch 2.11): eager a2a (solid) vs relaymoe (dashed)")
ax.legend(fontsize=8, ncol=2)
ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(raw.parent / "training_seeds.png", dpi=120)
(raw.parent / "training_seeds.json").write_text(json.dumps(
    {"window": WINDOW, "noise": noise, "relaymoe": ring, "summary": summary, "last100": last}, indent=1))
print(f"wrote {raw.parent / 'training_seeds.png'}")
