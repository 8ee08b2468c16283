//! The write-back rate controller: a proportional-integral controller steering the dirty level
//! toward a target, after bcache's (`__update_writeback_rate`). Pure arithmetic, no I/O and no
//! clock: the cleaner feeds it the dirty level every update period and spends the rate it
//! returns.
//!
//! - The *proportional* term is the excess over the target divided by a time constant
//!   ([`PiConfig::p_secs`]): on its own it drains an excess exponentially, with that time
//!   constant, without ever going below the target.
//! - The *integral* term accumulates the excess over time ([`PiConfig::i_secs2`] scales it), so
//!   a steady inflow of dirty data, which the proportional term alone would only match with a
//!   standing excess, is matched at the target.
//! - *Anti-windup*: the integral does not grow while the output is held at the maximum, nor while
//!   the cleaner could not deliver the previous rate (a slow backing store is a saturated
//!   actuator too); otherwise a long overload would leave a large integral behind and the drain
//!   would overshoot once the load stops. Below the target the integral drains (by the negative
//!   excess) and decays, and the output is zero: the controller never writes back below target.
//! - A small minimum rate while above the target makes a tiny excess converge too (the
//!   proportional term of one block would be a block per `p_secs`).

/// The controller's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PiConfig {
    /// Proportional time constant: an excess of `x` bytes asks for `x / p_secs` bytes/s.
    pub p_secs: f64,
    /// Integral scale: `integral / i_secs2` bytes/s, the integral in byte-seconds of excess.
    pub i_secs2: f64,
    /// Smallest rate while above the target, bytes/s.
    pub min_rate: f64,
    /// Factor by which the integral shrinks per second while at or below the target.
    pub decay_per_sec: f64,
}

impl Default for PiConfig {
    fn default() -> Self {
        PiConfig {
            p_secs: 10.0,
            i_secs2: 4000.0,
            min_rate: 64.0 * 1024.0,
            decay_per_sec: 0.5,
        }
    }
}

/// The controller's state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pi {
    /// Byte-seconds of excess accumulated (never negative).
    integral: f64,
    /// The last rate returned, bytes/s.
    rate: f64,
}

impl Pi {
    /// One update after `dt` seconds: `dirty` and `target` in bytes, `max_rate` the cap (bytes/s,
    /// may be infinite), `achieved` the rate the cleaner managed since the last update (bytes/s).
    /// Returns the new rate: 0 at or below the target, else within `[min_rate, max_rate]` (the
    /// minimum itself capped by `max_rate`).
    pub fn update(
        &mut self,
        cfg: &PiConfig,
        dirty: f64,
        target: f64,
        dt: f64,
        max_rate: f64,
        achieved: f64,
    ) -> f64 {
        let dt = dt.max(0.0);
        let error = dirty - target;
        if error <= 0.0 {
            self.integral = (self.integral + error * dt).max(0.0) * cfg.decay_per_sec.powf(dt);
            self.rate = 0.0;
            return 0.0;
        }
        let max_rate = max_rate.max(0.0);
        let min_rate = cfg.min_rate.min(max_rate);
        let proportional = error / cfg.p_secs;
        let integral = self.integral + error * dt;
        let out = proportional + integral / cfg.i_secs2;
        // The cleaner fell short of the last rate: the backing store is the limit, and
        // integrating would only store up excess for later.
        let starved = self.rate > 0.0 && achieved < 0.9 * self.rate;
        if out <= max_rate && !starved {
            self.integral = integral;
        }
        // Whatever was integrated before, the integral term alone never asks for more than
        // the cap, so leaving saturation takes no unwinding.
        if max_rate.is_finite() {
            self.integral = self.integral.min(max_rate * cfg.i_secs2);
        }
        self.rate = out.clamp(min_rate, max_rate);
        self.rate
    }

    /// The last rate returned.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Forgets the history (the controller was off, or the mode left write-back).
    pub fn reset(&mut self) {
        *self = Pi::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: f64 = 1024.0 * 1024.0;

    /// Simulates a plant: each step of `dt`, `inflow(t)` bytes/s arrive and the controller's rate
    /// (limited to what the backing store can take) drains. Returns the dirty level and rate per
    /// step.
    fn simulate(
        cfg: &PiConfig,
        start: f64,
        target: f64,
        max_rate: f64,
        backing: f64,
        inflow: impl Fn(f64) -> f64,
        secs: f64,
    ) -> Vec<(f64, f64)> {
        let (mut pi, mut dirty, dt) = (Pi::default(), start, 1.0);
        let mut achieved = 0.0;
        let mut out = Vec::new();
        let mut t = 0.0;
        while t < secs {
            let rate = pi.update(cfg, dirty, target, dt, max_rate, achieved);
            let drained = rate.min(backing).min(dirty + inflow(t) * dt) * dt;
            achieved = drained / dt;
            dirty = dirty + inflow(t) * dt - drained;
            out.push((dirty, rate));
            t += dt;
        }
        out
    }

    #[test]
    fn zero_at_or_below_target() {
        let cfg = PiConfig::default();
        let mut pi = Pi::default();
        assert_eq!(
            pi.update(&cfg, 10.0 * MIB, 10.0 * MIB, 1.0, f64::INFINITY, 0.0),
            0.0
        );
        assert_eq!(
            pi.update(&cfg, 0.0, 10.0 * MIB, 1.0, f64::INFINITY, 0.0),
            0.0
        );
        assert!(pi.update(&cfg, 10.0 * MIB + 1.0, 10.0 * MIB, 1.0, f64::INFINITY, 0.0) > 0.0);
    }

    #[test]
    fn proportional_to_the_excess_at_first() {
        let cfg = PiConfig::default();
        let mut pi = Pi::default();
        let r = pi.update(&cfg, 110.0 * MIB, 10.0 * MIB, 1.0, f64::INFINITY, 0.0);
        // 100 MiB over: 10 MiB/s proportional, plus 100 MiB·s / 4000 s² integral.
        assert!((r - 10.025 * MIB).abs() < 1.0, "{r}");
    }

    #[test]
    fn drains_an_excess_without_inflow_to_the_target() {
        let cfg = PiConfig::default();
        let run = simulate(
            &cfg,
            200.0 * MIB,
            50.0 * MIB,
            f64::INFINITY,
            1e12,
            |_| 0.0,
            300.0,
        );
        let (dirty, rate) = *run.last().unwrap();
        // The integral overshoots a little (PI): within 1% of the 150 MiB excess.
        assert!((dirty - 50.0 * MIB).abs() < 1.5 * MIB, "{dirty}");
        assert!(run.iter().all(|&(d, _)| d >= 48.5 * MIB), "undershoot");
        assert_eq!(rate, 0.0);
    }

    #[test]
    fn saturation_does_not_wind_up() {
        // Inflow above what can be written back for ten minutes (the cap, then a slow backing
        // store), then none: with windup the integral, grown over the whole overload, would
        // hold the rate up when the excess is nearly gone and drain far below the target.
        let cfg = PiConfig::default();
        for (cap, backing) in [(4.0 * MIB, 1e12), (f64::INFINITY, 4.0 * MIB)] {
            let run = simulate(
                &cfg,
                20.0 * MIB,
                20.0 * MIB,
                cap,
                backing,
                |t| if t < 600.0 { 8.0 * MIB } else { 0.0 },
                3000.0,
            );
            // ~2.4 GiB over the target after the overload, drained at 4 MiB/s.
            let near = run
                .iter()
                .position(|&(d, _)| d < 21.0 * MIB)
                .expect("never drained");
            let (_, rate) = run[near];
            assert!(rate < 1.0 * MIB, "rate {rate} with the excess nearly gone");
            let lowest = run.iter().map(|&(d, _)| d).fold(f64::MAX, f64::min);
            assert!(lowest > 19.0 * MIB, "drained to {lowest}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Against a plant with a steady inflow the backing store can absorb: the rate is never
        /// negative, never above the cap, zero whenever dirty is at or below the target; dirty
        /// never drops below the target by more than one step's rate; and it ends near the target.
        #[test]
        fn converges_bounded(
            start_mib in 0.0f64..4096.0,
            target_mib in 0.0f64..1024.0,
            inflow_mib in 0.0f64..20.0,
            cap_mib in prop::option::of(25.0f64..500.0),
            backing_mib in 25.0f64..1000.0,
        ) {
            let cfg = PiConfig::default();
            let cap = cap_mib.map_or(f64::INFINITY, |c| c * MIB);
            let (target, inflow) = (target_mib * MIB, inflow_mib * MIB);
            let mut pi = Pi::default();
            let (mut dirty, mut achieved) = (start_mib * MIB, 0.0);
            let mut max_excess: f64 = 0.0;
            for step in 0..3000 {
                let rate = pi.update(&cfg, dirty, target, 1.0, cap, achieved);
                prop_assert!(rate >= 0.0 && rate <= cap, "step {step}: rate {rate}");
                if dirty <= target {
                    prop_assert_eq!(rate, 0.0);
                }
                let drained = rate.min(backing_mib * MIB).min(dirty + inflow);
                achieved = drained;
                dirty = dirty + inflow - drained;
                max_excess = max_excess.max(dirty - target);
                // PI overshoot: a small share of the largest excess, or one minimum-rate step.
                let slack = 0.02 * max_excess + cfg.min_rate + 1.0;
                prop_assert!(dirty >= target.min(start_mib * MIB) - slack,
                    "step {step}: undershoot to {dirty}");
            }
            // Within a few MiB (and a few seconds' inflow) of the target, or below it with no
            // excess to drain.
            prop_assert!(dirty <= target + 8.0 * MIB + 4.0 * inflow, "ends at {dirty} for {target}");
        }
    }
}
