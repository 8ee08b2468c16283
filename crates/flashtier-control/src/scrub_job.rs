//! The scrub as a background job of a running server (`flashtier scrub`): one at a time, on its
//! own thread, beside the mode switch/flush/detach job (a scrub only reads, and what it finds
//! bad is handled exactly as a client read would handle it, so it needs no exclusion from them).
//!
//! Whoever is about to close or release the cache calls [`Scrubber::stop`] first: it cancels the
//! scrub and waits for its thread, so no scrub read races a device being closed or formatted
//! (and takes a block of a released cache for damage).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flashtier_engine::{Cache, ScrubProgress};
use parking_lot::Mutex;

use crate::report::ScrubStatus;

/// How long a finished scrub took, and why it failed if it did.
type Finished = Arc<Mutex<Option<(Duration, Option<String>)>>>;

struct Run {
    progress: Arc<ScrubProgress>,
    cancel: Arc<AtomicBool>,
    rate: Option<u64>,
    started: Instant,
    /// Set when the scrub returns: how long it took and the error, if any.
    finished: Finished,
    thread: Option<JoinHandle<()>>,
}

/// The running or last scrub.
#[derive(Default)]
pub struct Scrubber {
    run: Mutex<Option<Run>>,
}

/// Why a scrub request was refused.
#[derive(Debug, thiserror::Error)]
pub enum ScrubError {
    /// One scrub at a time.
    #[error("a scrub is running already (`flashtier scrub --status` shows it)")]
    Running,
    /// Cancel asked while no scrub runs.
    #[error("no scrub is running")]
    NotRunning,
    /// The scrub thread could not be spawned; holds the error.
    #[error("cannot start the scrub thread: {0}")]
    Spawn(std::io::Error),
}

impl Scrubber {
    /// Starts checking every block of `cache`, at most `rate` bytes per second (`None`: as fast
    /// as the device goes).
    pub fn start(&self, cache: Arc<Cache>, rate: Option<u64>) -> Result<(), ScrubError> {
        let mut run = self.run.lock();
        if run.as_ref().is_some_and(|r| r.finished.lock().is_none()) {
            return Err(ScrubError::Running);
        }
        let progress = Arc::new(ScrubProgress::default());
        let cancel = Arc::new(AtomicBool::new(false));
        let finished: Finished = Arc::default();
        let started = Instant::now();
        let thread = {
            let (progress, cancel, finished) = (progress.clone(), cancel.clone(), finished.clone());
            std::thread::Builder::new()
                .name("flashtier-scrub".into())
                .spawn(move || {
                    tracing::info!(rate_bytes_per_sec = rate, "scrub started");
                    let result = cache.scrub(&progress, &cancel, rate);
                    let error = match result {
                        Ok(r) => {
                            tracing::info!(
                                checked = r.checked_blocks,
                                dropped = r.dropped_blocks,
                                lost = r.lost_blocks,
                                cancelled = r.cancelled,
                                "scrub done"
                            );
                            if r.lost_blocks > 0 {
                                tracing::warn!(
                                    "the scrub found lost blocks (see `flashtier status`)"
                                );
                            }
                            None
                        }
                        Err(e) => {
                            tracing::error!("scrub failed: {e}");
                            Some(e.to_string())
                        }
                    };
                    *finished.lock() = Some((started.elapsed(), error));
                })
                .map_err(ScrubError::Spawn)?
        };
        *run = Some(Run {
            progress,
            cancel,
            rate,
            started,
            finished,
            thread: Some(thread),
        });
        Ok(())
    }

    /// Asks the running scrub to stop after the read in flight; returns at once.
    pub fn cancel(&self) -> Result<(), ScrubError> {
        match self.run.lock().as_ref() {
            Some(r) if r.finished.lock().is_none() => {
                r.cancel.store(true, Ordering::Release);
                tracing::info!("scrub cancelled");
                Ok(())
            }
            _ => Err(ScrubError::NotRunning),
        }
    }

    /// Cancels the running scrub, if any, and waits until it has stopped.
    pub fn stop(&self) {
        let thread = {
            let mut run = self.run.lock();
            let Some(r) = run.as_mut() else { return };
            r.cancel.store(true, Ordering::Release);
            r.thread.take()
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// The running or last scrub; `None` before the first.
    pub fn status(&self) -> Option<ScrubStatus> {
        let run = self.run.lock();
        let r = run.as_ref()?;
        let p = &r.progress;
        let finished = r.finished.lock().clone();
        let (elapsed, error) = match &finished {
            Some((took, e)) => (*took, e.clone()),
            None => (r.started.elapsed(), None),
        };
        Some(ScrubStatus {
            done: finished.is_some(),
            cancelled: r.cancel.load(Ordering::Acquire),
            error,
            segments_done: p.segments_done.load(Ordering::Relaxed),
            segments_total: p.segments_total.load(Ordering::Relaxed),
            checked_blocks: p.checked_blocks.load(Ordering::Relaxed),
            dropped_blocks: p.dropped_blocks.load(Ordering::Relaxed),
            lost_blocks: p.lost_blocks.load(Ordering::Relaxed),
            rate_bytes_per_sec: r.rate,
            elapsed_secs: elapsed.as_secs_f64(),
        })
    }
}
