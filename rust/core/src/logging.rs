//! Log output of the command-line programs (`elastix run`, `elastix-store`): tracing events as
//! lines on stderr, written through [`crate::console`] so that a stalled stderr never
//! blocks a control loop. `RUST_LOG`, when set, picks the events in detail; otherwise the
//! program's level (`--log-level`, `ELASTIX_LOG_LEVEL`).
//!
//! Every line has one form, whoever wrote it (the agent, the store, the Python side of the CLI,
//! which hands its records over: see the bindings), so that the logs of several nodes merge:
//!
//! ```text
//! 2026-11-26T13:07:30.200073Z INFO  [node0] rendezvous complete: round 0, ...
//! ```
//!
//! a UTC timestamp, the level, the node's name on an agent's lines, the module with `RUST_LOG`,
//! then the message and its fields.
//!
//! Used as a library, elastix installs no subscriber: its events go to Python's `logging`
//! (see the bindings).

use std::fmt;
use std::sync::OnceLock;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The node this process's lines speak for (an agent's host name or `--local-addr`).
static NODE: OnceLock<String> = OnceLock::new();

/// Names this process's node on every line from now on (the first name given stays).
pub fn set_node_name(name: &str) {
    let _ = NODE.set(name.to_owned());
}

/// The level names accepted besides tracing's directives: Python's too.
fn directive(level: &str) -> String {
    match level.trim().to_ascii_lowercase().as_str() {
        "warning" => "warn".to_owned(),
        "critical" | "fatal" => "error".to_owned(),
        "notset" => "trace".to_owned(),
        other => other.to_owned(),
    }
}

/// The filter for `level` (or RUST_LOG when set), or why it is not one.
pub fn stderr_filter(level: &str) -> Result<EnvFilter, String> {
    if let Ok(detail) = std::env::var("RUST_LOG") {
        if !detail.trim().is_empty() {
            return EnvFilter::try_new(&detail).map_err(|err| format!("RUST_LOG={detail:?}: {err}"));
        }
    }
    let directive = directive(level);
    let invalid = || format!("invalid log level {level:?} (use error, warn, info, debug, trace or off)");
    // a bare word would be read as a target name, silently showing nothing
    let is_level = ["error", "warn", "info", "debug", "trace", "off"].contains(&directive.as_str());
    if !is_level && !directive.contains(['=', ',']) {
        return Err(invalid());
    }
    EnvFilter::try_new(&directive).map_err(|err| format!("{}: {err}", invalid()))
}

/// Installs the stderr subscriber for this process. `Ok(false)`: one was installed already
/// (the first one stays).
pub fn init_stderr(level: &str) -> Result<bool, String> {
    let filter = stderr_filter(level)?;
    let detailed = std::env::var_os("RUST_LOG").is_some();
    Ok(tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(crate::console::stderr_writer)
        .with_ansi(false)
        .event_format(Line { with_target: detailed })
        .try_init()
        .is_ok())
}

/// The one form of a log line (see the module's documentation).
struct Line {
    with_target: bool,
}

impl<S, N> FormatEvent<S, N> for Line
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        SystemTime.format_time(&mut writer)?;
        let meta = event.metadata();
        write!(writer, " {:<5} ", meta.level())?;
        if let Some(node) = NODE.get() {
            write!(writer, "[{node}] ")?;
        }
        if self.with_target {
            write!(writer, "{}: ", meta.target())?;
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Logs a line handed over from Python's `logging` (the CLI's own messages), at the level
/// nearest to Python's `levelno`, so that it has the same form as the core's.
pub fn python_line(levelno: u32, message: &str) {
    macro_rules! at {
        ($level:expr) => {
            tracing::event!(target: "elastix", $level, "{message}")
        };
    }
    match levelno {
        40.. => at!(Level::ERROR),
        30..=39 => at!(Level::WARN),
        20..=29 => at!(Level::INFO),
        _ => at!(Level::DEBUG),
    }
}

/// Waits (up to `within`) until the lines logged so far are written: the writer is a thread
/// of its own, and a program that exits right away would lose what it has not written yet.
pub async fn flush(within: std::time::Duration) -> bool {
    crate::console::stderr().flush(within).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_take_tracing_and_python_names_and_refuse_the_rest() {
        if std::env::var_os("RUST_LOG").is_some() {
            return; // RUST_LOG wins over the level by design
        }
        for level in ["info", "WARNING", "debug", "critical", "elastix_core=debug,warn"] {
            assert!(stderr_filter(level).is_ok(), "{level}");
        }
        let err = stderr_filter("loud").unwrap_err();
        assert!(err.contains("invalid log level \"loud\""), "{err}");
        assert!(stderr_filter(" ").is_err());
    }
}
