"""Drives the hub's console (/console) in Debian's chromium through Playwright, as an operator would.

Usage: console_browser.py --base-url URL --admin-token-file FILE --chromium PATH --screenshot PNG
Talks with the Rust test (tests/fleet/console.rs) in lines: prints {"step": NAME} when it needs
the test to act and reads one line from stdin when the test has acted; prints one JSON line per
check ({"check","ok"[,"detail"]}), then {"summary":{"passed","failed"}}. Exits 0 iff every check
passed. Every wait is bounded; nothing is fetched from outside loopback.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request
from urllib.parse import urlparse

from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect, sync_playwright

WAIT_MS = 20_000


def say(obj):
    print(json.dumps(obj), flush=True)


def ask(step):
    """Asks the test to act (kill the agent, ...) and waits for its line."""
    say({"step": step})
    line = sys.stdin.readline()
    if not line:
        raise RuntimeError(f"the test did not answer step {step}")


def http_status(url, key):
    req = urllib.request.Request(url, data=json.dumps({"model": "embedding", "input": ["hi"]}).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--admin-token-file", required=True)
    ap.add_argument("--chromium", required=True)
    ap.add_argument("--screenshot", required=True)
    args = ap.parse_args()
    base = args.base_url.rstrip("/")
    origin = urlparse(base).netloc
    with open(args.admin_token_file) as f:
        admin = f.read().strip()
    passed = failed = 0

    def check(name, fn):
        nonlocal passed, failed
        try:
            fn()
            passed += 1
            say({"check": name, "ok": True})
        except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
            failed += 1
            say({"check": name, "ok": False, "detail": str(e)[:2000]})

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(WAIT_MS)
        foreign, errors = [], []
        page.on("request", lambda r: urlparse(r.url).netloc not in (origin, "") and foreign.append(r.url))
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(base + "/console")

        def wrong_token():
            page.fill("#token", "not-the-admin-token")
            page.click("#sign-in button[type=submit]")
            expect(page.locator("#sign-in-error")).not_to_be_empty()
            assert page.locator("#views").is_hidden(), "signed in with a wrong token"
            # The 401 the browser logs for it is this check's own.
            errors.clear()
        check("a wrong token shows the 401's message", wrong_token)

        def sign_in():
            page.fill("#token", admin)
            page.click("#sign-in button[type=submit]")
            expect(page.locator("#views")).to_be_visible()
            assert admin not in page.url, "the token is in the URL"
        check("signs in with the admin token", sign_in)

        def fleet():
            expect(page.locator("#fleet")).to_contain_text("gpu")
            expect(page.locator("#fleet")).to_contain_text("embedding")
            expect(page.locator("#fleet")).to_contain_text("local")
        check("the running agent and its providers are shown", fleet)

        def markup_as_text():
            expect(page.locator("#fleet")).to_contain_text("<b>markup</b>")
            assert page.locator("#fleet b").count() == 0, "a host name was parsed as HTML"
        check("a host name with markup is shown as text", markup_as_text)

        def not_ready_and_back():
            expect(page.locator("#role-embedding")).to_contain_text("ready")
            expect(page.locator("#role-embedding")).not_to_contain_text("not ready")
            ask("kill-agent")
            expect(page.locator("#role-embedding")).to_contain_text("not ready", timeout=60_000)
            ask("start-agent")
            expect(page.locator("#role-embedding")).not_to_contain_text("not ready", timeout=90_000)
        check("a role goes not-ready when its agent is killed and comes back", not_ready_and_back)

        def chart():
            page.wait_for_function(
                "() => { const p = document.querySelector('svg.chart polyline.in-flight');"
                " return p && p.getAttribute('points').trim().split(' ').length >= 2; }")
        check("the budget chart has points", chart)

        def override():
            page.fill("#permits", "7")
            page.click("#override button[type=submit]")
            expect(page.locator("#override-result")).to_have_text("The override is set.")
            expect(page.locator("#budget")).to_contain_text("7")
            page.click("#clear-override")
            expect(page.locator("#override-result")).to_have_text("The override is cleared.")
            expect(page.locator("#budget")).to_contain_text("none")
        check("the budget override is set and cleared", override)

        keys = {}

        def create_project():
            page.fill("#project-name", "console-made")
            page.click("#new-project button[type=submit]")
            expect(page.locator("#new-key")).to_be_visible()
            keys["first"] = page.input_value("#key-value")
            assert keys["first"], "no key shown"
            page.click("#copy-key")
            expect(page.locator("#copy-result")).not_to_be_empty()
            page.click("#dismiss-key")
            expect(page.locator("#new-key")).to_be_hidden()
            assert page.input_value("#key-value") == "", "the key stays in the page"
            expect(page.locator("#projects")).to_contain_text("console-made")
            status = http_status(base + "/v1/embeddings", keys["first"])
            assert status == 200, f"the new key got {status}"
        check("a project is created and its key shown once works", create_project)

        def rotate():
            page.click("button[data-rotate='console-made']")
            expect(page.locator("#new-key")).to_be_visible()
            second = page.input_value("#key-value")
            assert second and second != keys["first"], "no new key"
            page.click("#dismiss-key")
            old = http_status(base + "/v1/embeddings", keys["first"])
            new = http_status(base + "/v1/embeddings", second)
            assert (old, new) == (401, 200), f"old key {old}, new key {new}"
        check("rotating in the page refuses the old key", rotate)

        def accessible():
            results = Axe().run(page)
            bad = [v for v in results.response.get("violations", [])
                   if v.get("impact") in ("serious", "critical")]
            assert not bad, json.dumps([{"id": v["id"], "impact": v["impact"], "nodes": len(v["nodes"])} for v in bad])
        check("axe-core finds no serious or critical violation", accessible)

        page.screenshot(path=args.screenshot, full_page=True)

        def sign_out():
            page.click("#sign-out")
            expect(page.locator("#sign-in-section")).to_be_visible()
            stored = page.evaluate("() => sessionStorage.length")
            assert stored == 0, "the token stays in the tab"
        check("signing out forgets the token", sign_out)

        def clean():
            assert not foreign, f"requests to other origins: {foreign}"
            assert not errors, f"console errors: {errors}"
        check("no request to another origin and no console error", clean)
        browser.close()
    say({"summary": {"passed": passed, "failed": failed}})
    sys.exit(0 if failed == 0 else 1)


if __name__ == "__main__":
    main()
