//! The `Retry-After` header in both of its forms (RFC 9110 §10.2.3): delay-seconds (`120`;
//! fractions such as OpenRouter's `1.5` are read too) or an HTTP-date
//! (`Fri, 31 Dec 1999 23:59:59 GMT`), which is read as the time left until then. Shared by the
//! OpenRouter client and the agent's fronted model servers.

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, RETRY_AFTER};

/// The longest wait read from an upstream: a day (a larger number is a day, never a panic).
const MAX_WAIT: Duration = Duration::from_secs(86_400);

/// `seconds` as a wait, if it is one (negative, NaN and infinite are not; huge is [`MAX_WAIT`]).
pub fn seconds(seconds: f64) -> Option<Duration> {
    (seconds.is_finite() && seconds >= 0.0)
        .then(|| Duration::try_from_secs_f64(seconds).map_or(MAX_WAIT, |d| d.min(MAX_WAIT)))
}

/// The wait a `Retry-After` value asks for, read at `now`; a date in the past is no wait.
pub fn parse(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(s) = value.parse::<f64>() {
        return seconds(s);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_WAIT),
    )
}

/// The wait `headers`' `Retry-After` asks for, now.
pub fn from_headers(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    parse(value, SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_fractions_and_http_dates() {
        let now = httpdate::parse_http_date("Thu, 03 Dec 2026 12:00:00 GMT").unwrap();
        assert_eq!(parse("3", now), Some(Duration::from_secs(3)));
        assert_eq!(parse(" 1.5 ", now), Some(Duration::from_millis(1500)));
        assert_eq!(
            parse("Thu, 03 Dec 2026 12:01:30 GMT", now),
            Some(Duration::from_secs(90))
        );
        // The obsolete forms HTTP-date still allows.
        assert_eq!(
            parse("Thursday, 03-Dec-26 12:00:10 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse("Thu, 03 Dec 2026 11:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse("-1", now), None);
        // Numbers past any Duration are a day, never a panic.
        assert_eq!(parse("1e20", now), Some(MAX_WAIT));
        assert_eq!(parse("18446744073709551616", now), Some(MAX_WAIT));
        assert_eq!(parse("NaN", now), None);
        assert_eq!(parse("soon", now), None);
    }
}
