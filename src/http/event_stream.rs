//! Server-sent events we send (the hub's streamed chats, and the relay's for Fantom masters):
//! a keep-alive comment (`:`) every [`KEEP_ALIVE`] while no event is due, so proxies and load
//! balancers that drop idle connections (many at 30 to 60 s) keep a stream whose upstream is
//! still thinking, and the client's own read timeout sees bytes.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;

/// How often an idle stream gets a keep-alive comment.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// `events` as a `text/event-stream` answer with keep-alive comments every `keep_alive`.
pub fn event_stream<S>(events: S, keep_alive: Duration) -> Response
where
    S: Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt as _;

    use super::*;

    #[tokio::test]
    async fn an_idle_stream_gets_keep_alive_comments_between_its_events() {
        let events = futures_util::stream::pending::<Result<Event, Infallible>>();
        let response = event_stream(events, Duration::from_millis(20));
        let mut body = response.into_body().into_data_stream();
        for _ in 0..2 {
            let bytes = tokio::time::timeout(Duration::from_secs(5), body.next())
                .await
                .expect("a comment while nothing else comes")
                .unwrap()
                .unwrap();
            assert!(bytes.starts_with(b":"), "{bytes:?}");
        }
    }
}
