"""The table benches/gpu/run.sh prints last and writes to summary.txt: every goal of the GPU check
beside what was measured, from the files the run left in WORK.

    python3 summarize.py WORK PEAK_TFLOPS
"""
import json
import os
import sys

work, peak = sys.argv[1], float(sys.argv[2])
out = []


def say(line=""):
    out.append(line)


def lines(name):
    path = os.path.join(work, name)
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def text(name):
    path = os.path.join(work, name)
    return open(path).read().strip() if os.path.exists(path) else ""


def bench(name):
    path = os.path.join(work, name)
    if not os.path.exists(path):
        return {}
    try:
        report = json.load(open(path))
    except ValueError:
        return {}
    return {(r["batch_size"], r["tokens_per_row"]): r | {"gflop_per_token": report["gflop_per_token"]}
            for r in report.get("results", [])}


# The first run on a GPU (main at 1ec2907, H200, 2026-12-04), for comparison.
BASELINE = {("4B", 1, 512): 16262, ("4B", 32, 512): 20289, ("4B", 256, 512): 20165,
            ("0.6B", 1, 512): 30240, ("0.6B", 32, 512): 60241, ("0.6B", 256, 512): 61768,
            ("0.6B", 1, 8192): 5937}
verdicts = []


def goal(name, ok, detail):
    verdicts.append((name, "MET" if ok else ("unmeasured" if ok is None else "MISSED"), detail))


say(f"== GPU check: {text('gpu.txt') or 'unknown card'} ==")
say(text("peak.txt"))
say()
kernel_line = (text("kernels.txt").splitlines() or ["not run"])[-1]
say("-- kernels: " + kernel_line)
goal("kernel-check passes on the device", None if kernel_line == "not run" else kernel_line.endswith(" 0 failed"), kernel_line)
say()
say("-- correctness (the GPU against the CPU's f32 path)")
say(text("correctness.txt") or "not run")
# The attention path of every engine the correctness part started on the device.
paths = {}
for e in lines("log.jsonl"):
    f = e.get("fields", e)
    if f.get("message") == "model loaded" and f.get("device", "cpu") != "cpu":
        paths.setdefault(f.get("dtype"), set()).add(f.get("attention"))
        if f.get("attention_fallback"):
            say(f"attention fallback ({f.get('dtype')}): {f['attention_fallback']}")
say("attention paths on the device: " + (", ".join(f"{k} {sorted(v)}" for k, v in sorted(paths.items())) or "none seen"))
half = [v for k, v in paths.items() if k in ("bf16", "f16")]
goal("packed attention runs in bf16 and f16 on the device",
     (len(half) == 2 and all(v == {"packed"} for v in half)) if paths else None,
     ", ".join(f"{k}: {'/'.join(sorted(v))}" for k, v in sorted(paths.items())) or "no engine seen")
say()
say("-- throughput: ours against torch SDPA on the same shapes (random weights, bf16)")
say(f"{'shapes':<6} {'rows x tokens':>14} {'ours tok/s':>11} {'torch tok/s':>12} {'ours/torch':>10} {'% peak':>7} {'batch ms':>9} {'1ec2907':>8}")
torch_rows = {}
for label in ("0.6b", "4b"):
    for r in lines(f"torch-{label}.jsonl"):
        if "tokens_per_s" in r:
            torch_rows[(label, r["batch_size"], r["tokens_per_row"])] = r
measured = {}
for label, name in (("0.6b", "0.6B"), ("4b", "4B")):
    ours = bench(f"bench-{label}-512.json") | bench(f"bench-{label}-long.json")
    for (rows, tokens), r in sorted(ours.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        t = torch_rows.get((label, rows, tokens))
        ratio = r["tokens_per_s"] / t["tokens_per_s"] if t else None
        pct = 100 * r["tflops"] / peak
        measured[(name, rows, tokens)] = (r, ratio, pct)
        base = BASELINE.get((name, rows, tokens))
        shape = f"{rows} x {tokens}"
        theirs = "%.0f" % t["tokens_per_s"] if t else "-"
        times = "%.2f" % ratio if ratio else "-"
        then = str(base) if base else "-"
        say(f"{name:<6} {shape:>14} {r['tokens_per_s']:>11.0f} {theirs:>12} {times:>10} "
            f"{pct:>6.1f}% {r['batch_ms']:>9.1f} {then:>8}")


def ratio_goal(name, rows, tokens, want):
    m = measured.get((name, rows, tokens))
    if not m or m[1] is None:
        goal(f"{name} x {rows} >= {want}x torch", None, "no measurement")
    else:
        goal(f"{name} x {rows} >= {want}x torch", m[1] >= want, f"{m[1]:.2f}x")


ratio_goal("4B", 32, 512, 1.5)
ratio_goal("0.6B", 32, 512, 1.5)
long4b = [v for k, v in measured.items() if k[0] == "4B" and k[2] >= 8192]
if long4b:
    best = max(v[2] for v in long4b)
    goal("4B at 8192-token rows >= 35% of peak", best >= 35, f"{best:.1f}%")
else:
    goal("4B at 8192-token rows >= 35% of peak", None, "no measurement")
for name, ms in (("4B", 31), ("0.6B", 17)):
    m = measured.get((name, 1, 512))
    if m:
        goal(f"{name} batch-1 latency <= {ms} ms", m[0]["batch_ms"] <= ms, f"{m[0]['batch_ms']:.1f} ms")
    else:
        goal(f"{name} batch-1 latency <= {ms} ms", None, "no measurement")

say()
say("-- serve against the one-shot embed (0.6B shapes, the same texts, model and device)")
one = lines("oneshot.jsonl")
served = lines("serve.jsonl")
if one and "tokens_per_s" in one[-1]:
    base = one[-1]["tokens_per_s"]
    say(f"one-shot embed: {base:.0f} tok/s ({one[-1].get('tokens', 0)} tokens in {one[-1].get('seconds', 0):.2f} s)")
    best = 0.0
    for s in served:
        if "tokens_per_s" not in s:
            say(f"serve {s.get('setting', '')}: {s.get('error', 'failed')}")
            continue
        ratio = s["tokens_per_s"] / base
        best = max(best, ratio) if s.get("setting", "").startswith("defaults") else best
        say(f"serve {s.get('setting', ''):<28} {s['clients']:>3} clients: {s['tokens_per_s']:>9.0f} tok/s = {ratio:.2f} of one-shot"
            f" ({s['requests']} requests, {s['failures']} failed)")
    goal("serve >= 0.85 of the one-shot (defaults)", best >= 0.85 if served else None, f"{best:.2f}")
else:
    say("not run" if not one else f"one-shot failed: {one[-1]}")
    goal("serve >= 0.85 of the one-shot (defaults)", None, "no measurement")

say()
say("-- every pinned Qwen3 manifest, started with its defaults (random weights of its shapes)")
starts = lines("manifests.jsonl")
for m in starts:
    if m.get("started"):
        say(f"{m['id']:<22} started in {m['seconds']:.1f} s: max_batch_tokens {m.get('max_batch_tokens')} "
            f"({m.get('source')}), warm-up {m.get('warmup_rows')} rows, attention {m.get('attention')}")
    else:
        say(f"{m['id']:<22} DID NOT START: {m.get('error', '')[:300]}")
goal("every manifest starts", all(m.get("started") for m in starts) if len(starts) == 6 else None,
     f"{sum(1 for m in starts if m.get('started'))} of {len(starts)}")

ncu = text("ncu-summary.txt")
if ncu:
    say()
    say("-- where the GPU time goes (ncu, 0.6B shapes, 32 x 512)")
    say(ncu)

say()
say("-- goals")
for name, verdict, detail in verdicts:
    say(f"{verdict:<10} {name:<44} {detail}")
print("\n".join(out))
