# One GPU session of issue 32's rehearsals: the named cases rehearsed (their log in $OUT/log.txt), their
# results merged with earlier ones (PREV: a results directory of bench/rehearse_gpu.py --out), then
# calibrated from all of them and re-priced (--taught) on this machine, whose torch traced the plans.
# Without PREV only the new results are calibrated from (earlier ones priced for another GPU would not mix).
#   PREV=bench/results/rehearse-h100-1206 bash bench/rehearse_session.sh 8b-cp2-ring 70b-recipe 8b-tp8
source "$(dirname "${BASH_SOURCE[0]}")/stage_package.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${REHEARSE_LIMIT:-420}" python bench/rehearse_gpu.py --steps 2 --out "$OUT/new" "$@" > "$OUT/log.txt" 2>&1
echo "rehearsals exit $?"
grep -v "^\[rank0\]\|^  \[" "$OUT/log.txt" | tail -60
grep -B2 -A8 "Error\|error:" "$OUT/log.txt" | grep -v "^\[rank0\]:  " | tail -40
mkdir -p "$OUT/all"
cp "$OUT"/new/*.json "$OUT/all/" 2>/dev/null
python - "${PREV:-}" "$OUT" <<'PY'
import json, shutil, sys
from pathlib import Path
prev, out = Path(sys.argv[1]), Path(sys.argv[2])
new = json.loads((out / "new/results.json").read_text()) if (out / "new/results.json").exists() else []
done = {r["case"] for r in new}
old = [r for r in json.loads((prev / "results.json").read_text()) if r["case"] not in done] if sys.argv[1] else []
for r in old:
    shutil.copy(prev / f"{r['case']}.json", out / "all")
(out / "all/results.json").write_text(json.dumps(old + new, indent=1))
print("calibrating from", [r["case"] for r in old + new])
PY
python bench/rehearse_gpu.py --taught "$OUT/all" 2>&1 | tail -20
