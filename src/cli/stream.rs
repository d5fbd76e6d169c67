//! Running a long input through the engine in chunks, writing results in input order.
//!
//! Chunks run concurrently (so the engine's queue holds enough entries to bucket by length)
//! but results are written strictly in order, as soon as the oldest chunk is done. Progress is
//! not counted here (a chunk finishes late when its longest input does): the bar follows the
//! engine's own counters ([`super::progress`]).

use std::collections::VecDeque;
use std::future::Future;
use std::io::Write;

use crate::inference::InferenceError;

/// Inputs per engine request.
pub const CHUNK: usize = 256;
/// Requests in flight at once.
const IN_FLIGHT: usize = 16;

/// Feeds `items` through `run` chunk by chunk; `write(index, output)` sees every output in
/// order. `run` gets the chunk's items; indexes in errors are made absolute.
pub async fn run_in_order<T, O, F, Fut>(
    items: Vec<T>,
    run: F,
    mut write: impl FnMut(usize, O) -> std::io::Result<()>,
) -> anyhow::Result<()>
where
    T: Send + 'static,
    O: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Result<Vec<O>, InferenceError>> + Send + 'static,
{
    let mut pending = VecDeque::new();
    let mut iter = items.into_iter();
    let mut next_index = 0usize;
    let mut start = 0usize;
    loop {
        while pending.len() < IN_FLIGHT {
            let chunk: Vec<T> = iter.by_ref().take(CHUNK).collect();
            if chunk.is_empty() {
                break;
            }
            let len = chunk.len();
            pending.push_back((start, tokio::spawn(run(chunk))));
            start += len;
        }
        let Some((offset, handle)) = pending.pop_front() else {
            break;
        };
        let outputs = handle.await?.map_err(|e| absolute(e, offset))?;
        for out in outputs {
            write(next_index, out)?;
            next_index += 1;
        }
    }
    Ok(())
}

/// Shifts a chunk-relative input index in an error to the input's line index.
fn absolute(e: InferenceError, offset: usize) -> anyhow::Error {
    match e {
        InferenceError::EmptyText { index } => InferenceError::EmptyText {
            index: index + offset,
        }
        .into(),
        InferenceError::TooLong { index, max } => InferenceError::TooLong {
            index: index + offset,
            max,
        }
        .into(),
        other => other.into(),
    }
}

/// A buffered, locked stdout that is flushed at the end.
pub fn stdout() -> std::io::BufWriter<std::io::StdoutLock<'static>> {
    std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock())
}

/// Writes one JSON value and a newline.
pub fn write_json_line(out: &mut impl Write, value: &impl serde::Serialize) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, value)?;
    out.write_all(b"\n")
}
