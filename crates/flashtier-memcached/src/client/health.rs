//! A server's health: up, or down with a backoff before the next probe.
//!
//! A server that failed is not asked again until its backoff has passed: a dead server costs a
//! connect timeout (or a refused connection) per request otherwise, for every caller. When the
//! backoff has passed, exactly one request is let through as the probe while the others keep
//! skipping, so a server that is still dead costs one request per backoff period, and one that
//! is back is found on the first request after its backoff.
//!
//! [`HealthState`] is the pure state machine: the time is passed in, so the tests drive it
//! without sleeping. The pool keeps one per server behind a mutex.

use std::time::{Duration, Instant};

/// A server's health as reported by [`crate::client::Pool::servers`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Requests go to the server.
    Up,
    /// The server failed; its keys are skipped (they miss) until a probe succeeds.
    Down {
        /// When the failure that took it down happened.
        since: Instant,
        /// When the next probe may be sent (a probe may be under way already).
        retry_at: Instant,
        /// The most recent failure.
        last_error: String,
    },
}

impl Health {
    /// Whether the server is up.
    pub fn is_up(&self) -> bool {
        matches!(self, Health::Up)
    }
}

/// How long a down server waits before each probe.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    pub(crate) min: Duration,
    pub(crate) max: Duration,
}

impl Backoff {
    fn first(&self) -> Duration {
        self.min.min(self.max)
    }

    fn after(&self, previous: Duration) -> Duration {
        previous.saturating_mul(2).clamp(self.first(), self.max)
    }
}

/// What a request may do with a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// The server is up: send.
    Go,
    /// The server is down and this request is its probe: send, and report the outcome.
    Probe,
    /// The server is down: do not send.
    Skip,
}

/// What a reported outcome changed, for the caller to log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    /// Nothing worth a log line.
    None,
    /// The server was up and just failed.
    WentDown { retry_in: Duration },
    /// The probe failed; the backoff grew.
    ProbeFailed { retry_in: Duration },
    /// The probe succeeded.
    CameUp { down_for: Duration },
}

#[derive(Debug)]
struct Down {
    since: Instant,
    retry_at: Instant,
    backoff: Duration,
    last_error: String,
}

/// One server's health state machine.
#[derive(Debug, Default)]
pub(crate) struct HealthState {
    down: Option<Down>,
    probing: bool,
}

impl HealthState {
    pub(crate) fn is_up(&self) -> bool {
        self.down.is_none()
    }

    /// Decides whether a request at `now` may go to the server. A [`Admission::Probe`] must be
    /// followed by [`Self::succeeded`], [`Self::failed`] or [`Self::abandon_probe`], or the server
    /// is never probed again.
    pub(crate) fn admit(&mut self, now: Instant) -> Admission {
        match &self.down {
            None => Admission::Go,
            Some(d) if now >= d.retry_at && !self.probing => {
                self.probing = true;
                Admission::Probe
            }
            Some(_) => Admission::Skip,
        }
    }

    /// The probe was admitted but nothing was sent (so nothing was learned).
    pub(crate) fn abandon_probe(&mut self) {
        self.probing = false;
    }

    /// A request completed. Only the probe brings a down server back: a request admitted before
    /// the server went down may finish after, on a connection opened before the failure, and says
    /// little about the server now.
    pub(crate) fn succeeded(&mut self, now: Instant, probe: bool) -> Transition {
        if !probe {
            return Transition::None;
        }
        self.probing = false;
        match self.down.take() {
            Some(d) => Transition::CameUp {
                down_for: now.saturating_duration_since(d.since),
            },
            None => Transition::None,
        }
    }

    /// A request failed with `error`.
    pub(crate) fn failed(
        &mut self,
        now: Instant,
        probe: bool,
        error: String,
        policy: &Backoff,
    ) -> Transition {
        if probe {
            self.probing = false;
        }
        match &mut self.down {
            None => {
                let backoff = policy.first();
                self.down = Some(Down {
                    since: now,
                    retry_at: later(now, backoff),
                    backoff,
                    last_error: error,
                });
                Transition::WentDown { retry_in: backoff }
            }
            Some(d) if probe => {
                d.backoff = policy.after(d.backoff);
                d.retry_at = later(now, d.backoff);
                d.last_error = error;
                Transition::ProbeFailed {
                    retry_in: d.backoff,
                }
            }
            // A request admitted while the server was up, failing after another already took it
            // down: the same outage, so the backoff stands.
            Some(d) => {
                d.last_error = error;
                Transition::None
            }
        }
    }

    pub(crate) fn report(&self) -> Health {
        match &self.down {
            None => Health::Up,
            Some(d) => Health::Down {
                since: d.since,
                retry_at: d.retry_at,
                last_error: d.last_error.clone(),
            },
        }
    }
}

/// `now + d`, saturating at a distant instant rather than panicking on an absurd duration.
pub(crate) fn later(now: Instant, d: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(100 * 365 * 86_400);
    now.checked_add(d.min(FAR))
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn policy() -> Backoff {
        Backoff {
            min: 100 * MS,
            max: 1000 * MS,
        }
    }

    fn retry_at(h: &HealthState) -> Instant {
        match h.report() {
            Health::Down { retry_at, .. } => retry_at,
            Health::Up => panic!("up"),
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets_on_success() {
        let t0 = Instant::now();
        let p = policy();
        let mut h = HealthState::default();
        assert_eq!(h.admit(t0), Admission::Go);
        assert_eq!(
            h.failed(t0, false, "refused".into(), &p),
            Transition::WentDown { retry_in: 100 * MS }
        );
        assert!(!h.is_up());
        let mut now = t0;
        let mut expected = 100;
        for want in [200, 400, 800, 1000, 1000] {
            assert_eq!(h.admit(now), Admission::Skip);
            now = retry_at(&h);
            assert!(now - t0 >= expected * MS);
            assert_eq!(h.admit(now), Admission::Probe);
            assert_eq!(
                h.failed(now, true, "refused".into(), &p),
                Transition::ProbeFailed {
                    retry_in: want * MS
                }
            );
            assert_eq!(retry_at(&h), now + want * MS);
            expected += want;
        }
        now = retry_at(&h);
        assert_eq!(h.admit(now), Admission::Probe);
        assert_eq!(
            h.succeeded(now + MS, true),
            Transition::CameUp {
                down_for: now + MS - t0
            }
        );
        assert_eq!(h.report(), Health::Up);
        // A new outage starts again from the minimum.
        assert_eq!(
            h.failed(now, false, "reset".into(), &p),
            Transition::WentDown { retry_in: 100 * MS }
        );
    }

    #[test]
    fn one_probe_at_a_time() {
        let t0 = Instant::now();
        let p = policy();
        let mut h = HealthState::default();
        h.failed(t0, false, "x".into(), &p);
        let t1 = t0 + 100 * MS;
        assert_eq!(h.admit(t1), Admission::Probe);
        assert_eq!(h.admit(t1), Admission::Skip);
        assert_eq!(h.admit(t1 + 50 * MS), Admission::Skip);
        // An abandoned probe frees the slot without changing the backoff.
        h.abandon_probe();
        assert_eq!(h.admit(t1), Admission::Probe);
        assert_eq!(
            h.succeeded(t1, true),
            Transition::CameUp { down_for: 100 * MS }
        );
        assert_eq!(h.admit(t1), Admission::Go);
        assert_eq!(h.admit(t1), Admission::Go);
    }

    #[test]
    fn stragglers_neither_revive_nor_extend_an_outage() {
        let t0 = Instant::now();
        let p = policy();
        let mut h = HealthState::default();
        h.failed(t0, false, "first".into(), &p);
        // Requests admitted before the outage finish after it began.
        assert_eq!(
            h.failed(t0 + MS, false, "second".into(), &p),
            Transition::None
        );
        assert_eq!(h.succeeded(t0 + MS, false), Transition::None);
        assert_eq!(
            h.report(),
            Health::Down {
                since: t0,
                retry_at: t0 + 100 * MS,
                last_error: "second".into()
            }
        );
    }

    #[test]
    fn odd_policies_behave() {
        let t0 = Instant::now();
        let inverted = Backoff {
            min: 5000 * MS,
            max: 10 * MS,
        };
        let mut h = HealthState::default();
        assert_eq!(
            h.failed(t0, false, "x".into(), &inverted),
            Transition::WentDown { retry_in: 10 * MS }
        );
        let zero = Backoff {
            min: Duration::ZERO,
            max: Duration::ZERO,
        };
        let mut h = HealthState::default();
        h.failed(t0, false, "x".into(), &zero);
        assert_eq!(h.admit(t0), Admission::Probe);
        let huge = Backoff {
            min: Duration::MAX,
            max: Duration::MAX,
        };
        let mut h = HealthState::default();
        h.failed(t0, false, "x".into(), &huge);
        assert_eq!(h.admit(t0 + Duration::from_secs(3600)), Admission::Skip);
    }
}
