#!/usr/bin/env python3
"""Check the Grafana dashboard and the Prometheus alert rules against live /metrics scrapes.

    python telemetry_check.py --dashboard monitoring/grafana/fantom-sidecar.json \
        --rules monitoring/prometheus/alerts.yml URL [URL ...]

Each URL (a hub's and an agent's /metrics) is fetched (urllib, 10 s timeout) and parsed with the
Prometheus Python client's OpenMetrics parser; a fetch or parse error fails the run, naming the URL.
From the scrapes it knows every sample name (`x_total`, `x_bucket`, ...) and, per name, the label
names seen on its samples. A family with no samples in the scrape (nothing happened yet) still
yields its names (by its type: counter -> `_total`, histogram -> `_bucket/_sum/_count`, ...), but
its labels cannot be verified, so label checks on it are skipped.

Then every PromQL expression is checked: the `expr` of every dashboard panel target (rows and their
nested panels included), the `label_values(...)`/`query_result(...)` template variable queries, and
every rule's `expr` (rules files: `groups: [{name, rules: [...]}]`). Each series an expression names
must be a scraped name (`fantom_*`, `process_*`; `up` is allowed and not checked; names recorded by
a `record:` rule in the rules file are allowed), and each label name in a `{...}` matcher, a
`by (...)`/`without (...)` clause (checked against the series aggregated) or an
`on (...)`/`ignoring (...)`/`group_left (...)`/`group_right (...)` clause (against the expression's
series) must be seen on a sample of one of those series. Always valid: `job` and `instance` (the
target labels Prometheus attaches when it scrapes), `__name__`, `le` on a `_bucket` series, and a
label an expression creates with `label_replace`/`label_join`.

Also: every alert rule has `alert`, `expr`, `for` (a duration), `labels.severity` and
`annotations.summary`; a `record:` rule has `expr`; group names are unique. Every dashboard panel
target queries the `${datasource}` template variable, which is a datasource variable of type
prometheus.

Exit 0 and one JSON line {"series_checked": N, "expressions": M, "families_scraped": K} (N distinct
series names checked, M expressions, K distinct metric families across the scrapes); exit 1 with one
line per problem on stderr otherwise. Needs only the standard library, prometheus_client and PyYAML.
"""

import argparse
import json
import re
import sys
import urllib.request

import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families

FETCH_TIMEOUT_S = 10
DATASOURCE_UID = "${datasource}"
# Labels Prometheus attaches to every series of a scrape (not in the exposition itself).
TARGET_LABELS = frozenset({"job", "instance"})
CHECKED_PREFIXES = ("fantom_", "process_")
ALWAYS_ALLOWED_SERIES = frozenset({"up"})

# Sample names of a family, by its OpenMetrics type (what Prometheus stores).
SUFFIXES_BY_TYPE = {
    "counter": ("_total",),
    "gauge": ("",),
    "unknown": ("",),
    "stateset": ("",),
    "info": ("_info",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
}

AGGREGATIONS = frozenset(
    """sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk
    limit_ratio""".split()
)
FUNCTIONS = frozenset(
    """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv double_exponential_smoothing end exp first_over_time floor
    histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev
    histogram_stdvar histogram_sum holt_winters hour idelta increase info irate label_join
    label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute
    month pi predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn
    sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt start stddev_over_time
    stdvar_over_time sum_over_time tan tanh time timestamp ts_of_first_over_time
    ts_of_last_over_time ts_of_max_over_time ts_of_min_over_time vector year""".split()
)
KEYWORDS = frozenset("and or unless bool offset atan2 inf nan".split())
BINARY_MODIFIERS = frozenset("on ignoring group_left group_right".split())

TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_]\w*|\[\[[A-Za-z_][\w:.]*\]\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[A-Za-z0-9_]*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=,@(){}\[\]])
    """,
    re.VERBOSE,
)
DURATION_RE = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")
PAIRS = {"(": ")", "{": "}", "[": "]"}


class ExprError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# scrapes


class Scrapes:
    def __init__(self):
        self.families = set()  # family names
        self.valid_names = set()  # sample names Prometheus would store
        self.labels = {}  # sample name -> label names seen (only names with samples)

    def add(self, url, text):
        try:
            families = list(text_string_to_metric_families(text))
        except Exception as e:  # the parser raises ValueError and friends
            why = str(e) or "(no message)"
            raise SystemExit(f"telemetry_check: FAIL: {url}: OpenMetrics parse error: {type(e).__name__}: {why}")
        for fam in families:
            self.families.add(fam.name)
            for suffix in SUFFIXES_BY_TYPE.get(fam.type, ("",)):
                self.valid_names.add(fam.name + suffix)
            for s in fam.samples:
                self.valid_names.add(s.name)
                self.labels.setdefault(s.name, set()).update(s.labels)


def fetch(url):
    req = urllib.request.Request(
        url, headers={"Accept": "application/openmetrics-text; version=1.0.0, text/plain;q=0.5"}
    )
    try:
        with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as resp:
            return resp.read().decode("utf-8")
    except Exception as e:
        raise SystemExit(f"telemetry_check: FAIL: {url}: fetch failed: {e}")


# ---------------------------------------------------------------------------------------------
# PromQL (only as far as names and label names go)


def tokenize(expr):
    toks, pos = [], 0
    while pos < len(expr):
        m = TOKEN_RE.match(expr, pos)
        if not m:
            raise ExprError(f"unexpected character {expr[pos]!r} at offset {pos}")
        kind = m.lastgroup
        if kind not in ("ws", "comment"):
            toks.append((kind, m.group(), pos))
        pos = m.end()
    return toks


def pair_brackets(toks):
    match, stack = {}, []
    for i, (kind, text, pos) in enumerate(toks):
        if kind != "op":
            continue
        if text in PAIRS:
            stack.append(i)
        elif text in (")", "}", "]"):
            if not stack or PAIRS[toks[stack[-1]][1]] != text:
                raise ExprError(f"unbalanced {text!r} at offset {pos}")
            match[stack.pop()] = i
    if stack:
        raise ExprError(f"unclosed {toks[stack[-1]][1]!r} at offset {toks[stack[-1]][2]}")
    return match


def unquote(s):
    return s[1:-1]


class Analysis:
    def __init__(self):
        self.selectors = []  # (name or None, [label names], token index)
        self.groupings = []  # (clause, [label names], start index, end index)
        self.created_labels = set()  # by label_replace / label_join


def analyse(expr):
    toks = tokenize(expr)
    match = pair_brackets(toks)
    n = len(toks)
    a = Analysis()

    def is_op(i, text):
        return i < n and toks[i][0] == "op" and toks[i][1] == text

    def label_list(i):
        """`( a, b, ... )` at i -> (names, index after the closing paren)."""
        if not is_op(i, "("):
            raise ExprError(f"expected '(' with a label list at offset {toks[i][2] if i < n else len(expr)}")
        names = []
        for kind, text, pos in toks[i + 1 : match[i]]:
            if kind == "ident":
                names.append(text)
            elif kind == "string":
                names.append(unquote(text))
            elif not (kind == "op" and text == ","):
                raise ExprError(f"unexpected {text!r} in a label list at offset {pos}")
        return names, match[i] + 1

    def matchers(i):
        """`{ l op "v", ... }` at i -> [(label, op, value)]."""
        out, inner = [], toks[i + 1 : match[i]]
        j = 0
        while j < len(inner):
            kind, text, pos = inner[j]
            if kind == "op" and text == ",":
                j += 1
                continue
            if kind == "string" and (j + 1 >= len(inner) or inner[j + 1][1] == ","):
                out.append(("__name__", "=", unquote(text)))  # {"quoted.metric.name"}
                j += 1
                continue
            if (
                kind in ("ident", "string")
                and j + 2 < len(inner)
                and inner[j + 1][0] == "op"
                and inner[j + 1][1] in ("=", "!=", "=~", "!~")
                and inner[j + 2][0] in ("string", "var")
            ):
                label = text if kind == "ident" else unquote(text)
                out.append((label, inner[j + 1][1], inner[j + 2][1]))
                j += 3
                continue
            raise ExprError(f"malformed label matcher near {text!r} at offset {pos}")
        return out

    i = 0
    while i < n:
        kind, text, pos = toks[i]
        if kind == "op" and text == "[":  # range, subquery: durations and variables only
            i = match[i] + 1
            continue
        if kind == "op" and text == "{":  # a selector without a metric name
            ms = matchers(i)
            names = [v for (l, op, v) in ms if l == "__name__" and op == "="]
            if not names:
                raise ExprError(f"a selector at offset {pos} names no metric (no __name__=...)")
            a.selectors.append((unquote(names[0]), [l for (l, _, _) in ms if l != "__name__"], i))
            i = match[i] + 1
            continue
        if kind != "ident":
            i += 1
            continue
        low = text.lower()
        nxt_open = is_op(i + 1, "(")
        if low in AGGREGATIONS and (nxt_open or (i + 1 < n and toks[i + 1][1].lower() in ("by", "without"))):
            if low == "count_values":  # count_values("label", v) makes that label
                strings = [t for t in toks[i + 1 :] if t[0] == "string"]
                if strings:
                    a.created_labels.add(unquote(strings[0][1]))
            if nxt_open:  # sum (args) by (labels)
                args_open = i + 1
                after = match[args_open] + 1
                if after < n and toks[after][0] == "ident" and toks[after][1].lower() in ("by", "without"):
                    names, end = label_list(after + 1)
                    a.groupings.append((toks[after][1].lower(), names, args_open, match[args_open]))
                    # the label list is not an expression: blank it out
                    toks[after : end] = [("skip", t[1], t[2]) for t in toks[after:end]]
                i = args_open
            else:  # sum by (labels) (args)
                names, args_open = label_list(i + 2)
                if not is_op(args_open, "("):
                    raise ExprError(f"{text} {toks[i + 1][1]} (...) at offset {pos} has no argument")
                a.groupings.append((toks[i + 1][1].lower(), names, args_open, match[args_open]))
                i = args_open
            continue
        if low in ("by", "without"):
            raise ExprError(f"{text!r} at offset {pos} follows no aggregation")
        if low in BINARY_MODIFIERS:
            if nxt_open:
                names, end = label_list(i + 1)
                a.groupings.append((low, names, 0, n))
                i = end
            else:
                i += 1
            continue
        if low in KEYWORDS:
            i += 1
            continue
        if nxt_open:
            if low not in FUNCTIONS:
                raise ExprError(f"unknown function {text!r} at offset {pos}")
            if low in ("label_replace", "label_join"):
                depth = 0
                for k in range(i + 2, match[i + 1]):
                    t = toks[k]
                    if t[0] == "op" and t[1] in "({[":
                        depth += 1
                    elif t[0] == "op" and t[1] in ")}]":
                        depth -= 1
                    elif t[0] == "string" and depth == 0:
                        a.created_labels.add(unquote(t[1]))
                        break
            i += 2
            continue
        # a series selector
        labels = []
        if is_op(i + 1, "{"):
            labels = [l for (l, _, _) in matchers(i + 1) if l != "__name__"]
            a.selectors.append((text, labels, i))
            i = match[i + 1] + 1
        else:
            a.selectors.append((text, labels, i))
            i += 1
    return a


def checked(name):
    return name.startswith(CHECKED_PREFIXES)


def check_expr(expr, where, scrapes, recorded, problems, names_checked):
    try:
        a = analyse(expr)
    except ExprError as e:
        problems.append(f"{where}: cannot read the expression ({e}): {expr!r}")
        return
    free = TARGET_LABELS | {"__name__"} | a.created_labels
    for name, labels, _ in a.selectors:
        if name in ALWAYS_ALLOWED_SERIES or name in recorded:
            continue
        if not checked(name):
            problems.append(f"{where}: series {name!r} is not a fantom_*/process_* series (nor up)")
            continue
        names_checked.add(name)
        if name not in scrapes.valid_names:
            problems.append(f"{where}: series {name!r} is not in any scrape")
            continue
        known = scrapes.labels.get(name)
        if known is None:  # its family had no samples: labels unverifiable
            continue
        for label in labels:
            if label in free or label in known or (label == "le" and name.endswith("_bucket")):
                continue
            problems.append(
                f"{where}: label {label!r} in a matcher on {name!r}, whose samples have "
                f"{sorted(known) or 'no labels'}"
            )
    for clause, labels, start, end in a.groupings:
        inside = [
            s[0]
            for s in a.selectors
            if start < s[2] < end and checked(s[0]) and s[0] in scrapes.valid_names
        ]
        if not inside:
            continue
        if any(s not in scrapes.labels for s in inside):
            continue  # a family without samples takes part: labels unverifiable
        for label in labels:
            if label in free:
                continue
            if label == "le" and any(s.endswith("_bucket") for s in inside):
                continue
            if any(label in scrapes.labels[s] for s in inside):
                continue
            problems.append(
                f"{where}: label {label!r} in {clause} (...) is on no sample of "
                f"{', '.join(sorted(set(inside)))}"
            )


# ---------------------------------------------------------------------------------------------
# the dashboard


def walk_panels(panels, path=""):
    for p in panels or []:
        yield p, path
        if p.get("panels"):  # a (collapsed) row's panels
            yield from walk_panels(p["panels"], f"{path}row {p.get('title', '?')!r} > ")


def datasource_uid(ds):
    if isinstance(ds, dict):
        return ds.get("uid")
    return ds  # the old string form


LABEL_VALUES_RE = re.compile(r"^\s*label_values\(\s*(?:(?P<sel>.*?)\s*,\s*)?(?P<label>[A-Za-z_]\w*)\s*\)\s*$", re.S)
QUERY_RESULT_RE = re.compile(r"^\s*query_result\((?P<expr>.*)\)\s*$", re.S)


def dashboard_exprs(dash, problems):
    """-> [(where, expr)] and records datasource problems."""
    out = []
    templating = (dash.get("templating") or {}).get("list") or []
    ds_vars = [v for v in templating if v.get("name") == "datasource"]
    if not ds_vars or ds_vars[0].get("type") != "datasource" or ds_vars[0].get("query") != "prometheus":
        problems.append("dashboard: no template variable 'datasource' of type datasource (query: prometheus)")
    for v in templating:
        if v.get("type") != "query":
            continue
        where = f"dashboard variable {v.get('name')!r}"
        if datasource_uid(v.get("datasource")) != DATASOURCE_UID:
            problems.append(f"{where}: datasource is not {DATASOURCE_UID}")
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if not isinstance(q, str):
            continue
        m = LABEL_VALUES_RE.match(q)
        if m:
            sel = m.group("sel")
            if sel:
                out.append((where, sel, m.group("label")))
            continue
        m = QUERY_RESULT_RE.match(q)
        if m:
            out.append((where, m.group("expr"), None))
    panels = list(dash.get("panels") or [])
    for row in dash.get("rows") or []:  # pre-schema-16 layout
        panels.extend(row.get("panels") or [])
    for p, path in walk_panels(panels):
        targets = p.get("targets")
        if p.get("type") == "row" and not targets:
            continue
        where_p = f"dashboard panel {path}{p.get('title', '?')!r} (id {p.get('id')})"
        if not targets:
            problems.append(f"{where_p}: no targets")
            continue
        panel_ds = p.get("datasource")
        if panel_ds is not None and datasource_uid(panel_ds) != DATASOURCE_UID:
            problems.append(f"{where_p}: panel datasource is not {DATASOURCE_UID}: {panel_ds!r}")
        for t in targets:
            where = f"{where_p} target {t.get('refId', '?')}"
            ds = t.get("datasource", panel_ds)
            if datasource_uid(ds) != DATASOURCE_UID:
                problems.append(f"{where}: datasource is not {DATASOURCE_UID}: {ds!r}")
            expr = t.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                problems.append(f"{where}: no expr")
                continue
            out.append((where, expr, None))
    return out


# ---------------------------------------------------------------------------------------------
# the rules


def rule_exprs(doc, problems):
    out, recorded = [], set()
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not isinstance(groups, list) or not groups:
        problems.append("rules: no 'groups' list")
        return out, recorded
    seen_groups = set()
    for g in groups:
        gname = g.get("name")
        if not gname:
            problems.append("rules: a group without a name")
        elif gname in seen_groups:
            problems.append(f"rules: group name {gname!r} repeated")
        seen_groups.add(gname)
        for r in g.get("rules") or []:
            if "record" in r:
                recorded.add(r["record"])
    for g in groups:
        gname = g.get("name")
        rules = g.get("rules")
        if not isinstance(rules, list) or not rules:
            problems.append(f"rules group {gname!r}: no rules")
            continue
        for r in rules:
            if "alert" in r:
                where = f"rules group {gname!r} alert {r.get('alert')!r}"
                if not r.get("alert"):
                    problems.append(f"{where}: empty alert name")
                if not isinstance(r.get("for"), str) or not DURATION_RE.match(r["for"]):
                    problems.append(f"{where}: 'for' missing or not a duration: {r.get('for')!r}")
                if not isinstance(r.get("labels"), dict) or not r["labels"].get("severity"):
                    problems.append(f"{where}: no labels.severity")
                if not isinstance(r.get("annotations"), dict) or not r["annotations"].get("summary"):
                    problems.append(f"{where}: no annotations.summary")
            elif "record" in r:
                where = f"rules group {gname!r} record {r.get('record')!r}"
            else:
                problems.append(f"rules group {gname!r}: a rule with neither alert nor record: {r!r}")
                continue
            expr = r.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                problems.append(f"{where}: no expr")
                continue
            out.append((where, expr, None))
    return out, recorded


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dashboard", required=True, help="Grafana dashboard JSON")
    ap.add_argument("--rules", required=True, help="Prometheus rules YAML")
    ap.add_argument("urls", nargs="+", metavar="URL", help="/metrics URLs (hub, agent)")
    args = ap.parse_args(argv)

    scrapes = Scrapes()
    for url in args.urls:
        scrapes.add(url, fetch(url))

    problems = []
    try:
        with open(args.dashboard, encoding="utf-8") as f:
            dash = json.load(f)
    except Exception as e:
        raise SystemExit(f"telemetry_check: FAIL: {args.dashboard}: {e}")
    try:
        with open(args.rules, encoding="utf-8") as f:
            rules = yaml.safe_load(f)
    except Exception as e:
        raise SystemExit(f"telemetry_check: FAIL: {args.rules}: {e}")

    exprs = dashboard_exprs(dash, problems)
    more, recorded = rule_exprs(rules, problems)
    exprs += more

    names_checked = set()
    for where, expr, values_label in exprs:
        check_expr(expr, where, scrapes, recorded, problems, names_checked)
        if values_label and values_label not in TARGET_LABELS | {"__name__"}:
            # label_values(selector, label): the label must be on the selector's series
            try:
                sels = [s[0] for s in analyse(expr).selectors if checked(s[0])]
            except ExprError:
                sels = []
            if sels and all(s in scrapes.labels for s in sels) and not any(
                values_label in scrapes.labels[s] for s in sels
            ):
                problems.append(f"{where}: label_values label {values_label!r} is on no sample of {sels}")

    if problems:
        print(f"telemetry_check: FAIL: {len(problems)} problem(s)", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "series_checked": len(names_checked),
                "expressions": len(exprs),
                "families_scraped": len(scrapes.families),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
