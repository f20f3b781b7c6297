"""Summarize a py-spy raw profile (``py-spy record -f raw``) of a run's timed part: the share of samples per
function, self and inclusive, over the samples whose stack passes through ``--within`` (a function name).

    python docs/bench/h200-hostcost/spy_summary.py PROFILE.txt [--within step] [--top 60]
"""
import argparse
import collections

ap = argparse.ArgumentParser()
ap.add_argument("profile")
ap.add_argument("--within", default="step")
ap.add_argument("--top", type=int, default=60)
args = ap.parse_args()
incl: collections.Counter = collections.Counter()
own: collections.Counter = collections.Counter()
total = 0
for line in open(args.profile):
    stack, n = line.rsplit(" ", 1)
    names = []
    for frame in stack.split(";"):
        fn, _, where = frame.partition(" (")
        names.append(f"{where.split(':')[0].split('/')[-1]}:{fn}")
    if not any(name.endswith(":" + args.within) for name in names):
        continue
    total += int(n)
    for name in set(names):
        incl[name] += int(n)
    own[names[-1]] += int(n)
print(f"{total} samples within {args.within}")
for title, counter in (("self", own), ("inclusive", incl)):
    print(f"--- {title}")
    for name, c in counter.most_common(args.top):
        print(f"{100 * c / total:5.1f}% {name}")
