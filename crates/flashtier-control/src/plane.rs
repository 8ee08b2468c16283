//! [`ControlPlane`]: everything `flashtier serve` starts next to the NBD server, and stops with it.
//!
//! - the control socket ([`ControlServer`]),
//! - the ticker thread: every second it samples the counters for the windows and rewrites the
//!   stats file (one report for both files),
//! - the Prometheus listener (`MetricsServer`), if asked for.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::controller::{ControlError, Controller};
use crate::metrics::MetricsServer;
use crate::server::ControlServer;
use crate::statsfile::StatsFile;

/// How often the windows are sampled and the stats file rewritten.
pub const TICK: Duration = Duration::from_secs(1);

/// Where the control plane listens and writes.
#[derive(Debug, Clone)]
pub struct ControlPlaneOptions {
    /// `None` = no control socket.
    pub control_socket: Option<PathBuf>,
    /// `HOST:PORT` or `:PORT`; `None` = no metrics listener.
    pub metrics_listen: Option<String>,
    /// The stats file (`PATH` and `PATH.json`); `None` = none.
    pub stats_file: Option<PathBuf>,
}

/// The running control plane; [`stop`](Self::stop) (or drop) ends its threads and removes the
/// files it created.
pub struct ControlPlane {
    controller: Arc<Controller>,
    server: Option<ControlServer>,
    metrics: Option<MetricsServer>,
    stats_file: Option<Arc<StatsFile>>,
    ticker: Option<(Sender<()>, JoinHandle<()>)>,
}

impl ControlPlane {
    /// Starts what `opts` asks for around `controller`: the socket first (so a socket in use
    /// stops the start before any file is touched), then metrics, the stats file and the ticker.
    pub fn start(
        controller: Arc<Controller>,
        opts: &ControlPlaneOptions,
    ) -> Result<ControlPlane, ControlError> {
        // The socket first: if it is taken, nothing else (another server's stats file) is touched.
        let server = match &opts.control_socket {
            Some(p) => Some(ControlServer::start(p, controller.clone())?),
            None => None,
        };
        let metrics = match &opts.metrics_listen {
            Some(a) => Some(MetricsServer::start(a, controller.clone())?),
            None => None,
        };
        let stats_file = match &opts.stats_file {
            Some(p) => {
                let f = Arc::new(StatsFile::create(p)?);
                // Written once before serve reports it, so it exists as soon as it is named.
                f.write(&controller.report())?;
                Some(f)
            }
            None => None,
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let ticker = {
            let (c, f) = (controller.clone(), stats_file.clone());
            std::thread::Builder::new()
                .name("flashtier-stats".into())
                .spawn(move || loop {
                    match stopped.recv_timeout(TICK) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    c.tick();
                    if let Some(f) = &f {
                        if let Err(e) = f.write(&c.report()) {
                            tracing::warn!(
                                "cannot write the stats file {}: {e}",
                                f.path().display()
                            );
                        }
                    }
                })?
        };
        Ok(ControlPlane {
            controller,
            server,
            metrics,
            stats_file,
            ticker: Some((stop, ticker)),
        })
    }

    /// The controller every listener answers from.
    pub fn controller(&self) -> &Arc<Controller> {
        &self.controller
    }

    /// Where the control socket listens, for `serve` to print; `None` without one.
    pub fn control_socket(&self) -> Option<&Path> {
        self.server.as_ref().map(ControlServer::path)
    }

    /// The address the metrics listener bound (the real port when 0 was asked for); `None`
    /// without one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsServer::addr)
    }

    /// The stats file and its JSON twin.
    pub fn stats_files(&self) -> Option<(&Path, &Path)> {
        self.stats_file
            .as_deref()
            .map(|f| (f.path(), f.json_path()))
    }

    /// Stops every thread and removes the socket and stats files.
    pub fn stop(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if let Some((stop, ticker)) = self.ticker.take() {
            let _ = stop.send(());
            let _ = ticker.join();
        }
        if let Some(s) = &mut self.server {
            s.stop();
        }
        if let Some(m) = &mut self.metrics {
            m.stop();
        }
        if let Some(f) = &self.stats_file {
            f.remove();
        }
        if self.controller.job_running() {
            // A flush stops after its backing write in flight (a mode switch cannot).
            let _ = self.controller.cancel_flush();
            tracing::warn!(
                "a mode switch or flush was still running; the cache keeps its dirty blocks and \
                 the next start uses the mode recorded on the device"
            );
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Client;
    use crate::controller::tests::cached;

    #[test]
    fn starts_everything_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let opts = ControlPlaneOptions {
            control_socket: Some(dir.path().join("control.sock")),
            metrics_listen: Some("127.0.0.1:0".into()),
            stats_file: Some(dir.path().join("stats")),
        };
        let (c, _) = cached(None);
        let plane = ControlPlane::start(c, &opts).unwrap();
        let (text, json) = plane.stats_files().unwrap();
        assert!(text.exists() && json.exists());
        let before = std::fs::metadata(json).unwrap().modified().unwrap();
        std::thread::sleep(TICK * 2 + Duration::from_millis(200));
        assert!(
            std::fs::metadata(json).unwrap().modified().unwrap() > before,
            "rewritten"
        );
        assert!(Client::connect(plane.control_socket().unwrap())
            .unwrap()
            .report()
            .is_ok());
        assert!(plane.metrics_addr().is_some());
        plane.stop();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "all removed"
        );
    }
}
