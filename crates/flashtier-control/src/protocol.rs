//! The control protocol: one JSON object per line each way over a unix socket.
//!
//! Requests: `{"op":"report"}`, `{"op":"get","name":N}`, `{"op":"set","name":N,"value":V,
//! "persist":bool}`, `{"op":"set_many","settings":[{"name":N,"value":V},...],"persist":bool}`
//! (all or nothing: for parameters that constrain each other), `{"op":"params"}`, `{"op":"mode","mode":M}`, `{"op":"flush"}`,
//! `{"op":"flush_cancel"}`, `{"op":"reset_stats"}`, `{"op":"detach","force":bool}`,
//! `{"op":"attach","cache":PATH|null,"mode":M|null,"force":bool}`, `{"op":"scrub","rate":N|null}`,
//! `{"op":"scrub_cancel"}`, `{"op":"forget_lost","offset":N|null,"length":N|null}`,
//! `{"op":"memcached","action":A,...}` with `A` one of `list`, `add` / `remove` (with
//! `"server":"HOST:PORT"`), `mode` (with `"mode":"inclusive"|"victim"`), `on`, `off`.
//! Responses: `{"ok":true,"result":...}` or `{"ok":false,"error":"message"}`. Line-delimited
//! JSON keeps the protocol usable by hand (`socat - UNIX:control.sock`) and from any language.

use serde::{Deserialize, Deserializer, Serialize};

/// One request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The full [`crate::Report`].
    Report,
    /// `{"name", "value"}` of a parameter or `mode`.
    Get {
        /// The parameter's name, or `mode`.
        name: String,
    },
    /// Sets a parameter live (for `mode`, starts the switch); `{"name", "value"}` as stored.
    Set {
        /// The parameter's name, or `mode`.
        name: String,
        /// A string; numbers and booleans are accepted too and taken as written.
        #[serde(deserialize_with = "scalar")]
        value: String,
        /// Also write it to the config file, before applying it (default false).
        #[serde(default)]
        persist: bool,
    },
    /// Sets several parameters together, all or none (values that constrain each other are
    /// checked as the whole change leaves them): a list of `{"name", "value"}` as stored.
    SetMany {
        /// The change, in any order; `mode` is refused here.
        settings: Vec<Setting>,
        /// Also write them to the config file, before applying them (default false).
        #[serde(default)]
        persist: bool,
    },
    /// Every parameter as [`crate::ParamRow`]s.
    Params,
    /// Starts a mode switch in the background: `{"mode"}`; progress is the report's `job`.
    Mode {
        /// The mode to switch to, one of [`crate::MODES`].
        mode: String,
    },
    /// Starts a manual flush in the background (every dirty block written back, the backing
    /// store flushed): `null`; progress is the report's `job`.
    Flush,
    /// Stops the running flush after the backing write in flight: `null`.
    FlushCancel,
    /// Restarts counters, windows and latencies from zero: `null`.
    ResetStats,
    /// Starts detaching the cache in the background (written back first unless `force`, which
    /// discards dirty data): `{"dirty_blocks"}` as it starts; progress is the report's `job`.
    Detach {
        /// Discard the dirty blocks instead of writing them back (default false).
        #[serde(default)]
        force: bool,
    },
    /// Attaches a cache (`cache`: a device path; none: the one detached), formatted empty
    /// first: [`crate::Attached`].
    Attach {
        /// The device to attach; none: the one detached from this server.
        #[serde(default)]
        cache: Option<String>,
        /// The mode to run it in; none: the detached cache's, else `serve --mode`'s, else the
        /// device's default.
        #[serde(default)]
        mode: Option<String>,
        /// Format a device that holds another backing store's cache (default false).
        #[serde(default)]
        force: bool,
    },
    /// Starts a scrub in the background (`rate`: bytes per second at most; none: as fast as
    /// the device goes): `null`; progress is the report's `scrub`.
    Scrub {
        /// At most this many bytes per second; none: unlimited.
        #[serde(default)]
        rate: Option<u64>,
    },
    /// Stops the running scrub: `null`.
    ScrubCancel,
    /// Starts recording every client request to a new trace file: `{"path"}` (absolute; the
    /// server creates it, and refuses one that exists): [`crate::trace::TraceStatus`].
    TraceStart {
        /// The file to create.
        path: String,
    },
    /// Stops the trace once all of it is written and synced (with `path`: only a trace into
    /// that file): [`crate::trace::TraceStatus`].
    TraceStop {
        /// The running trace's file, if the caller wants to be sure which it stops.
        #[serde(default)]
        path: Option<String>,
    },
    /// Forgets lost blocks: all (no `offset`), or those the bytes from `offset` (`length`
    /// bytes; none: one block) touch: `{"forgotten"}`.
    ForgetLost {
        /// First byte of the range, on the exported device; none: every lost block.
        #[serde(default)]
        offset: Option<u64>,
        /// Bytes from `offset`; none: one block.
        #[serde(default)]
        length: Option<u64>,
    },
    /// Operates the memcached tier; every action answers the tier's
    /// [`MemcachedReport`](crate::report::MemcachedReport) after it.
    Memcached(MemcachedRequest),
}

/// What `{"op":"memcached"}` does, by its `action`; the fields an action needs are required
/// by its variant, so `{"action":"add"}` without a server is a bad request, not a runtime
/// surprise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum MemcachedRequest {
    /// Reports the tier and its servers.
    List,
    /// Adds a server to the pool: `{"server"}`.
    Add {
        /// `HOST:PORT`.
        server: String,
    },
    /// Removes a server from the pool: `{"server"}`.
    Remove {
        /// `HOST:PORT`, as listed.
        server: String,
    },
    /// Changes what the tier stores (the live parameter `memcached_mode`): `{"mode"}`.
    Mode {
        /// `inclusive` or `victim`.
        mode: String,
    },
    /// Turns the tier on: reads look in the pool again.
    On,
    /// Turns the tier off: requests go straight to the store below (writes still keep the
    /// versions exact, so turning it back on never serves old data).
    Off,
}

fn scalar<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Ok(s),
        v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => Ok(v.to_string()),
        _ => Err(serde::de::Error::custom(
            "value must be a string or a number",
        )),
    }
}

/// One response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Response {
    /// Whether the request was done; `result` or `error` says more.
    pub ok: bool,
    /// The answer of a request done (its shape depends on the request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// Why the request was refused, for the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    /// A request done, answering `result`.
    pub fn ok(result: serde_json::Value) -> Response {
        Response {
            ok: true,
            result: Some(result),
            error: None,
        }
    }

    /// A request refused, for the reason `message`.
    pub fn error(message: impl Into<String>) -> Response {
        Response {
            ok: false,
            result: None,
            error: Some(message.into()),
        }
    }
}

/// One value of `set_many`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setting {
    /// The parameter's name.
    pub name: String,
    /// A string; numbers and booleans are accepted too and taken as written.
    #[serde(deserialize_with = "scalar")]
    pub value: String,
}

/// The `result` of `get` and `set`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct NameValue {
    /// The parameter's name, or `mode`.
    pub name: String,
    /// Its value as stored, formatted as `set` would accept it.
    pub value: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_as_documented() {
        let r: Request =
            serde_json::from_str(r#"{"op":"set","name":"promotion_nhit","value":3}"#).unwrap();
        assert_eq!(
            r,
            Request::Set {
                name: "promotion_nhit".into(),
                value: "3".into(),
                persist: false
            }
        );
        let r: Request = serde_json::from_str(
            r#"{"op":"set_many","settings":[{"name":"a","value":80},{"name":"b","value":"9"}]}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            Request::SetMany {
                settings: vec![
                    Setting {
                        name: "a".into(),
                        value: "80".into()
                    },
                    Setting {
                        name: "b".into(),
                        value: "9".into()
                    }
                ],
                persist: false
            }
        );
        let r: Request = serde_json::from_str(r#"{"op":"reset_stats"}"#).unwrap();
        assert_eq!(r, Request::ResetStats);
        let r: Request = serde_json::from_str(r#"{"op":"flush"}"#).unwrap();
        assert_eq!(r, Request::Flush);
        let r: Request = serde_json::from_str(r#"{"op":"flush_cancel"}"#).unwrap();
        assert_eq!(r, Request::FlushCancel);
        let r: Request = serde_json::from_str(r#"{"op":"detach"}"#).unwrap();
        assert_eq!(r, Request::Detach { force: false });
        let r: Request = serde_json::from_str(r#"{"op":"attach","cache":"/dev/sdc"}"#).unwrap();
        assert_eq!(
            r,
            Request::Attach {
                cache: Some("/dev/sdc".into()),
                mode: None,
                force: false
            }
        );
        let r: Request = serde_json::from_str(r#"{"op":"scrub"}"#).unwrap();
        assert_eq!(r, Request::Scrub { rate: None });
        let r: Request = serde_json::from_str(r#"{"op":"scrub","rate":1048576}"#).unwrap();
        assert_eq!(
            r,
            Request::Scrub {
                rate: Some(1 << 20)
            }
        );
        let r: Request = serde_json::from_str(r#"{"op":"forget_lost"}"#).unwrap();
        assert_eq!(
            r,
            Request::ForgetLost {
                offset: None,
                length: None
            }
        );
        let r: Request =
            serde_json::from_str(r#"{"op":"forget_lost","offset":4096,"length":8192}"#).unwrap();
        assert_eq!(
            r,
            Request::ForgetLost {
                offset: Some(4096),
                length: Some(8192)
            }
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"explode"}"#).is_err());
        assert!(serde_json::from_str::<Request>(r#"{"op":"get"}"#).is_err());
        let line = serde_json::to_string(&Request::Mode { mode: "wt".into() }).unwrap();
        assert_eq!(line, r#"{"op":"mode","mode":"wt"}"#);
    }

    #[test]
    fn memcached_requests_parse_as_documented() {
        let parse = |line: &str| serde_json::from_str::<Request>(line);
        let mc = Request::Memcached;
        for (line, want) in [
            (
                r#"{"op":"memcached","action":"list"}"#,
                mc(MemcachedRequest::List),
            ),
            (
                r#"{"op":"memcached","action":"add","server":"10.0.0.5:11211"}"#,
                mc(MemcachedRequest::Add {
                    server: "10.0.0.5:11211".into(),
                }),
            ),
            (
                r#"{"action":"remove","server":"[::1]:11211","op":"memcached"}"#,
                mc(MemcachedRequest::Remove {
                    server: "[::1]:11211".into(),
                }),
            ),
            (
                r#"{"op":"memcached","action":"mode","mode":"victim"}"#,
                mc(MemcachedRequest::Mode {
                    mode: "victim".into(),
                }),
            ),
            (
                r#"{"op":"memcached","action":"on"}"#,
                mc(MemcachedRequest::On),
            ),
            (
                r#"{"op":"memcached","action":"off"}"#,
                mc(MemcachedRequest::Off),
            ),
        ] {
            let got = parse(line).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(got, want, "{line}");
            // What the CLI sends parses back to the same request.
            let sent = serde_json::to_string(&want).unwrap();
            assert_eq!(parse(&sent).unwrap(), want, "{sent}");
        }
        assert_eq!(
            serde_json::to_string(&mc(MemcachedRequest::Add {
                server: "h:1".into()
            }))
            .unwrap(),
            r#"{"op":"memcached","action":"add","server":"h:1"}"#
        );
        for bad in [
            r#"{"op":"memcached"}"#,
            r#"{"op":"memcached","action":"add"}"#,
            r#"{"op":"memcached","action":"remove"}"#,
            r#"{"op":"memcached","action":"mode"}"#,
            r#"{"op":"memcached","action":"explode"}"#,
            r#"{"op":"memcached","action":"add","server":11211}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad} parsed");
        }
    }
}
