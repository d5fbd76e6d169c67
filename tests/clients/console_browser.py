"""Drives the hub's console (/console) in Debian's chromium through Playwright, as an operator would.

Usage: console_browser.py --base-url URL --admin-token-file FILE --chromium PATH --screenshot PNG
       console_browser.py --scenario standby --base-url HTTPS_STANDBY_URL --plain-url URL
                          --loopback-url URL --admin-token-file FILE --chromium PATH
The first runs the fleet from the page (the `operator` scenario); the second reaches the page
through a standby served over TLS, in a phone-sized window, from the keyboard only, and checks
the plain-http warning on a name that is not loopback (`console.test`, mapped to 127.0.0.1 by
chromium's host resolver rules).
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


def http_status(url, key, body=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = body or {"model": "embedding", "input": ["hi"]}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def project(base, admin, name):
    """A project as GET /admin/projects lists it."""
    req = urllib.request.Request(base + "/admin/projects", headers={"Authorization": f"Bearer {admin}"})
    with urllib.request.urlopen(req, timeout=20) as r:
        listed = json.load(r)
    return next(p for p in listed["projects"] if p["name"] == name)


class Checks:
    """Counts and reports checks; a failed one is reported and the run goes on."""

    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, name, fn):
        try:
            fn()
            self.passed += 1
            say({"check": name, "ok": True})
        except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
            self.failed += 1
            say({"check": name, "ok": False, "detail": str(e)[:2000]})


def watch(page, origins, foreign, errors):
    """Records requests to any origin but `origins`, console errors and page errors."""
    page.set_default_timeout(WAIT_MS)
    page.on("request", lambda r: urlparse(r.url).netloc not in (*origins, "") and foreign.append(r.url))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))


def no_serious_violations(page):
    results = Axe().run(page)
    bad = [v for v in results.response.get("violations", [])
           if v.get("impact") in ("serious", "critical")]
    assert not bad, json.dumps([{"id": v["id"], "impact": v["impact"], "nodes": len(v["nodes"])} for v in bad])


def sign_out_and_check_clean(page, check, foreign, errors):
    """The last two checks of every scenario: signing out forgets the token; nothing went to
    another origin and the console logged no error."""
    def sign_out():
        page.click("#sign-out")
        expect(page.locator("#sign-in-section")).to_be_visible()
        assert page.evaluate("() => sessionStorage.length") == 0, "the token stays in the tab"
    check("signing out forgets the token", sign_out)

    def clean():
        assert not foreign, f"requests to other origins: {foreign}"
        assert not errors, f"console errors: {errors}"
    check("no request to another origin and no console error", clean)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=["operator", "standby"], default="operator")
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--admin-token-file", required=True)
    ap.add_argument("--chromium", required=True)
    ap.add_argument("--screenshot")
    ap.add_argument("--plain-url")
    ap.add_argument("--loopback-url")
    args = ap.parse_args()
    with open(args.admin_token_file) as f:
        admin = f.read().strip()
    check = Checks()
    if args.scenario == "standby":
        standby(args, admin, check)
    else:
        operator(args, admin, check)
    say({"summary": {"passed": check.passed, "failed": check.failed}})
    sys.exit(0 if check.failed == 0 else 1)


def operator(args, admin, check):
    base = args.base_url.rstrip("/")
    origin = urlparse(base).netloc
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        foreign, errors = [], []
        watch(page, (origin,), foreign, errors)
        def without_script():
            # A page whose script did not run: submitting the sign-in form sends no token
            # anywhere (the input is no form field), never in a URL.
            bare = browser.new_context(java_script_enabled=False).new_page()
            sent = []
            bare.on("request", lambda r: sent.append((r.url, r.post_data or "")))
            bare.goto(base + "/console")
            bare.fill("#token", admin)
            bare.press("#token", "Enter")
            bare.wait_for_load_state()
            leaked = [u for u, body in sent if admin in u or admin in body]
            assert not leaked, f"the token was sent: {leaked}"
            assert admin not in bare.url, "the token is in the URL"
            bare.context.close()
        check("without its script the sign-in form sends no token", without_script)

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
            expect(page.locator("#budget-events")).to_contain_text("an operator set the override to 7")
            expect(page.locator("#budget-events")).to_contain_text("an operator cleared the override")
        check("the budget override is set and cleared, and both are events in time", override)

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
            # Rotation asks first: declined, the key stays as it was.
            page.once("dialog", lambda d: d.dismiss())
            page.click("button[data-rotate='console-made']")
            assert http_status(base + "/v1/embeddings", keys["first"]) == 200, "rotated unasked"
            page.once("dialog", lambda d: d.accept())
            page.click("button[data-rotate='console-made']")
            expect(page.locator("#new-key")).to_be_visible()
            second = page.input_value("#key-value")
            assert second and second != keys["first"], "no new key"
            page.click("#dismiss-key")
            old = http_status(base + "/v1/embeddings", keys["first"])
            new = http_status(base + "/v1/embeddings", second)
            assert (old, new) == (401, 200), f"old key {old}, new key {new}"
        check("rotating in the page refuses the old key", rotate)

        def limits():
            page.click("details[data-project='console-made'] summary")
            form = page.locator("form[data-edit='console-made']")
            form.locator("input[name=weight]").fill("3")
            form.locator("input[name=max_queued_items]").fill("5")
            form.locator("input[name=cloud_usd_per_day]").fill("0.5")
            form.locator("button[type=submit]").click()
            expect(page.locator("#projects-result")).to_have_text("Project console-made saved.")
            row = page.locator("#projects tr", has_text="console-made")
            expect(row).to_contain_text("0 of 5 items queued")
            expect(row).to_contain_text("$0.0000 of $0.5 today")
            got = project(base, admin, "console-made")
            assert got["weight"] == 3 and got["limits"] == {"max_queued_items": 5, "cloud_usd_per_day": 0.5}, got
            # An emptied field is no limit.
            form = page.locator("form[data-edit='console-made']")
            form.locator("input[name=max_queued_items]").fill("")
            form.locator("input[name=cloud_usd_per_day]").fill("")
            form.locator("button[type=submit]").click()
            expect(page.locator("#projects tr", has_text="console-made")).to_contain_text("no limits")
            got = project(base, admin, "console-made")
            assert got["limits"] == {}, got
        check("a project's weight and limits are edited in the page", limits)

        def queues():
            # A role nothing serves: its refusal is counted by code; the embeddings the keys
            # made above waited, and the minute's quantiles say how long.
            assert http_status(base + "/v1/rerank", "", {"query": "q", "documents": ["d"]}) == 503
            expect(page.locator("#role-reranker .refused")).to_contain_text("no_provider: 1")
            expect(page.locator("#role-embedding")).to_contain_text("p50")
            expect(page.locator("#role-embedding .waiting")).to_contain_text("nothing waiting")
        check("roles show their waits and refusals by code", queues)

        def migration():
            # Opened from the page; its abort asks first, and declined, it stays open.
            page.select_option("#migration-backend", "local")
            page.fill("#migration-model", "nobody/serves-this")
            page.click("#open-migration button[type=submit]")
            expect(page.locator("#migration-result")).to_contain_text("opened")
            expect(page.locator("#migrations")).to_contain_text("migrating")
            page.once("dialog", lambda d: d.dismiss())
            page.click("button[data-migration='abort'][data-role='embedding']")
            expect(page.locator("#migrations")).to_contain_text("migrating")
            page.once("dialog", lambda d: d.accept())
            page.click("button[data-migration='abort'][data-role='embedding']")
            expect(page.locator("#migration-result")).to_contain_text("aborted")
            expect(page.locator("#migrations")).not_to_contain_text("migrating")
        check("a migration is opened and aborted (after a confirmation) in the page", migration)

        def accessible():
            no_serious_violations(page)
        check("axe-core finds no serious or critical violation", accessible)

        page.screenshot(path=args.screenshot, full_page=True)

        sign_out_and_check_clean(page, check, foreign, errors)
        browser.close()


def standby(args, admin, check):
    base = args.base_url.rstrip("/")
    plain = args.plain_url.rstrip("/")
    loopback = args.loopback_url.rstrip("/")
    origins = (urlparse(base).netloc, urlparse(plain).netloc, urlparse(loopback).netloc)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=args.chromium,
            args=["--no-sandbox", "--host-resolver-rules=MAP console.test 127.0.0.1"])
        # A phone-sized window, over TLS with the test's own CA (not one chromium knows).
        phone = browser.new_context(viewport={"width": 390, "height": 844}, ignore_https_errors=True)
        page = phone.new_page()
        foreign, errors = [], []
        watch(page, origins, foreign, errors)
        page.goto(base + "/console")

        def no_warning_over_tls():
            expect(page.locator("#sign-in")).to_be_visible()
            assert page.locator("#clear-text-warning").is_hidden(), "a warning over https"
        check("over https the page does not warn of clear text", no_warning_over_tls)

        def keyboard_sign_in():
            for _ in range(10):
                if page.evaluate("() => document.activeElement && document.activeElement.id") == "token":
                    break
                page.keyboard.press("Tab")
            assert page.evaluate("() => document.activeElement.id") == "token", "Tab never reached the token field"
            page.keyboard.type(admin)
            page.keyboard.press("Enter")
            expect(page.locator("#views")).to_be_visible()
        check("signs in from the keyboard only", keyboard_sign_in)

        def through_standby():
            expect(page.locator("#through-standby")).to_be_visible()
            expect(page.locator("#ha")).to_contain_text("standby")
            expect(page.locator("#fleet")).to_contain_text("gpu-host-7")
        check("through the standby it shows the leader's data beside this hub's HA block", through_standby)

        def reachable():
            seen = set()
            for _ in range(120):
                page.keyboard.press("Tab")
                seen.add(page.evaluate(
                    "() => { const e = document.activeElement; return e.id || e.getAttribute('href')"
                    " || (e.closest('details') ? 'details:' + e.closest('details').getAttribute('data-project') : e.tagName); }"))
            wanted = {"sign-out", "#fleet-title", "#projects-title", "permits", "clear-override",
                      "project-name", "details:default"}
            assert wanted <= seen, f"not reached from the keyboard: {sorted(wanted - seen)}"
        check("every view and control is reached with Tab", reachable)

        def narrow():
            wide = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
            assert wide <= 1, f"the page scrolls sideways by {wide} px at 390 px"
        check("a narrow window does not scroll the page sideways", narrow)

        def accessible():
            no_serious_violations(page)
        check("axe-core finds no serious or critical violation in a narrow window", accessible)

        def warns_in_clear():
            other = browser.new_page()
            watch(other, origins, foreign, errors)
            other.goto(plain + "/console")
            expect(other.locator("#clear-text-warning")).to_be_visible()
            other.goto(loopback + "/console")
            expect(other.locator("#sign-in")).to_be_visible()
            assert other.locator("#clear-text-warning").is_hidden(), "a warning on loopback"
            other.close()
        check("plain http to a name that is not loopback warns before the token is typed", warns_in_clear)

        sign_out_and_check_clean(page, check, foreign, errors)
        browser.close()


if __name__ == "__main__":
    main()
