"""Aggregate `ncu --csv --page raw` (gpu__time_duration.sum per launch) by kernel name: the top 25 with their share of GPU time (benches/gpu/run.sh)."""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h = rows[hdr]; k = h.index("Kernel Name"); t = h.index("gpu__time_duration.sum")
agg = collections.defaultdict(lambda: [0, 0.0])
for r in rows[hdr + 2:]:
    try: v = float(r[t].replace(",", ""))
    except (ValueError, IndexError): continue
    a = agg[r[k][:90]]; a[0] += 1; a[1] += v
tot = sum(a[1] for a in agg.values())
print(f"{len(agg)} kernels, {sum(a[0] for a in agg.values())} launches, {tot/1e6:.1f} ms total (units as ncu reports: ns)")
for name, (n, v) in sorted(agg.items(), key=lambda x: -x[1][1])[:25]:
    print(f"{100*v/tot:5.1f}%  {v/1e6:8.2f} ms  {n:6d}x  {name}")
