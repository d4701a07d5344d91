#!/usr/bin/env bash
# Keep a run's small files in git history, not in the tree: one commit adds them, the next untracks them again.
# A later checkout restores them with:   git checkout <that commit> -- <run folder> && git reset -q <run folder>
# Left out: the target features (GBs, rebuilt by the features phase) and every stage checkpoint but the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/smollm2-16k}
files=$(find "$RUN" -type f ! -path "$RUN/features/*" ! -name "*.tmp" | sort)
for stage in "$RUN"/stage*/; do
  [ -d "$stage" ] || continue
  newest=$(ls -d "$stage"checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 || true)
  for ckpt in $(ls -d "$stage"checkpoint-* 2>/dev/null || true); do
    [ "$ckpt" = "$newest" ] || files=$(echo "$files" | grep -v "^$ckpt/")
  done
done
# The committed state counts the running phase's time so far, up to its last file (a restored folder's files carry
# the checkout's times, not the run's), and names no phase as running.
.venv/bin/python - "$RUN" <<'PY'
import json, sys
from dataclasses import asdict
from pathlib import Path
from dcoco_hf.training.run import STATE_FILE, RunState
out = Path(sys.argv[1])
state = RunState(**json.loads((out / STATE_FILE).read_text()))
state.count_killed_time(out)
(out / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
print("state:", state.finished, {k: round(v) for k, v in state.seconds.items()})
PY
echo "$files" | xargs git add -f runs/persist.sh runs/NEXT.md
git commit -qm "Run files of $RUN (kept in history: the next commit untracks them)"
added=$(git rev-parse HEAD)
git rm -r -q --cached "$RUN" runs/persist.sh runs/NEXT.md
git commit -qm "Untrack $RUN again (its files stay in $added; restore: git checkout $added -- $RUN runs/persist.sh runs/NEXT.md && git reset -q runs)"
echo "kept in $added"
