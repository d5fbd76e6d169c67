"""The ordinary alternative on the same work, for benches/gpu/run.sh: transformers' Qwen3Model in
torch (bf16, SDPA attention) with random weights of a config's shapes, rows of TOKENS random ids,
last-token pooling + L2 norm, the vectors copied to the host, as `fantom-sidecar bench` does.

    python3 torch_peer.py CONFIG SHAPES SECONDS LABEL      # SHAPES: ROWSxTOKENS,... e.g. 1x512,32x512

Prints one JSON line per batch size (tokens_per_s, batch_ms, peak memory); a size that does not
fit prints {"error": ...} and the next one runs. Needs torch with CUDA and transformers; prints one
{"error": ...} line and exits 0 when they are missing, so the GPU check goes on without its peer.
"""
import json
import sys
import time

cfg_path, shapes, secs, label = (
    sys.argv[1],
    [tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")],
    float(sys.argv[3]),
    sys.argv[4],
)
try:
    import torch
    from transformers import Qwen3Config, Qwen3Model
except Exception as e:  # noqa: BLE001 - any import failure means no peer here
    print(json.dumps({"model": label, "error": f"no torch/transformers: {e}"}))
    sys.exit(0)

raw = json.load(open(cfg_path))
cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")})
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
with torch.device("cuda"):
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3Model(cfg).eval()
torch.set_default_dtype(torch.float32)
g = torch.Generator(device="cuda").manual_seed(1)
peer = f"torch {torch.__version__} transformers sdpa"


@torch.inference_mode()
def step(n, tokens):
    ids = torch.randint(0, cfg.vocab_size, (n, tokens), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return torch.nn.functional.normalize(h[:, -1].float(), dim=-1).cpu()


for n, tokens in shapes:
    try:
        torch.cuda.reset_peak_memory_stats()
        step(n, tokens)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        k = 0
        while k < 3 or time.perf_counter() - t0 < secs:
            step(n, tokens)
            k += 1
        dt = time.perf_counter() - t0
        print(json.dumps({"peer": peer, "model": label, "batch_size": n, "tokens_per_row": tokens,
                          "batches": k, "tokens_per_s": k * n * tokens / dt, "batch_ms": dt * 1e3 / k,
                          "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
    except Exception as e:  # noqa: BLE001 - an OOM or a kernel limit: report and go on
        print(json.dumps({"peer": peer, "model": label, "batch_size": n, "tokens_per_row": tokens,
                          "error": str(e).splitlines()[0][:200]}), flush=True)
        torch.cuda.empty_cache()
