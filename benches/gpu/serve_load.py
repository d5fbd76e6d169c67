"""Load from outside for benches/gpu/run.sh: CLIENTS threads post the texts of TEXTS (a JSON
string per line, the file read REPEAT times) to an OpenAI-compatible /v1/embeddings, BATCH texts
a request, with encoding_format base64 as the OpenAI SDK sends it, until every text is embedded.
One warm-up request first (it waits for the gate's first fingerprint); then prints one JSON line:
texts, prompt tokens (from the answers' usage), seconds, tokens_per_s, requests, failures.

    python3 serve_load.py URL TEXTS REPEAT BATCH CLIENTS [MODEL]

Standard library only.
"""
import json
import sys
import threading
import time
import urllib.request

url, path, repeat, batch, clients = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = sys.argv[6] if len(sys.argv) > 6 else "code-embedding"
texts = [json.loads(line) for line in open(path) if line.strip()] * repeat
chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]


def post(inputs):
    body = json.dumps({"model": model, "input": inputs, "encoding_format": "base64"}).encode()
    req = urllib.request.Request(url + "/v1/embeddings", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.load(r)
    if len(answer.get("data", [])) != len(inputs):
        raise RuntimeError("an answer without a vector per input")
    return answer["usage"]["prompt_tokens"]


deadline = time.time() + 120
while True:
    try:
        post(["warm-up: fn main() {}"])
        break
    except Exception as e:  # noqa: BLE001 - not ready yet
        if time.time() > deadline:
            print(json.dumps({"error": f"no answer to the warm-up request: {e}"}))
            sys.exit(1)
        time.sleep(0.5)

lock = threading.Lock()
state = {"next": 0, "tokens": 0, "requests": 0, "failures": 0}


def worker():
    while True:
        with lock:
            i = state["next"]
            state["next"] += 1
        if i >= len(chunks):
            return
        try:
            n = post(chunks[i])
            with lock:
                state["tokens"] += n
                state["requests"] += 1
        except Exception:  # noqa: BLE001 - counted
            with lock:
                state["failures"] += 1


t0 = time.perf_counter()
threads = [threading.Thread(target=worker) for _ in range(clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()
dt = time.perf_counter() - t0
print(json.dumps({"texts": len(texts), "batch": batch, "clients": clients, "tokens": state["tokens"],
                  "seconds": dt, "tokens_per_s": state["tokens"] / dt, "requests": state["requests"],
                  "failures": state["failures"]}))
