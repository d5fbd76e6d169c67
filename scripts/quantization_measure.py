#!/usr/bin/env python3
"""Measure int8 / binary quantization of embeddings against float, on the committed evaluation set.

Embeddings come either from a running server (`--base-url`, POST /v1/embeddings in the OpenAI shape,
with `dimensions` for each Matryoshka width below the native one) or from a JSON written earlier with
`--save-embeddings` (`--embeddings`). Needs numpy (and requests for `--base-url`).

    python scripts/quantization_measure.py --base-url http://127.0.0.1:8090 \
        --save-embeddings /tmp/emb.json --json-out /tmp/quant.json
    python scripts/quantization_measure.py --embeddings /tmp/emb.json

The inputs are tests/fixtures/quantization/eval_set.json (queries, each with the index of its best
document, and documents) and tests/fixtures/quantization/calibration.json (texts embedded once per
space to derive ranges; none is in the evaluation set).

Options measured for int8 (uint8 is the same code + 128 for the symmetric ones):
  sym r=1          q = clamp(round_half_away(v * 127 / r), -128, 127), r = 1 (bound of a unit vector)
  sym r=k/sqrt(d)  same, r = k / sqrt(d) for k in 4, 6, 8
  st per-dim       sentence-transformers quantize_embeddings with calibration ranges:
                   starts = min, steps = (max - min) / 255, int8 = trunc((v - starts) / steps - 128)
                   (numpy astype truncates toward zero; values outside the range are clamped here,
                   where numpy's cast would wrap); dequantized at the middle of the bucket
  st floor         the same with floor instead of trunc (equal-width buckets; = uint8 - 128)
  calib max|v|     symmetric, r = max |v| over the calibration vectors (x1.0, x1.1)
  calib p99.9      symmetric, r = 99.9th percentile of |v| over the calibration components (x1.0, x1.1)
  fingerprint x1.5 symmetric, r = min(1, 1.5 x max |v|) over the gate's 12 probe texts at the width
                   (what the hub does: src/quantize.rs; the probe texts are read from
                   src/hub/gate/measure.rs)
Binary: ubinary = sign bits (v > 0) packed MSB-first per vector, zero-padded to a whole byte;
binary = ubinary - 128 as int8. Retrieval compares codes by Hamming distance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "quantization"


# ---------------------------------------------------------------- embeddings


def embed_server(base_url: str, model: str, texts: list[str], dims: int | None, batch: int = 64) -> np.ndarray:
    import requests

    out = []
    for i in range(0, len(texts), batch):
        body = {"model": model, "input": texts[i : i + batch]}
        if dims is not None:
            body["dimensions"] = dims
        r = requests.post(base_url.rstrip("/") + "/v1/embeddings", json=body, timeout=600)
        r.raise_for_status()
        data = sorted(r.json()["data"], key=lambda d: d["index"])
        out.extend(d["embedding"] for d in data)
    return np.asarray(out, dtype=np.float64)


def probe_texts() -> list[str]:
    """The gate's probe texts, read from their Rust source (src/hub/gate/measure.rs)."""
    import re

    src = (ROOT / "src" / "hub" / "gate" / "measure.rs").read_text()
    literal = r'"((?:[^"\\]|\\.)*)"'
    long_parts = re.search(r"let long = \[(.*?)\]\s*\.join", src, re.S).group(1)
    long = " ".join(json.loads(f'"{p}"') for p in re.findall(literal, long_parts))
    rest = re.search(r"let long = format.*?\n\s*\[(.*?)long\.as_str\(\)", src, re.S).group(1)
    return [json.loads(f'"{p}"') for p in re.findall(literal, rest)] + [f"{long} {long} {long}"]


def load_embeddings(args, eval_set, calib) -> dict[int, dict[str, np.ndarray]]:
    if args.embeddings:
        raw = json.loads(Path(args.embeddings).read_text())
        return {int(w): {k: np.asarray(v, dtype=np.float64) for k, v in parts.items()} for w, parts in raw.items()}
    queries = [q["text"] for q in eval_set["queries"]]
    docs = eval_set["documents"]
    groups = (("queries", queries), ("documents", docs), ("calibration", calib), ("probes", probe_texts()))
    full = {k: embed_server(args.base_url, args.model, t, None) for k, t in groups}
    native = full["queries"].shape[1]
    widths = [w for w in args.widths if w < native]
    out = {native: full}
    for w in widths:
        out[w] = {k: embed_server(args.base_url, args.model, t, w) for k, t in groups}
        # the server's `dimensions` must equal truncation + renormalisation of the full vector
        for k in out[w]:
            t = full[k][:, :w]
            t = t / np.linalg.norm(t, axis=1, keepdims=True)
            diff = float(np.abs(t - out[w][k]).max())
            if diff > 1e-4:
                print(f"warning: width {w} {k}: server vs local truncation differ by {diff:.2e}", file=sys.stderr)
    if args.save_embeddings:
        Path(args.save_embeddings).write_text(json.dumps(
            {str(w): {k: v.tolist() for k, v in parts.items()} for w, parts in out.items()}))
    return out


# ---------------------------------------------------------------- quantizers


def round_half_away(x: np.ndarray) -> np.ndarray:
    # Rust's f32::round: halves go away from zero (numpy's round goes to even)
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def sym_quant(v: np.ndarray, r: float):
    """Symmetric int8: codes, dequantized vectors, clipped-component mask."""
    x = round_half_away(v * 127.0 / r)
    clipped = (x < -128) | (x > 127)
    q = np.clip(x, -128, 127)
    return q.astype(np.int8), q * (r / 127.0), clipped


def st_quant(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, mode: str):
    """sentence-transformers int8 with per-dimension ranges (mode trunc = ST's astype, floor = equal buckets)."""
    starts = lo
    steps = (hi - lo) / 255.0
    u = (v - starts) / steps  # bucket coordinate, 0..255 inside the calibration range
    x = np.trunc(u - 128.0) if mode == "trunc" else np.floor(u) - 128.0
    clipped = (x < -128) | (x > 127)
    q = np.clip(x, -128, 127)
    if mode == "trunc":
        # trunc toward zero: code c > 0 covers u in [c+128, c+129), c < 0 covers (c+127, c+128],
        # c = 0 covers (127, 129); dequantize at the middle of the bucket
        mid = np.where(q > 0, q + 128.5, np.where(q < 0, q + 127.5, 128.0))
    else:
        mid = q + 128.5
    return q.astype(np.int8), starts + mid * steps, clipped


def ubinary(v: np.ndarray) -> np.ndarray:
    # np.packbits on axis 1: MSB first, the last byte zero-padded when d % 8 != 0
    return np.packbits(v > 0, axis=1)


def binary(v: np.ndarray) -> np.ndarray:
    return (ubinary(v).astype(np.int16) - 128).astype(np.int8)


POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return POPCOUNT[np.bitwise_xor(a[:, None, :], b[None, :, :])].sum(axis=2)


# ---------------------------------------------------------------- metrics


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(unit(a) * unit(b), axis=1)


def top1(scores: np.ndarray) -> np.ndarray:
    return np.argmax(scores, axis=1)


def measure_width(emb: dict[str, np.ndarray], best: np.ndarray) -> dict:
    Q, D, C = emb["queries"], emb["documents"], emb["calibration"]
    d = Q.shape[1]
    E = np.vstack([Q, D])  # every evaluation vector
    f_scores = Q @ D.T
    f_top = top1(f_scores)
    res = {"dims": d, "n_queries": len(Q), "n_documents": len(D), "n_calibration": len(C),
           "max_abs_eval": float(np.abs(E).max()), "max_abs_calibration": float(np.abs(C).max()),
           "float_top1_is_labelled_best_pct": 100.0 * float(np.mean(f_top == best)),
           "float_top1_mismatches": [int(i) for i in np.nonzero(f_top != best)[0]],
           "int8": {}}

    absC = np.abs(C)
    lo, hi = C.min(axis=0), C.max(axis=0)
    options = [("sym r=1", lambda v: sym_quant(v, 1.0), 1.0)]
    for k in (4, 6, 8):
        r = k / math.sqrt(d)
        options.append((f"sym r={k}/sqrt(d)", (lambda r: lambda v: sym_quant(v, r))(r), r))
    options.append(("st per-dim (trunc)", lambda v: st_quant(v, lo, hi, "trunc"), None))
    options.append(("st per-dim (floor)", lambda v: st_quant(v, lo, hi, "floor"), None))
    for name, base in (("calib max|v|", float(absC.max())), ("calib p99.9", float(np.percentile(absC, 99.9)))):
        for m in (1.0, 1.1):
            r = base * m
            options.append((f"{name} x{m}", (lambda r: lambda v: sym_quant(v, r))(r), r))
    if "probes" in emb:
        r = min(1.0, 1.5 * float(np.abs(emb["probes"]).max()))
        options.append(("fingerprint x1.5", (lambda r: lambda v: sym_quant(v, r))(r), r))

    for name, fn, r in options:
        qE, dqE, clipE = fn(E)
        cos = cos_rows(dqE, E)
        qQ, dqQ, _ = fn(Q)
        qD, dqD, _ = fn(D)
        code_scores = qQ.astype(np.int32) @ qD.astype(np.int32).T
        dq_scores = unit(dqQ) @ unit(dqD).T
        code_top = top1(code_scores)
        # rank of the float top-1 document under code dot products (ties count against)
        tgt = code_scores[np.arange(len(Q)), f_top]
        code_rank = (code_scores > tgt[:, None]).sum(axis=1)
        res["int8"][name] = {
            "r": r,
            "cos_min": float(cos.min()), "cos_p1": float(np.percentile(cos, 1)), "cos_mean": float(cos.mean()),
            "clip_component_pct": 100.0 * float(clipE.mean()),
            "clip_vector_pct": 100.0 * float(clipE.any(axis=1).mean()),
            "code_dot_top1_agree_pct": 100.0 * float(np.mean(code_top == f_top)),
            "code_dot_float_top1_in_top10_pct": 100.0 * float(np.mean(code_rank < 10)),
            "dequant_cos_top1_agree_pct": 100.0 * float(np.mean(top1(dq_scores) == f_top)),
        }

    bQ, bD = ubinary(Q), ubinary(D)
    H = hamming(bQ, bD)
    tgt = H[np.arange(len(Q)), f_top]
    strictly_better = (H < tgt[:, None]).sum(axis=1)
    ties = (H == tgt[:, None]).sum(axis=1) - 1
    res["binary"] = {
        "bytes": int(bQ.shape[1]),
        "float_top1_in_hamming_top10_pct": 100.0 * float(np.mean(strictly_better + ties < 10)),
        "float_top1_in_hamming_top10_optimistic_pct": 100.0 * float(np.mean(strictly_better < 10)),
        "hamming_top1_agree_pct": 100.0 * float(np.mean((strictly_better == 0) & (ties == 0))),
        "float_top1_in_hamming_top30_pct": 100.0 * float(np.mean(strictly_better + ties < 30)),
    }
    return res


def self_check() -> None:
    # packing: MSB first, zero-padded; binary = ubinary - 128
    v = np.zeros((1, 12))
    v[0, 0] = v[0, 9] = 1.0
    v[0, 11] = -1.0
    assert ubinary(v).tolist() == [[0b1000_0000, 0b0100_0000]], ubinary(v)
    assert binary(v).tolist() == [[0, -64]], binary(v)
    # ST trunc vs floor differ below bucket 128 (ST's int8 is not uint8 - 128 there)
    lo, hi = np.array([0.0]), np.array([255.0])
    assert st_quant(np.array([[100.5]]), lo, hi, "trunc")[0].tolist() == [[-27]]
    assert st_quant(np.array([[100.5]]), lo, hi, "floor")[0].tolist() == [[-28]]


def print_table(results: list[dict]) -> None:
    for res in results:
        print(f"\n== width {res['dims']}: {res['n_queries']} queries, {res['n_documents']} docs, "
              f"{res['n_calibration']} calibration; max|v| eval {res['max_abs_eval']:.4f}, "
              f"calibration {res['max_abs_calibration']:.4f}")
        print(f"float top-1 = labelled best: {res['float_top1_is_labelled_best_pct']:.1f}% "
              f"(mismatched queries: {res['float_top1_mismatches']})")
        print(f"{'int8 option':24} {'r':>7} {'cos min':>8} {'cos p1':>8} {'cos mean':>8} {'clip%c':>7} "
              f"{'clip%v':>7} {'codeT1%':>7} {'codeT10%':>8} {'dqT1%':>6}")
        for name, m in res["int8"].items():
            r = f"{m['r']:.4f}" if m["r"] is not None else "per-dim"
            print(f"{name:24} {r:>7} {m['cos_min']:8.5f} {m['cos_p1']:8.5f} {m['cos_mean']:8.5f} "
                  f"{m['clip_component_pct']:7.3f} {m['clip_vector_pct']:7.1f} {m['code_dot_top1_agree_pct']:7.1f} "
                  f"{m['code_dot_float_top1_in_top10_pct']:8.1f} {m['dequant_cos_top1_agree_pct']:6.1f}")
        b = res["binary"]
        print(f"binary ({b['bytes']} B): float top-1 in Hamming top-10 {b['float_top1_in_hamming_top10_pct']:.1f}% "
              f"(ties optimistic {b['float_top1_in_hamming_top10_optimistic_pct']:.1f}%), top-30 "
              f"{b['float_top1_in_hamming_top30_pct']:.1f}%, Hamming top-1 = float top-1 "
              f"{b['hamming_top1_agree_pct']:.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8090")
    src.add_argument("--embeddings", help="a JSON written by --save-embeddings")
    p.add_argument("--model", default="all-minilm-l6-v2")
    p.add_argument("--widths", default="128,64", help="Matryoshka widths below the native one (comma-separated)")
    p.add_argument("--save-embeddings", help="write the fetched embeddings here")
    p.add_argument("--json-out", help="write the results here")
    args = p.parse_args()
    args.widths = [int(w) for w in args.widths.split(",") if w]

    self_check()
    eval_set = json.loads((FIXTURES / "eval_set.json").read_text())
    calib = json.loads((FIXTURES / "calibration.json").read_text())
    best = np.array([q["best"] for q in eval_set["queries"]])
    embs = load_embeddings(args, eval_set, calib)
    results = [measure_width(embs[w], best) for w in sorted(embs, reverse=True)]
    print_table(results)
    if results[0]["float_top1_mismatches"]:
        print("\nqueries whose float top-1 (native width) is not the labelled best:")
        for i in results[0]["float_top1_mismatches"]:
            q = eval_set["queries"][i]
            Q, D = embs[results[0]["dims"]]["queries"], embs[results[0]["dims"]]["documents"]
            t = int(np.argmax(Q[i] @ D.T))
            print(f"  q{i} {q['text']!r}\n     best  {float(Q[i] @ D[q['best']]):.3f} {eval_set['documents'][q['best']][:90]!r}"
                  f"\n     top-1 {float(Q[i] @ D[t]):.3f} {eval_set['documents'][t][:90]!r}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
