//! The live parameters, read and changed on an open cache (the table and its checks are
//! `tunables`).

use crate::tunables::{ParamError, ParamInfo};

use super::Cache;

impl Cache {
    /// The current value of `name`, formatted as `set_param` accepts it.
    pub fn get_param(&self, name: &str) -> Result<String, ParamError> {
        let e = self.engine();
        e.tunables.value_of(name)
    }

    /// Checks and applies `value` to `name`; it takes effect from the next request.
    pub fn set_param(&self, name: &str, value: &str) -> Result<(), ParamError> {
        self.set_params(&[(name, value)])
    }

    /// Checks `settings` (later entries win) against each other and the current values, and
    /// applies all of them or none.
    pub fn set_params<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<(), ParamError> {
        let e = self.engine();
        let changed = e.tunables.set_all(settings)?;
        if changed.iter().any(|name| name.starts_with("writeback_")) {
            // The cleaner re-plans at once (a new target, rate or watermark).
            e.writeback.wake();
        }
        Ok(())
    }

    /// What [`Cache::set_params`] would say, without changing anything.
    pub fn check_params<N: AsRef<str>, V: AsRef<str>>(
        &self,
        settings: &[(N, V)],
    ) -> Result<(), ParamError> {
        let e = self.engine();
        e.tunables.check_all(settings)
    }

    /// Every parameter with its current value.
    pub fn params(&self) -> Vec<(&'static ParamInfo, String)> {
        let e = self.engine();
        e.tunables.values()
    }
}
