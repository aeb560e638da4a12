"""One row per comparison folder (cdbench fidelity's fidelity.csv): each checked figure's signed error, % (noise floor)
and ✓/✗ against max(bar, noise); then mean compile and mask share (not checked)."""
import csv, sys
from pathlib import Path
CHECKED = ["median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "request_throughput", "p99_itl_ms"]
INFO = ["mean_compile_ms", "mask_share"]
print("| case | compared | " + " | ".join(m.replace("_ms", "").replace("_", " ") for m in CHECKED + INFO) + " | within |")
print("|---|---|" + "---:|" * len(CHECKED + INFO) + "---|")
for folder in sys.argv[1:]:
    rows = {r["metric"]: r for r in csv.DictReader(open(Path(folder) / "fidelity.csv"))}
    cells, ok = [], 0
    for m in CHECKED:
        r = rows[m]; good = r["verdict"] == "within"; ok += good
        cells.append(f"{float(r['error_pct']):+.1f} ({float(r['noise_pct']):.1f}) {'✓' if good else '✗'}")
    for m in INFO:
        r = rows[m]; cells.append(f"{float(r['error_pct']):+.1f} ({float(r['noise_pct']):.1f})")
    name = Path(folder).name.removesuffix("-fidelity")
    case, _, what = name.rpartition("-")
    print(f"| {case} | {what} | " + " | ".join(cells) + f" | {ok} of {len(CHECKED)} |")
