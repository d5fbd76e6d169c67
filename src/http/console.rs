//! `/console`: the operator's console, one page served by the hub itself.
//!
//! Its HTML, CSS and JavaScript (`console/`, written here: no build chain, no third-party
//! front-end code) are embedded in the binary at build time; nothing is fetched from another
//! origin. Each answer carries a Content-Security-Policy that allows only this origin's files
//! (no inline script or style, no framing, no base or form target elsewhere). The page signs
//! in with the admin token and reads the `/admin` routes like any client; a standby forwards
//! it like every other route.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

/// The console's Content-Security-Policy.
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

const INDEX_HTML: &str = include_str!("console/index.html");
const CONSOLE_JS: &str = include_str!("console/console.js");
const CONSOLE_CSS: &str = include_str!("console/console.css");
const ICON_SVG: &str = include_str!("console/icon.svg");

/// One of the console's files, with its type and the policy.
fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // A new build's page is never mixed with an old script.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The operator's console: one page that signs in with the admin token and shows the fleet,
/// the roles, the spaces, the budget, the projects and the hubs.
#[utoipa::path(get, path = "/console", tag = "console", responses(
    (status = 200, description = "The console's page", content_type = "text/html")))]
pub async fn page() -> Response {
    asset(INDEX_HTML, "text/html; charset=utf-8")
}

/// The console's script.
#[utoipa::path(get, path = "/console/console.js", tag = "console", responses(
    (status = 200, description = "The console's script", content_type = "text/javascript")))]
pub async fn script() -> Response {
    asset(CONSOLE_JS, "text/javascript; charset=utf-8")
}

/// The console's style sheet.
#[utoipa::path(get, path = "/console/console.css", tag = "console", responses(
    (status = 200, description = "The console's style sheet", content_type = "text/css")))]
pub async fn style() -> Response {
    asset(CONSOLE_CSS, "text/css; charset=utf-8")
}

/// The console's icon (so a browser does not ask for `/favicon.ico`).
#[utoipa::path(get, path = "/console/icon.svg", tag = "console", responses(
    (status = 200, description = "The console's icon", content_type = "image/svg+xml")))]
pub async fn icon() -> Response {
    asset(ICON_SVG, "image/svg+xml")
}

/// `Cache-Control: no-store` on every `/admin` answer: a token's view of the fleet is never
/// kept by a browser or a proxy.
pub async fn admin_no_store(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let admin = request.uri().path().starts_with("/admin");
    let mut response = next.run(request).await;
    if admin {
        response
            .headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_no_inline_script_or_style_and_names_no_other_origin() {
        for (name, text) in [
            ("index.html", INDEX_HTML),
            ("console.js", CONSOLE_JS),
            ("console.css", CONSOLE_CSS),
            ("icon.svg", ICON_SVG),
        ] {
            for needle in ["http://", "https://", "//cdn", "@import"] {
                let hits: Vec<&str> = text
                    .lines()
                    .filter(|l| l.contains(needle) && !l.contains("http://www.w3.org/2000/svg"))
                    .collect();
                assert!(hits.is_empty(), "{name} names another origin: {hits:?}");
            }
        }
        assert!(!INDEX_HTML.contains("<style"), "no inline style");
        assert!(!INDEX_HTML.contains(" style="), "no style attribute");
        let handler = INDEX_HTML.split(" on").skip(1).find(|rest| {
            let name: String = rest.chars().take_while(char::is_ascii_lowercase).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        });
        assert!(handler.is_none(), "an inline handler: on{handler:?}");
        let scripts = INDEX_HTML.matches("<script").count();
        assert_eq!(
            INDEX_HTML.matches("<script src=\"/console/").count(),
            scripts
        );
        // Text from the fleet is never parsed as HTML.
        for sink in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
        ] {
            assert!(!CONSOLE_JS.contains(sink), "console.js uses {sink}");
        }
        // The token never goes into a URL or the log.
        assert!(!CONSOLE_JS.contains("console.log"));
        assert!(!CONSOLE_JS.contains("?token"));
    }
}
