//! Server-sent events as upstreams send them (OpenRouter, vLLM, Ollama, llama.cpp), decoded the
//! way the HTML standard's event-stream parser does: lines end with CRLF, LF or a bare CR (a
//! CR at the end of one read and an LF at the start of the next are one line end); `data:`
//! lines of one event are joined with newlines; a blank line ends the event; `event:` names it;
//! lines starting with `:` are comments (OpenRouter's `: OPENROUTER PROCESSING`). One
//! extension: llama.cpp's server reports a failure mid-stream as an `error: {json}` line,
//! which is read as an event named `error`.

/// The longest line, and the most data one event may hold.
const MAX_EVENT_BYTES: usize = 4 << 20;

/// One event of the stream.
#[derive(Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// Its `event:` name (`error` for llama.cpp's `error:` lines), if it has one.
    pub name: Option<String>,
    /// Its `data:` lines, joined with `\n`.
    pub data: String,
}

/// The event stream's decoder: bytes in as they arrive, complete events out.
#[derive(Default)]
pub struct SseDecoder {
    /// Bytes seen so far (a byte-order mark is skipped at the very start only).
    started: bool,
    line: Vec<u8>,
    /// The last byte fed was a CR: an LF next is the same line end.
    after_cr: bool,
    name: Option<String>,
    /// The event's data so far, each line followed by `\n` (the standard's data buffer).
    data: String,
}

/// A line or an event over [`MAX_EVENT_BYTES`].
#[derive(Debug, thiserror::Error)]
#[error("a server-sent event is longer than {MAX_EVENT_BYTES} bytes")]
pub struct EventTooLong;

impl SseDecoder {
    /// Adds `bytes`; returns the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, EventTooLong> {
        let mut out = Vec::new();
        if !self.started && !bytes.is_empty() {
            self.line.extend_from_slice(bytes);
            if self.line.len() < 3 && b"\xEF\xBB\xBF".starts_with(&self.line) {
                // Not enough yet to tell a byte-order mark from data.
                return Ok(out);
            }
            self.started = true;
            let pending = std::mem::take(&mut self.line);
            let pending = pending
                .strip_prefix(b"\xEF\xBB\xBF")
                .unwrap_or(&pending)
                .to_vec();
            return self.feed(&pending);
        }
        for &b in bytes {
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(event) = self.line_ended(&line)? {
                        out.push(event);
                    }
                }
                _ => {
                    self.after_cr = false;
                    self.line.push(b);
                    if self.line.len() > MAX_EVENT_BYTES {
                        return Err(EventTooLong);
                    }
                }
            }
        }
        Ok(out)
    }

    /// The stream closed: an event whose blank line never came is still delivered (servers
    /// that close right after their last `data:` line).
    pub fn finish(&mut self) -> Result<Option<SseEvent>, EventTooLong> {
        let line = std::mem::take(&mut self.line);
        if let Some(event) = self.line_ended(&line)? {
            return Ok(Some(event));
        }
        Ok(self.dispatch())
    }

    fn line_ended(&mut self, line: &[u8]) -> Result<Option<SseEvent>, EventTooLong> {
        if line.is_empty() {
            return Ok(self.dispatch());
        }
        if line[0] == b':' {
            return Ok(None);
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_ref(), ""),
        };
        match field {
            "data" => {
                if self.data.len() + value.len() + 1 > MAX_EVENT_BYTES {
                    return Err(EventTooLong);
                }
                self.data.push_str(value);
                self.data.push('\n');
            }
            "event" => self.name = Some(value.to_string()),
            // llama.cpp: `error: {"code":500,"message":"...","type":"server_error"}`, as one
            // whole event of its own.
            "error" => {
                // An event cut short by the error line is dropped: the error is the news.
                self.name = None;
                self.data.clear();
                return Ok(Some(SseEvent {
                    name: Some("error".into()),
                    data: value.to_string(),
                }));
            }
            _ => {}
        }
        Ok(None)
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let name = self.name.take();
        let mut data = std::mem::take(&mut self.data);
        if data.is_empty() {
            return None;
        }
        data.pop();
        Some(SseEvent { name, data })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(stream: &str, piece: usize) -> Vec<SseEvent> {
        let mut decoder = SseDecoder::default();
        let mut out = Vec::new();
        for part in stream.as_bytes().chunks(piece) {
            out.extend(decoder.feed(part).unwrap());
        }
        out.extend(decoder.finish().unwrap());
        out
    }

    fn data(event: &SseEvent) -> &str {
        &event.data
    }

    #[test]
    fn line_ends_of_every_kind_and_events_of_several_data_lines() {
        let stream = ": OPENROUTER PROCESSING\r\n\r\ndata: {\"a\":\rdata: 1}\r\rdata:two\n\ndata: three\r\n\r\ndata: [DONE]\n\n";
        for piece in [1, 2, 3, 7, 1000] {
            let events = decode(stream, piece);
            let got: Vec<&str> = events.iter().map(data).collect();
            assert_eq!(
                got,
                ["{\"a\":\n1}", "two", "three", "[DONE]"],
                "pieces of {piece}"
            );
            assert!(events.iter().all(|e| e.name.is_none()));
        }
    }

    #[test]
    fn named_events_errors_and_a_last_event_without_its_blank_line() {
        let events = decode(
            "event: error\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: {\"a\":1}\nerror: {\"code\":500,\"message\":\"boom\"}\ndata: last\n\nevent: nothing\n\ndata:\n\ndata: final",
            5,
        );
        // An event with no data is not dispatched; an empty data line is an empty event; the
        // last event counts though the stream closed before its blank line.
        assert_eq!(events.len(), 5, "{events:?}");
        assert_eq!(events[3].data, "");
        assert_eq!(events[4].data, "final");
        assert_eq!(events[0].name.as_deref(), Some("error"));
        assert_eq!(events[1].name.as_deref(), Some("error"));
        assert_eq!(events[1].data, "{\"code\":500,\"message\":\"boom\"}");
        assert_eq!(events[2].data, "last");
    }

    #[test]
    fn a_byte_order_mark_at_the_start_is_skipped() {
        let stream = "\u{feff}data: one\n\ndata: \u{feff}two\n\n";
        for piece in [1, 2, 100] {
            let events = decode(stream, piece);
            let got: Vec<&str> = events.iter().map(data).collect();
            assert_eq!(got, ["one", "\u{feff}two"], "pieces of {piece}");
        }
    }

    #[test]
    fn an_endless_line_is_refused() {
        let mut decoder = SseDecoder::default();
        let chunk = vec![b'a'; 1 << 20];
        let mut refused = false;
        for _ in 0..5 {
            if decoder.feed(&chunk).is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused);
    }
}
