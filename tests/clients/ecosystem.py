"""Drives the server through the unchanged official Python clients and checks what they return.

Owns the client-side half of the ecosystem test: openai, cohere (ClientV2), huggingface_hub
(InferenceClient), ollama and langchain-openai, each used through its public API only, each
result compared with reference data that the Rust test computed itself (refs.json: texts,
document/query vectors, rerank order and scores). Wire facts: shared/reference/client-apis.md.

Usage: ecosystem.py --base-url http://127.0.0.1:PORT --refs refs.json [--timeout S]
Prints one JSON line per check ({"check","ok"[,"detail"]}), then {"summary":{"passed","failed"}};
exits 0 iff every check passed. Never hangs: each client has a timeout and no retries, and a
global deadline fails whatever has not run by then. Run it with the venv that
scripts/client-sdks.sh makes; TIKTOKEN_CACHE_DIR defaults to <venv>/tiktoken_cache.
"""

import argparse
import base64
import json
import math
import os
import signal
import struct
import sys
import time

os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(sys.prefix, "tiktoken_cache"))
os.environ.pop("HF_HUB_OFFLINE", None)  # it refuses even a loopback URL; InferenceClient(model=URL) needs no hub
os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))

import cohere  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
from huggingface_hub import InferenceClient  # noqa: E402
from huggingface_hub.errors import HfHubHTTPError  # noqa: E402
from langchain_openai import OpenAIEmbeddings  # noqa: E402

DEADLINE = 50  # seconds, whole run
MIN_COS = 0.99999
TOKEN_HINT = "check_embedding_ctx_length=False"
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


class Deadline(Exception):
    pass


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / (math.hypot(*a) * math.hypot(*b))


def unit_prefix(v, k):
    n = math.hypot(*v[:k])
    return [x / n for x in v[:k]]


def same_vectors(got, want, dims=None):
    """Raises unless got (a list of vectors) matches want row by row."""
    got = [list(map(float, v)) for v in got]
    assert len(got) == len(want), f"{len(got)} vectors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == (dims or len(w)), f"vector {i}: {len(g)} dims, expected {dims or len(w)}"
        c = cos(g, w)
        assert c >= MIN_COS, f"vector {i}: cosine {c:.7f} < {MIN_COS}"


def b64_f32(s):
    raw = base64.b64decode(s, validate=True)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def raises(exc_type, fn):
    """Returns the exception fn raises, which must be an exc_type."""
    try:
        got = fn()
    except exc_type as e:
        return e
    raise AssertionError(f"expected {exc_type.__name__}, got a result: {str(got)[:200]}")


def near(a, b, tol, what):
    assert abs(a - b) <= tol, f"{what}: {a} vs {b} (tol {tol})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--refs", required=True)
    ap.add_argument("--timeout", type=float, default=20, help="seconds per request (default 20)")
    args = ap.parse_args()
    base = args.base_url.rstrip("/")
    with open(args.refs) as f:
        refs = json.load(f)
    texts, docs, queries = refs["texts"], refs["document_vectors"], refs["query_vectors"]
    rr = refs["rerank"]
    timeout = args.timeout

    # The SDKs that must send a key send the placeholder every OpenAI-compatible server
    # documents: with no client token and no required project key it is no key at all
    # (project 'default'). A project key that was rotated is 401, never 'default'.
    key = "EMPTY"
    oa = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=timeout)
    co = cohere.ClientV2(base_url=base, api_key=key, timeout=timeout, max_retries=0)
    hf = InferenceClient(model=base, timeout=timeout)
    hf_embed = InferenceClient(model=base + "/embed", timeout=timeout)
    ol = ollama.Client(host=base, timeout=timeout)

    def lc(**kw):
        return OpenAIEmbeddings(model="embedding", base_url=base + "/v1", api_key=key,
                                max_retries=0, timeout=timeout, **kw)

    # --- openai
    @check
    def openai_rotated_key_is_refused():
        rotated = os.environ["FANTOM_ROTATED_KEY"]
        stranger = openai.OpenAI(base_url=base + "/v1", api_key=rotated, max_retries=0,
                                 timeout=timeout)
        try:
            stranger.embeddings.create(model="embedding", input=texts[:1])
        except openai.AuthenticationError as e:
            assert rotated not in str(e) and rotated[4:12] not in str(e), "the key was echoed"
            return
        raise AssertionError("a rotated key was served")

    @check
    def openai_placeholder_key_is_no_key():
        for placeholder in ("unused", "sk-no-key-required"):
            anyone = openai.OpenAI(base_url=base + "/v1", api_key=placeholder, max_retries=0,
                                   timeout=timeout)
            r = anyone.embeddings.create(model="embedding", input=texts[:1])
            assert len(r.data) == 1, f"{placeholder}: {r}"

    @check
    def openai_embed_base64():
        r = oa.embeddings.create(model="embedding", input=texts)
        assert [d.index for d in r.data] == list(range(len(texts))), "data not in input order"
        same_vectors([d.embedding for d in r.data], docs)

    @check
    def openai_embed_float():
        r = oa.embeddings.create(model="embedding", input=texts, encoding_format="float")
        assert [d.index for d in r.data] == list(range(len(texts))), "data not in input order"
        assert all(isinstance(d.embedding, list) for d in r.data), "embedding is not a float list"
        same_vectors([d.embedding for d in r.data], docs)

    @check
    def openai_embed_dimensions_128():
        r = oa.embeddings.create(model="embedding", input=texts, dimensions=128)
        got = [d.embedding for d in r.data]
        same_vectors(got, [unit_prefix(v, 128) for v in docs], dims=128)
        for i, v in enumerate(got):
            near(math.hypot(*v), 1.0, 1e-4, f"norm of vector {i}")

    def token_ids_refused(inp):
        e = raises(openai.BadRequestError, lambda: oa.embeddings.create(model="embedding", input=inp))
        assert TOKEN_HINT in str(e), f"message lacks {TOKEN_HINT}: {e}"
        assert e.code == "token_ids_refused", f"code {e.code!r}"

    @check
    def openai_token_id_batch_refused():
        token_ids_refused([[1, 2, 3]])

    @check
    def openai_token_ids_refused():
        token_ids_refused([1, 2, 3])

    @check
    def openai_models_list():
        ids = {m.id for m in oa.models.list()}
        missing = {"embedding", "code-embedding", "reranker"} - ids
        assert not missing, f"missing {sorted(missing)} in {sorted(ids)}"

    @check
    def openai_models_retrieve():
        got = oa.models.retrieve("embedding").id
        assert got == "embedding", f"id {got!r}"

    @check
    def openai_models_retrieve_unknown():
        raises(openai.NotFoundError, lambda: oa.models.retrieve("no-such-role"))

    @check
    def openai_unknown_role_error():
        # OpenAI answers a model it does not serve with 404 model_not_found.
        e = raises(openai.NotFoundError, lambda: oa.embeddings.create(model="nope", input="x"))
        msg = e.body.get("message") if isinstance(e.body, dict) else None
        assert msg, f"no error.message in body {e.body!r}"
        assert e.code == "model_not_found", f"error.code in body {e.body!r}"

    # --- cohere
    def co_embed(input_type, types):
        return co.embed(texts=texts, model="embedding", input_type=input_type, embedding_types=types).embeddings

    @check
    def cohere_embed_document():
        same_vectors(co_embed("search_document", ["float"]).float_, docs)

    @check
    def cohere_embed_query():
        same_vectors(co_embed("search_query", ["float"]).float_, queries)

    @check
    def cohere_embed_base64():
        same_vectors([b64_f32(s) for s in co_embed("search_document", ["base64"]).base64], docs)

    @check
    def cohere_embed_every_type():
        # Every type in one request, each answered; the cohere SDK reads them all.
        import numpy as np
        e = co_embed("search_document", ["float", "base64", "int8", "uint8", "binary", "ubinary"])
        same_vectors(e.float_, docs)
        same_vectors([b64_f32(s) for s in e.base64], docs)
        f = np.array(e.float_, dtype=np.float64)
        i8 = np.array(e.int8, dtype=np.int64)
        assert i8.shape == f.shape and i8.min() >= -128 and i8.max() <= 127, i8.shape
        assert (np.array(e.uint8) == i8 + 128).all(), "uint8 is int8 + 128"
        # Sign bits, most significant first, zero-padded to whole bytes.
        want = np.packbits(f > 0, axis=1)
        assert (np.array(e.ubinary) == want).all(), "ubinary is the packed sign bits"
        assert (np.array(e.binary) == want.astype(np.int64) - 128).all(), "binary is ubinary - 128"
        c = (i8 * f).sum(1) / np.linalg.norm(i8, axis=1) / np.linalg.norm(f, axis=1)
        assert c.min() >= 0.99, f"int8 cosine {c.min():.5f}"
        # One scale per space and width: the same text gives the same codes in another request.
        again = co.embed(texts=texts[:1], model="embedding", input_type="search_document",
                         embedding_types=["int8"]).embeddings.int8
        assert list(again[0]) == list(e.int8[0]), "int8 codes of one space are comparable"

    @check
    def cohere_quantized_types_keep_the_ranking():
        # A committed query/document set the scale never saw: dequantized int8 stays within a
        # cosine of 0.99 of the floats, and the floats' best document is in the top 10 by
        # Hamming distance on the sign bits for at least 90 % of the queries.
        import numpy as np
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "..", "fixtures", "quantization", "eval_set.json")) as fh:
            qs = json.load(fh)
        types = ["float", "int8", "ubinary"]
        d = co.embed(texts=qs["documents"], model="embedding", input_type="search_document",
                     embedding_types=types).embeddings
        q = co.embed(texts=[x["text"] for x in qs["queries"]], model="embedding",
                     input_type="search_query", embedding_types=types).embeddings
        for name, e in (("documents", d), ("queries", q)):
            f = np.array(e.float_, dtype=np.float64)
            i8 = np.array(e.int8, dtype=np.float64)
            c = (i8 * f).sum(1) / np.linalg.norm(i8, axis=1) / np.linalg.norm(f, axis=1)
            assert c.min() >= 0.99, f"{name}: int8 cosine {c.min():.5f}"
        df, qf = np.array(d.float_), np.array(q.float_)
        best = (qf @ df.T).argmax(1)
        db = np.unpackbits(np.array(d.ubinary, dtype=np.uint8), axis=1)
        qb = np.unpackbits(np.array(q.ubinary, dtype=np.uint8), axis=1)
        hamming = (qb[:, None, :] != db[None, :, :]).sum(2)
        within = 0
        for i, b in enumerate(best):
            # Ties count against it: every other document at most as far is ahead of it.
            ahead = int((hamming[i] <= hamming[i, b]).sum()) - 1
            within += ahead < 10
        share = within / len(best)
        assert share >= 0.9, f"float top-1 in the Hamming top 10 for {share:.0%} of queries"

    @check
    def openai_quantized_types_are_an_extension_beside_embedding():
        r = oa.embeddings.create(model="embedding", input=texts[:2],
                                 extra_body={"embedding_types": ["int8", "ubinary"]})
        same_vectors([d.embedding for d in r.data], docs[:2])
        by_type = [getattr(d, "embeddings_by_type", None) for d in r.data]
        assert all(isinstance(b, dict) for b in by_type), f"embeddings_by_type: {by_type!r}"[:300]
        cohere_codes = co_embed("search_document", ["int8"]).int8[:2]
        assert [b["int8"] for b in by_type] == [list(c) for c in cohere_codes], \
            "the same codes as Cohere's route"
        assert all(len(b["ubinary"]) == len(docs[0]) // 8 for b in by_type)
        e = raises(openai.BadRequestError, lambda: oa.embeddings.create(
            model="embedding", input="x", extra_body={"embedding_types": ["float"]}))
        assert "encoding_format" in str(e), str(e)

    @check
    def tei_embed_refuses_embedding_types():
        import requests
        r = requests.post(base + "/embed", json={"inputs": "x", "embedding_types": ["int8"]},
                          timeout=timeout)
        assert r.status_code == 400, (r.status_code, r.text)
        assert "/v2/embed" in r.text, r.text

    @check
    def cohere_rerank_top3():
        r = co.rerank(model="reranker", query=rr["query"], documents=rr["documents"], top_n=3)
        got = [x.index for x in r.results]
        assert got == rr["order"][:3], f"order {got}, expected {rr['order'][:3]}"
        for x in r.results:
            near(x.relevance_score, rr["scores"][x.index], 1e-4, f"relevance_score of document {x.index}")

    # --- huggingface_hub
    @check
    def hf_feature_extraction_one():
        a = hf.feature_extraction(texts[0])
        same_vectors(a.reshape(1, -1), docs[:1])

    @check
    def hf_feature_extraction_batch():
        a = hf.feature_extraction(texts)
        assert a.shape == (len(texts), refs["dims"]), f"shape {a.shape}"
        same_vectors(a, docs)

    @check
    def hf_feature_extraction_embed_url():
        a = hf_embed.feature_extraction(texts[0], normalize=True)
        same_vectors(a.reshape(1, -1), docs[:1])

    @check
    def hf_sentence_similarity():
        got = hf.sentence_similarity(texts[0], other_sentences=texts[1:4])
        want = [cos(docs[0], v) for v in docs[1:4]]
        assert len(got) == len(want), f"{len(got)} scores, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            near(g, w, 1e-4, f"similarity {i}")

    @check
    def hf_text_classification_refused():
        e = raises(HfHubHTTPError, lambda: hf.text_classification("some text"))
        assert "/rerank" in str(e), f"message does not point to /rerank: {e}"

    @check
    def hf_rerank_method_absent():
        # InferenceClient has no rerank; a reranker is only reachable by hand (POST /rerank).
        assert not hasattr(InferenceClient, "rerank"), "InferenceClient grew a rerank method: test it"

    # --- ollama
    @check
    def ollama_embed_role():
        same_vectors(ol.embed(model="embedding", input=texts).embeddings, docs)

    @check
    def ollama_embed_model_id():
        same_vectors(ol.embed(model=refs["embedding_model"], input=texts[0]).embeddings, docs[:1])

    @check
    def ollama_embed_unknown_model():
        e = raises(ollama.ResponseError, lambda: ol.embed(model="nope", input="x"))
        assert e.status_code == 404, f"status {e.status_code}"

    # --- langchain-openai
    @check
    def langchain_embed_documents():
        same_vectors(lc(check_embedding_ctx_length=False).embed_documents(texts), docs)

    @check
    def langchain_embed_query():
        same_vectors([lc(check_embedding_ctx_length=False).embed_query(texts[0])], queries[:1])

    @check
    def langchain_default_token_ids_refused():
        e = raises(openai.BadRequestError, lambda: lc().embed_documents(texts))
        assert TOKEN_HINT in str(e), f"message lacks {TOKEN_HINT}: {e}"

    def on_alarm(*_):
        raise Deadline(f"global deadline of {DEADLINE} s passed")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(DEADLINE)
    start, passed, failed = time.monotonic(), 0, 0
    for fn in CHECKS:
        name = fn.__name__.replace("_", ".", 1)
        if time.monotonic() - start >= DEADLINE:
            res = {"check": name, "ok": False, "detail": "not run: global deadline passed"}
        else:
            try:
                fn()
                res = {"check": name, "ok": True}
            except Exception as e:  # noqa: BLE001 - one failing check must not stop the others
                res = {"check": name, "ok": False, "detail": f"{type(e).__name__}: {e}"[:2000]}
        passed, failed = passed + res["ok"], failed + (not res["ok"])
        print(json.dumps(res), flush=True)
    signal.alarm(0)
    print(json.dumps({"summary": {"passed": passed, "failed": failed}}), flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
