//! The one-shot tools' progress on a terminal: a bar that follows the engine's own counters
//! (rows and tokens of every finished batch, read on a steady tick), so it moves batch by
//! batch whatever order the engine finishes its requests in, with texts/s and tokens/s; and
//! a one-line summary at the end (count, time, rates) that stays on stderr.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the bar reads the counters.
const TICK: Duration = Duration::from_millis(200);

/// Rows and tokens done so far (the engine's counters, read relative to the start).
pub type Meter = Arc<dyn Fn() -> (u64, u64) + Send + Sync>;

pub struct Progress {
    shown: Arc<Shown>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

/// What the bar shows and where it reads it.
struct Shown {
    bar: ProgressBar,
    meter: Meter,
    base: (u64, u64),
    total: u64,
    /// What is counted, plural (`texts`, `documents`).
    what: &'static str,
    started: Instant,
}

impl Progress {
    /// A bar on stderr when it is a terminal (else hidden), ticking until [`Progress::finish`].
    pub fn start(total: usize, what: &'static str, meter: Meter) -> Self {
        let target = if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let mut progress = Self::with_target(total, what, meter, target);
        if !progress.shown.bar.is_hidden() {
            progress.shown.bar.enable_steady_tick(TICK);
            let shown = progress.shown.clone();
            progress.ticker = Some(tokio::spawn(async move {
                let mut tick = tokio::time::interval(TICK);
                loop {
                    tick.tick().await;
                    shown.refresh();
                }
            }));
        }
        progress
    }

    fn with_target(
        total: usize,
        what: &'static str,
        meter: Meter,
        target: ProgressDrawTarget,
    ) -> Self {
        let bar = ProgressBar::with_draw_target(Some(total as u64), target);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg} (eta {eta})",
        ) {
            bar.set_style(style);
        }
        let base = meter();
        Self {
            shown: Arc::new(Shown {
                bar,
                meter,
                base,
                total: total as u64,
                what,
                started: Instant::now(),
            }),
            ticker: None,
        }
    }

    /// Stops the ticker (awaited: no redraw can follow), clears the bar and leaves the summary
    /// line (on a terminal; a log line otherwise).
    pub async fn finish(mut self, verb: &str) {
        if let Some(t) = self.ticker.take() {
            t.abort();
            let _ = t.await;
        }
        let s = &self.shown;
        s.bar.finish_and_clear();
        let (_, tokens) = done(&(s.meter)(), s.base);
        let elapsed = s.started.elapsed();
        let line = summary(verb, s.total, s.what, tokens, elapsed);
        if std::io::stderr().is_terminal() {
            eprintln!("{line}");
        } else {
            tracing::info!(
                count = s.total,
                tokens,
                seconds = elapsed.as_secs_f64(),
                "{line}"
            );
        }
    }
}

impl Shown {
    /// Reads the counters now and redraws.
    fn refresh(&self) {
        let (rows, tokens) = done(&(self.meter)(), self.base);
        self.bar.set_position(rows.min(self.total));
        let s = self.started.elapsed().as_secs_f64().max(1e-3);
        let what = self.what;
        self.bar.set_message(format!(
            "{what} · {:.1} {what}/s · {:.0} tokens/s",
            rows as f64 / s,
            tokens as f64 / s
        ));
    }
}

impl Drop for Progress {
    /// Dropped without [`Progress::finish`] (an error): the bar goes, the error follows.
    fn drop(&mut self) {
        if let Some(t) = self.ticker.take() {
            t.abort();
            self.shown.bar.finish_and_clear();
        }
    }
}

fn done(now: &(u64, u64), base: (u64, u64)) -> (u64, u64) {
    (now.0.saturating_sub(base.0), now.1.saturating_sub(base.1))
}

/// `embedded 600 texts in 24.1 s (24.9 texts/s, 3120 tokens/s)`
fn summary(verb: &str, count: u64, what: &str, tokens: u64, elapsed: Duration) -> String {
    let s = elapsed.as_secs_f64().max(1e-3);
    let counted = if count == 1 {
        what.strip_suffix('s').unwrap_or(what)
    } else {
        what
    };
    format!(
        "{verb} {count} {counted} in {:.1} s ({:.1} {what}/s, {:.0} tokens/s)",
        elapsed.as_secs_f64(),
        count as f64 / s,
        tokens as f64 / s
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn the_bar_follows_the_engine_counters_not_finished_requests() {
        let rows = Arc::new(AtomicU64::new(7)); // warm-up rows before the start
        let tokens = Arc::new(AtomicU64::new(100));
        let meter: Meter = {
            let (rows, tokens) = (rows.clone(), tokens.clone());
            Arc::new(move || (rows.load(Ordering::Relaxed), tokens.load(Ordering::Relaxed)))
        };
        let p = Progress::with_target(600, "texts", meter, ProgressDrawTarget::hidden());
        let p = &p.shown;
        p.refresh();
        assert_eq!(p.bar.position(), 0);
        // One batch of 32 rows finished inside a request of 256 that has not.
        rows.fetch_add(32, Ordering::Relaxed);
        tokens.fetch_add(640, Ordering::Relaxed);
        p.refresh();
        assert_eq!(p.bar.position(), 32);
        assert!(p.bar.message().contains("tokens/s"), "{}", p.bar.message());
        // Never past the total (another caller's rows on a shared engine).
        rows.fetch_add(10_000, Ordering::Relaxed);
        p.refresh();
        assert_eq!(p.bar.position(), 600);
    }

    #[test]
    fn the_summary_says_count_time_and_rates() {
        let line = summary("embedded", 600, "texts", 3000, Duration::from_secs(24));
        assert_eq!(
            line,
            "embedded 600 texts in 24.0 s (25.0 texts/s, 125 tokens/s)"
        );
        let one = summary("reranked", 1, "documents", 9, Duration::from_secs(1));
        assert!(one.starts_with("reranked 1 document in 1.0 s"), "{one}");
    }
}
