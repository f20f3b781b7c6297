"""Per-rank peaks of the imbalance run (raw-2/imbalance.txt's RAW lines) as a figure: one panel per router, the
eight ranks' peaks of a2a eager, ring expert and ring token. Usage: python plot_peaks.py raw-2/imbalance.txt out.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = [json.loads(line[4:]) for line in open(sys.argv[1]) if line.startswith("RAW ")]
fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4), sharey=True)
for ax, res in zip(axes, rows):
    width = 0.8 / len(res["rows"])
    for i, (label, r) in enumerate(res["rows"].items()):
        ranks = range(len(r["peaks"]))
        offset = width * (i - (len(res["rows"]) - 1) / 2)
        ax.bar([x + offset for x in ranks], [p / 2**30 for p in r["peaks"]], width=width, label=label)
    ax.set_title(f"{res['skew']}\nexpert {res['expert_share']:.1%}, rank {res['rank_share']:.1%}", fontsize=9)
    ax.set_xlabel("rank")
axes[0].set_ylabel("peak per rank (GiB)")
axes[0].legend(fontsize=8)
fig.suptitle("Qwen3 layer, EP=8 every rank real, 16384 tokens/rank, H200: per-rank peak of one fwd+bwd", fontsize=10)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
