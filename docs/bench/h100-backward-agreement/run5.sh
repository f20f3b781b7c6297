#!/usr/bin/env bash
# Host profile of the backend's ring against ring_moe's at EP=64 16384 (host_profile.py).
# Usage: bash docs/bench/h100-backward-agreement/run5.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 200 python docs/bench/h100-backward-agreement/host_profile.py --ep 64 --tokens 16384 --top 30 2>&1 | quiet \
  > $OUT/host-profile.txt
grep -A14 "====\|ncalls" $OUT/host-profile.txt | cut -c1-150 | head -80
