//! What a failed worker left behind, and the one root-cause rule and renderer: which worker is
//! the cause ([`root_cause`]), where, how (exit code or signal name), and why (its error file,
//! torch's error.json format, or else the last lines of its stderr). No decorator is needed to
//! see why a worker died. Python's `ChildFailedError` renders through [`summary`] too.

use std::time::SystemTime;

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::agent::hangs::flight::Holdup;
use crate::agent::hangs::heartbeats::Lapse;

/// Lines of stderr kept per worker for the summary.
pub const STDERR_TAIL_LINES: usize = 20;
/// Width cap of the summary's rules, as torch's.
const MAX_RULE: usize = 60;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Failure {
    pub global_rank: u32,
    pub local_rank: u32,
    pub host: String,
    pub pid: u32,
    /// The exit code, or minus the signal number for a worker killed by a signal (Python's
    /// convention).
    pub exitcode: i32,
    pub signal: Option<String>,
    /// Seconds since the Unix epoch (millisecond precision).
    pub timestamp: f64,
    /// The worker's error file, when it wrote one.
    pub error_file: Option<String>,
    /// The error file's message, else the stderr tail, else what the exit says; for a hung
    /// worker, its threads' stacks.
    pub message: String,
    /// Why the worker counted as hung, and when it last sent a heartbeat.
    #[serde(default)]
    pub hung: Option<String>,
    /// Other ranks waited in a collective for this one (their flight records say so): it holds
    /// everyone up, whoever was found hung first.
    #[serde(default)]
    pub held_others_up: bool,
}

impl Failure {
    /// `error_file` is read if it exists; `stderr_tail` is the worker's last stderr lines.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        global_rank: u32,
        local_rank: u32,
        host: &str,
        pid: u32,
        exitcode: i32,
        at: SystemTime,
        error_file: &str,
        stderr_tail: &[String],
    ) -> Failure {
        let signal = (exitcode < 0).then(|| signal_name(-exitcode));
        let from_file = read_error_file(error_file);
        let message = match (&from_file, &signal) {
            (Some(message), _) => message.clone(),
            (None, _) if !stderr_tail.is_empty() => stderr_tail.join("\n"),
            (None, Some(name)) => format!("Signal {} ({name}) received by PID {pid}", -exitcode),
            (None, None) => format!("exited with code {exitcode} without writing an error file or to stderr"),
        };
        Failure {
            global_rank,
            local_rank,
            host: host.to_owned(),
            pid,
            exitcode,
            signal,
            timestamp: at.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
            error_file: from_file.map(|_| error_file.to_owned()),
            message,
            hung: None,
            held_others_up: false,
        }
    }

    /// The failure of a worker that was killed as hung: why, who held it up (if a collective's
    /// flight records say: [`Holdup`]), its last heartbeat, its stacks (or why there are none).
    pub fn hung(
        mut self,
        lapse: &Lapse,
        holdup: Option<&Holdup>,
        last_beat: Option<SystemTime>,
        stacks: Result<String, String>,
    ) -> Failure {
        self.held_others_up = holdup.is_some_and(|holdup| holdup.is_missing(self.global_rank));
        let last = last_beat.map_or_else(|| "never".to_owned(), |at| humantime::format_rfc3339_millis(at).to_string());
        self.hung = Some(match holdup {
            Some(holdup) => format!("{lapse}; {holdup}; last heartbeat: {last}"),
            None => format!("{lapse}; last heartbeat: {last}"),
        });
        self.message = match stacks {
            Ok(stacks) => format!("stacks when it was found hung:\n{stacks}"),
            Err(why) => format!("no stacks: {why}"),
        };
        self
    }

    /// One block of the summary, in torch's layout (local time to the second; continuation
    /// lines indented by two), with a `hung` line for a hung worker.
    fn block(&self, index: usize) -> String {
        let exit = match &self.signal {
            Some(name) => format!("{} (pid: {}) ({name})", self.exitcode, self.pid),
            None => format!("{} (pid: {})", self.exitcode, self.pid),
        };
        let detail = self.message.replace('\n', "\n  ");
        let hung = self.hung.as_ref().map(|why| format!("\n  hung      : {why}")).unwrap_or_default();
        format!(
            "[{index}]:\n  time      : {}\n  host      : {}\n  rank      : {} (local_rank: {})\n  exitcode  : {exit}{hung}\n  error_file: {}\n  traceback : {detail}",
            local_time(self.timestamp),
            self.host,
            self.global_rank,
            self.local_rank,
            self.error_file.as_deref().unwrap_or("<N/A>"),
        )
    }

    /// One line for logs and timelines: "rank 1 (host h) exited with 1: ValueError: bad".
    pub fn headline(&self) -> String {
        let how = match (&self.hung, &self.signal) {
            (Some(why), _) => format!("was hung ({why})"),
            (None, Some(signal)) => format!("was killed by {signal}"),
            (None, None) => format!("exited with {}", self.exitcode),
        };
        let last = self.message.lines().rev().find(|line| !line.trim().is_empty()).unwrap_or("").trim();
        let last = if self.hung.is_some() || last.is_empty() { String::new() } else { format!(": {last}") };
        format!("rank {} (host {}) {how}{last}", self.global_rank, self.host)
    }
}

/// The root cause among one attempt's failures: a worker the others waited for in a collective
/// (a rank waiting for a hung peer is not the cause: the peer is), else the first observed
/// failure; ties go to the lower rank. `None` for no failures.
pub fn root_cause(failures: &[Failure]) -> Option<usize> {
    let key = |f: &Failure| (!f.held_others_up, f.timestamp, f.global_rank);
    (0..failures.len()).min_by(|&a, &b| {
        let (a, b) = (key(&failures[a]), key(&failures[b]));
        a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2))
    })
}

/// `YYYY-MM-DD_HH:MM:SS` in local time, as torch shows a failure's time.
fn local_time(timestamp: f64) -> String {
    let seconds = timestamp.floor() as libc::time_t;
    // SAFETY: `tm` is plain data that localtime_r fills in; both pointers are valid for the
    // call, and localtime_r is the thread-safe variant (no shared static result).
    let tm = unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&seconds, &mut tm).is_null() {
            return format!("{seconds}");
        }
        tm
    };
    format!(
        "{:04}-{:02}-{:02}_{:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// "SIGSEGV" for 11, or "signal N" for numbers Linux does not name.
pub fn signal_name(number: i32) -> String {
    Signal::try_from(number).map_or_else(|_| format!("signal {number}"), |signal| signal.as_str().to_owned())
}

/// The message of a torch-format error file: `{"message": {"message": ..., "extraInfo":
/// {"py_callstack": ...}}}` or `{"message": "..."}`; the call stack when there is one.
fn read_error_file(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(json) => json,
        Err(err) => return Some(format!("unreadable error file ({err}): {}", text.trim())),
    };
    let message = &json["message"];
    if let Some(text) = message.as_str() {
        return Some(text.to_owned());
    }
    let stack = message["extraInfo"]["py_callstack"].as_str();
    let summary = message["message"].as_str();
    stack.or(summary).map(|s| s.trim_end().to_owned()).or_else(|| Some(json.to_string()))
}

/// torch's ChildFailedError layout: the other failures, then the root cause ([`root_cause`]);
/// blocks are numbered by their place in `failures`.
pub fn summary(name: &str, failures: &[Failure]) -> String {
    let Some(root) = root_cause(failures) else {
        return format!("{name} FAILED (no worker failure recorded)");
    };
    let title = format!("{name} FAILED");
    let other_blocks: Vec<String> =
        failures.iter().enumerate().filter(|(i, _)| *i != root).map(|(i, f)| f.block(i)).collect();
    let root_block = failures[root].block(root);
    let width = std::iter::once(title.as_str())
        .chain(other_blocks.iter().chain([&root_block]).flat_map(|b| b.lines()))
        .map(str::len)
        .max()
        .unwrap_or(0)
        .min(MAX_RULE);
    let (heavy, light) = ("=".repeat(width), "-".repeat(width));
    let others_text =
        if other_blocks.is_empty() { "  <NO_OTHER_FAILURES>".to_owned() } else { other_blocks.join("\n") };
    format!(
        "{heavy}\n{title}\n{light}\nFailures:\n{others_text}\n{light}\nRoot Cause (first observed failure):\n{root_block}\n{heavy}"
    )
}

/// The part of a failure's message worth showing in `most` bytes: a Python traceback starts at
/// the program's own first frame (elastix's wrappers and the standard library above it are
/// dropped), and what does not fit is cut before whole lines, keeping the end (the error).
pub fn excerpt(text: &str, most: usize) -> String {
    const HEADER: &str = "Traceback (most recent call last):";
    let lines: Vec<&str> = text.lines().collect();
    let mut kept: Vec<&str> = match lines.iter().position(|line| line.trim() == HEADER) {
        Some(start) => {
            let frames = &lines[start + 1..];
            let own = frames.iter().position(|line| {
                let line = line.trim_start();
                line.starts_with("File \"") && !line.contains("/lib/python") && !line.contains("/elastix/worker/")
            });
            let mut kept = vec![lines[start]];
            kept.extend_from_slice(&frames[own.unwrap_or(0)..]);
            kept
        }
        None => lines,
    };
    let size = |lines: &[&str]| lines.iter().map(|line| line.len() + 1).sum::<usize>();
    let mut cut = false;
    while kept.len() > 1 && size(&kept) > most {
        kept.remove(0);
        cut = true;
    }
    let mut shown = kept.join("\n");
    if shown.len() > most {
        // one line longer than everything: its end, at a character boundary
        let mut from = shown.len() - most;
        while !shown.is_char_boundary(from) {
            from += 1;
        }
        shown = shown[from..].to_owned();
        cut = true;
    }
    if cut {
        format!("...\n{shown}")
    } else {
        shown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, text: &str) -> String {
        let path = std::env::temp_dir().join(format!("elastix-failure-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn the_error_file_wins_then_stderr_then_the_exit() {
        let file = temp_file(
            "err.json",
            r#"{"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "Traceback...\nValueError: bad", "timestamp": "1"}}}"#,
        );
        let failure = Failure::new(3, 1, "h", 42, 1, SystemTime::now(), &file, &["ignored".into()]);
        assert_eq!(failure.message, "Traceback...\nValueError: bad");
        assert_eq!(failure.error_file.as_deref(), Some(file.as_str()));
        std::fs::remove_file(&file).unwrap();

        let failure = Failure::new(0, 0, "h", 7, 2, SystemTime::now(), "/nonexistent", &["boom".into()]);
        assert_eq!((failure.message.as_str(), failure.error_file.clone()), ("boom", None));

        let failure = Failure::new(0, 0, "h", 7, -9, SystemTime::now(), "/nonexistent", &[]);
        assert_eq!(failure.signal.as_deref(), Some("SIGKILL"));
        assert_eq!(failure.message, "Signal 9 (SIGKILL) received by PID 7");
    }

    #[test]
    fn the_summary_puts_the_first_failure_last_as_root_cause() {
        let t = SystemTime::now();
        let later =
            Failure::new(1, 1, "host-a", 11, 1, t + std::time::Duration::from_millis(5), "/none", &["late".into()]);
        let first = Failure::new(0, 0, "host-a", 10, -11, t, "/none", &["segfault here".into()]);
        let text = summary("train.py", &[later, first]);
        let rule = text.lines().next().unwrap();
        let longest = text.lines().map(str::len).max().unwrap();
        assert!(rule.chars().all(|c| c == '=') && rule.len() == longest.min(MAX_RULE), "{text}");
        let (others, root) = text.split_once("Root Cause (first observed failure):").unwrap();
        assert!(
            root.starts_with("\n[1]:\n")
                && root.contains("rank      : 0 (local_rank: 0)")
                && root.contains("exitcode  : -11 (pid: 10) (SIGSEGV)")
                && root.contains("segfault here"),
            "{text}"
        );
        assert!(others.contains("[0]:") && others.contains("late"), "{text}");
        assert!(summary("x", &[first_only()]).contains("<NO_OTHER_FAILURES>"));
    }

    #[test]
    fn the_rank_others_wait_for_is_the_root_cause_even_if_found_later() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        let waiting = Failure::new(0, 0, "h", 10, -9, t, "/none", &[]);
        let mut stuck = Failure::new(1, 1, "h", 11, -9, t + std::time::Duration::from_millis(3), "/none", &[]);
        assert_eq!(root_cause(&[waiting.clone(), stuck.clone()]), Some(0), "first observed");
        stuck.held_others_up = true;
        assert_eq!(root_cause(&[waiting.clone(), stuck.clone()]), Some(1), "the one held up for");
        let tie = Failure::new(2, 0, "h", 12, 1, t, "/none", &[]);
        assert_eq!(root_cause(&[tie, waiting]), Some(1), "a tie goes to the lower rank");
        assert_eq!(root_cause(&[]), None);
    }

    #[test]
    fn a_failure_in_one_line_names_the_rank_the_host_and_the_error() {
        let t = SystemTime::now();
        let failed = Failure::new(3, 1, "node7", 11, 1, t, "/none", &["Traceback".into(), "ValueError: bad".into()]);
        assert_eq!(failed.headline(), "rank 3 (host node7) exited with 1: ValueError: bad");
        let killed = Failure::new(0, 0, "node7", 11, -9, t, "/none", &[]);
        assert_eq!(
            killed.headline(),
            "rank 0 (host node7) was killed by SIGKILL: Signal 9 (SIGKILL) received by PID 11"
        );
        assert!(local_time(0.0).len() == "1970-01-01_00:00:00".len() && local_time(0.0).contains('_'));
    }

    fn first_only() -> Failure {
        Failure::new(0, 0, "h", 1, 3, SystemTime::now(), "/none", &[])
    }

    #[test]
    fn an_excerpt_starts_at_the_programs_frame_and_is_cut_at_lines() {
        let traceback = "noise before\nTraceback (most recent call last):\n  File \"/venv/lib/python3.11/site-packages/elastix/worker/record.py\", line 40, in wrapper\n    return f()\n  File \"/job/train.py\", line 9, in main\n    step()\nValueError: bad batch";
        assert_eq!(
            excerpt(traceback, 2000),
            "Traceback (most recent call last):\n  File \"/job/train.py\", line 9, in main\n    step()\nValueError: bad batch"
        );
        let cut = excerpt(traceback, 40);
        assert!(cut.starts_with("...\n") && cut.ends_with("\nValueError: bad batch"), "{cut}");
        assert!(cut.lines().skip(1).all(|line| traceback.lines().any(|whole| whole == line)), "whole lines: {cut}");
        let long = "é".repeat(100);
        assert!(excerpt(&long, 11).len() <= 11 + 4);
        assert_eq!(excerpt("short", 100), "short");
    }
}
