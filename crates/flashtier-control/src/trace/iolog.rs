//! Converting traces to and from fio's iolog, so that any trace replays with fio
//! (`fio --read_iolog=FILE`) and any iolog (fio's `--write_iolog`, or one converted from
//! blktrace) can be analysed as a trace.
//!
//! fio writes version 3 (`fio version 3 iolog`): `TIME FILE ACTION [OFFSET LENGTH]`, TIME in
//! microseconds since the start. Version 2 has no times but a `wait` action (microseconds since
//! the last wait); both are read. What does not map one to one: fio has no write-zeroes (written
//! as a write of the range, which is what it does to a cache) and no record of requests a
//! recorder dropped (left out); both are counted in the summary. Flushes are `sync`.

use std::io::{BufRead, Read, Write};

use super::format::{TraceError, TraceHeader, TraceOp, TraceReader, TraceRecord, TraceWriter};

/// What a conversion did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Converted {
    /// Requests written.
    pub requests: u64,
    /// Write-zeroes written as writes (trace to iolog).
    pub zeroes_as_writes: u64,
    /// Records of dropped requests, and how many requests they stand for, left out (trace to
    /// iolog).
    pub lost_records: u64,
    /// Requests the recorder dropped, which the iolog therefore lacks too.
    pub lost_requests: u64,
    /// Distinct file names seen (iolog to trace): more than one are merged into one trace.
    pub files: Vec<String>,
}

/// Writes `trace` as a version 3 iolog whose I/O goes to `file` (the name fio replays against:
/// with `--ioengine=nbd` any name will do; against a device, its path), timed from its first
/// request.
pub fn trace_to_iolog<R: Read, W: Write>(
    trace: TraceReader<R>,
    mut out: W,
    file: &str,
) -> Result<Converted, TraceError> {
    let mut c = Converted::default();
    writeln!(out, "fio version 3 iolog")?;
    writeln!(out, "0 {file} add")?;
    writeln!(out, "0 {file} open")?;
    // Times from the first request: a trace started long before its first request would
    // otherwise replay with that long wait first.
    let (mut first, mut last) = (None, 0);
    for r in trace {
        let mut r = r?;
        let first = *first.get_or_insert(r.t_us);
        r.t_us = r.t_us.saturating_sub(first);
        last = last.max(r.t_us);
        let action = match r.op {
            TraceOp::Read => "read",
            TraceOp::Write => "write",
            TraceOp::Trim => "trim",
            TraceOp::Flush => "sync",
            TraceOp::WriteZeroes => {
                c.zeroes_as_writes += 1;
                "write"
            }
            TraceOp::Lost => {
                c.lost_records += 1;
                c.lost_requests += u64::from(r.len);
                continue;
            }
        };
        writeln!(out, "{} {file} {action} {} {}", r.t_us, r.offset, r.len)?;
        c.requests += 1;
    }
    writeln!(out, "{last} {file} close")?;
    out.flush()?;
    c.files.push(file.to_string());
    Ok(c)
}

/// Reads an iolog (version 2 or 3) and writes it as a trace. The trace's device size is the
/// end of the furthest request; its start time is `start_unix_us`.
pub fn iolog_to_trace<R: BufRead, W: Write>(
    input: R,
    out: W,
    start_unix_us: u64,
) -> Result<Converted, TraceError> {
    let mut c = Converted::default();
    let mut records = Vec::new();
    let mut lines = input.lines().enumerate();
    let version = match lines.next() {
        Some((_, line)) => match line?.trim() {
            "fio version 2 iolog" => 2,
            "fio version 3 iolog" => 3,
            other => {
                return Err(TraceError::Iolog {
                    line: 1,
                    why: format!("not a fio iolog header: {other:?}"),
                })
            }
        },
        None => {
            return Err(TraceError::Iolog {
                line: 1,
                why: "empty file".into(),
            })
        }
    };
    let mut waited_us = 0u64;
    let mut end = 0u64;
    for (i, line) in lines {
        let line = line?;
        let n = i + 1;
        let bad = |why: String| TraceError::Iolog { line: n, why };
        let mut fields = line.split_whitespace();
        let t_us = if version == 3 {
            match fields.next() {
                None => continue,
                Some(t) => t
                    .parse::<u64>()
                    .map_err(|_| bad(format!("bad timestamp {t:?}")))?,
            }
        } else {
            waited_us
        };
        let rest: Vec<&str> = fields.collect();
        let (file, action, range) = match rest[..] {
            [] if version == 2 => continue,
            [file, action] => (file, action, None),
            [file, action, offset, len] => {
                let offset = offset
                    .parse::<u64>()
                    .map_err(|_| bad(format!("bad offset {offset:?}")))?;
                let len = len
                    .parse::<u32>()
                    .map_err(|_| bad(format!("bad length {len:?}")))?;
                (file, action, Some((offset, len)))
            }
            _ => {
                return Err(bad(format!(
                    "expected FILE ACTION [OFFSET LENGTH]: {line:?}"
                )))
            }
        };
        if !c.files.iter().any(|f| f == file) {
            c.files.push(file.to_string());
        }
        let op = match (action, range) {
            ("add" | "open" | "close", _) => continue,
            ("wait", Some((us, _))) if version == 2 => {
                waited_us += us;
                continue;
            }
            ("read", Some(_)) => TraceOp::Read,
            ("write", Some(_)) => TraceOp::Write,
            ("trim", Some(_)) => TraceOp::Trim,
            ("sync" | "datasync" | "sync_file_range", _) => TraceOp::Flush,
            _ => return Err(bad(format!("unknown action {action:?}"))),
        };
        let (offset, len) = match op {
            TraceOp::Flush => (0, 0),
            _ => range.expect("an I/O action has a range"),
        };
        end = end.max(offset.saturating_add(u64::from(len)));
        records.push(TraceRecord {
            t_us,
            op,
            offset,
            len,
            fua: false,
        });
    }
    // Merged files or a hand-edited log may be out of time order; a trace is in arrival order.
    records.sort_by_key(|r| r.t_us);
    let mut w = TraceWriter::new(
        out,
        TraceHeader {
            start_unix_us,
            device_size: end,
        },
    )?;
    for r in &records {
        w.write(r)?;
    }
    w.finish()?;
    c.requests = records.len() as u64;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace_of(records: &[TraceRecord]) -> Vec<u8> {
        let mut w = TraceWriter::new(
            Vec::new(),
            TraceHeader {
                start_unix_us: 7,
                device_size: 1 << 20,
            },
        )
        .unwrap();
        for r in records {
            w.write(r).unwrap();
        }
        w.finish().unwrap()
    }

    fn rec(t_us: u64, op: TraceOp, offset: u64, len: u32) -> TraceRecord {
        TraceRecord {
            t_us,
            op,
            offset,
            len,
            fua: false,
        }
    }

    #[test]
    fn a_trace_becomes_a_version_3_iolog_and_back() {
        let records = [
            rec(0, TraceOp::Read, 0, 4096),
            rec(10, TraceOp::Write, 8192, 8192),
            rec(15, TraceOp::Flush, 0, 0),
            rec(20, TraceOp::Trim, 4096, 4096),
        ];
        // Recorded from 1 s before its first request; the iolog starts at that request.
        let late: Vec<TraceRecord> = records
            .iter()
            .map(|r| TraceRecord {
                t_us: r.t_us + 1_000_000,
                ..*r
            })
            .collect();
        let bytes = trace_of(&late);
        let mut iolog = Vec::new();
        let c = trace_to_iolog(TraceReader::new(&bytes[..]).unwrap(), &mut iolog, "nbd").unwrap();
        assert_eq!(c.requests, 4);
        let text = String::from_utf8(iolog.clone()).unwrap();
        assert_eq!(
            text,
            "fio version 3 iolog\n0 nbd add\n0 nbd open\n0 nbd read 0 4096\n\
             10 nbd write 8192 8192\n15 nbd sync 0 0\n20 nbd trim 4096 4096\n20 nbd close\n"
        );
        let mut back = Vec::new();
        let c = iolog_to_trace(&iolog[..], &mut back, 7).unwrap();
        assert_eq!((c.requests, c.files.clone()), (4, vec!["nbd".to_string()]));
        let r = TraceReader::new(&back[..]).unwrap();
        assert_eq!(r.header().device_size, 16384);
        let got: Vec<TraceRecord> = r.map(Result::unwrap).collect();
        assert_eq!(got, records);
    }

    #[test]
    fn what_fio_cannot_say_is_counted_not_hidden() {
        let bytes = trace_of(&[
            rec(0, TraceOp::WriteZeroes, 0, 65536),
            rec(1, TraceOp::Lost, 0, 17),
            rec(2, TraceOp::Read, 0, 4096),
        ]);
        let mut iolog = Vec::new();
        let c = trace_to_iolog(TraceReader::new(&bytes[..]).unwrap(), &mut iolog, "f").unwrap();
        assert_eq!(
            (
                c.requests,
                c.zeroes_as_writes,
                c.lost_records,
                c.lost_requests
            ),
            (2, 1, 1, 17)
        );
        assert!(String::from_utf8(iolog)
            .unwrap()
            .contains("0 f write 0 65536\n"));
    }

    #[test]
    fn a_version_2_iolog_takes_its_times_from_waits() {
        let v2 = "fio version 2 iolog\n/dev/x add\n/dev/x open\n/dev/x read 0 4096\n\
                  /dev/x wait 500 0\n/dev/x write 4096 4096\n/dev/x datasync 0 0\n/dev/x close\n";
        let mut out = Vec::new();
        let c = iolog_to_trace(v2.as_bytes(), &mut out, 0).unwrap();
        assert_eq!(c.requests, 3);
        let got: Vec<TraceRecord> = TraceReader::new(&out[..])
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            got,
            [
                rec(0, TraceOp::Read, 0, 4096),
                rec(500, TraceOp::Write, 4096, 4096),
                rec(500, TraceOp::Flush, 0, 0)
            ]
        );
    }

    #[test]
    fn a_bad_line_is_named() {
        let mut out = Vec::new();
        let e = iolog_to_trace(
            "fio version 3 iolog\n0 f read 0 4096\n1 f frobnicate 0 1\n".as_bytes(),
            &mut out,
            0,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "fio iolog line 3: unknown action \"frobnicate\""
        );
        let e = iolog_to_trace("hello\n".as_bytes(), &mut out, 0).unwrap_err();
        assert!(e.to_string().contains("not a fio iolog header"), "{e}");
    }
}
