//! Relaying one piped worker stream: its output is cut into pieces, each ending at a newline
//! or a carriage return, and every piece goes to the worker's log file (as written), to the
//! console (with the prefix), to the stderr tail and to the duplicate-filter file.
//!
//! Pieces are relayed as soon as they are complete, so `\r` progress bars update live. A
//! piece with no end yet (a prompt such as `input("name: ")`) is relayed after
//! [`PARTIAL_WAIT`] without more output, or once it reaches [`LONGEST_PIECE`]. Every piece
//! gets the prefix, as torchrun's tail gives one to every read; [`crate::console`] keeps
//! different workers' pieces off each other's lines.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::task::JoinHandle;

use crate::agent::failure::STDERR_TAIL_LINES;
use crate::agent::output::logfiles::LogFile;
use crate::console::{self, ConsoleStream};

/// How long an unfinished piece waits for the rest before it is relayed as it is.
pub const PARTIAL_WAIT: Duration = Duration::from_millis(100);
/// An unfinished piece this long is relayed at once (a worker writing megabytes without a
/// newline must not grow the agent's memory).
pub const LONGEST_PIECE: usize = 64 << 10;
/// What one read takes from the pipe.
const READ_SIZE: usize = 64 << 10;

/// How a piece of output ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// A newline (`\n` or `\r\n`).
    Newline,
    /// A carriage return alone: the next piece overwrites this one on a terminal.
    Return,
    /// Nothing yet, but the worker paused (or wrote a very long piece): more may follow.
    Pause,
    /// Nothing, and the stream ended.
    End,
}

/// Copies of a stream's pieces that contain any of the filters (torchrun's duplicate filters).
pub struct Duplicate {
    pub filters: Arc<[String]>,
    pub file: LogFile,
}

impl Duplicate {
    fn matches(&self, piece: &[u8]) -> bool {
        self.filters.iter().any(|filter| contains(piece, filter.as_bytes()))
    }
}

/// Where one worker stream's pieces go.
pub struct Sink {
    pub file: Option<LogFile>,
    /// The console stream pieces are echoed to ([`crate::console::stdout`] or [`crate::console::stderr`]).
    pub console: Option<&'static ConsoleStream>,
    pub prefix: Vec<u8>,
    /// Last lines kept (stderr only).
    pub tail: Option<Arc<Mutex<VecDeque<String>>>>,
    pub duplicate: Option<Duplicate>,
}

impl Sink {
    /// Never blocks a runtime thread: the tail is kept here (it is never dropped), the console
    /// waits briefly for a slow reader and drops lines a stalled one does not take, and the
    /// files wait (asynchronously) for their writer.
    async fn piece(&mut self, writer: u32, piece: &[u8], ending: Ending) {
        let text = trim_ending(piece);
        if let (Some(tail), false) = (&self.tail, ending == Ending::Return) {
            let mut tail = tail.lock().unwrap_or_else(PoisonError::into_inner);
            if tail.len() == STDERR_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(String::from_utf8_lossy(text).into_owned());
        }
        if let Some(console) = self.console {
            console.send_piece(writer, self.prefixed(piece, ending)).await;
        }
        if let Some(duplicate) = self.duplicate.as_ref().filter(|d| d.matches(text)) {
            duplicate.file.line(&self.prefixed(text, Ending::End)).await;
        }
        if let Some(file) = &self.file {
            file.write(piece.to_vec()).await;
        }
    }

    /// The prefix and the piece; a newline ends a piece that ends the stream.
    fn prefixed(&self, piece: &[u8], ending: Ending) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.prefix.len() + piece.len() + 1);
        out.extend_from_slice(&self.prefix);
        out.extend_from_slice(piece);
        if ending == Ending::End {
            out.push(b'\n');
        }
        out
    }
}

/// Relays `stream` into `sink` until EOF.
pub fn pump(mut stream: impl AsyncRead + Unpin + Send + 'static, mut sink: Sink) -> JoinHandle<()> {
    let writer = console::writer_id();
    tokio::spawn(async move {
        let mut pending = Vec::with_capacity(READ_SIZE);
        let mut buffer = vec![0u8; READ_SIZE];
        loop {
            let read = if pending.is_empty() {
                stream.read(&mut buffer).await
            } else {
                // `read` is cancel safe: a timeout loses nothing
                match tokio::time::timeout(PARTIAL_WAIT, stream.read(&mut buffer)).await {
                    Ok(read) => read,
                    Err(_) => {
                        relay(writer, &mut pending, &mut sink, Moment::Pause).await;
                        continue;
                    }
                }
            };
            match read {
                Ok(0) | Err(_) => break,
                Ok(n) => pending.extend_from_slice(&buffer[..n]),
            }
            relay(writer, &mut pending, &mut sink, Moment::Read).await;
        }
        relay(writer, &mut pending, &mut sink, Moment::End).await;
    })
}

/// When the pump relays: after a read, after a pause in the output, at its end.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Moment {
    Read,
    Pause,
    End,
}

/// Relays the complete pieces at the start of `pending` and removes them. After a pause or
/// at the end, the rest too; an overlong rest in any case.
async fn relay(writer: u32, pending: &mut Vec<u8>, sink: &mut Sink, moment: Moment) {
    let mut start = 0;
    while let Some((len, ending)) = next_piece(&pending[start..], moment == Moment::Read) {
        sink.piece(writer, &pending[start..start + len], ending).await;
        start += len;
    }
    pending.drain(..start);
    if !pending.is_empty() && (moment != Moment::Read || pending.len() >= LONGEST_PIECE) {
        let ending = if moment == Moment::End { Ending::End } else { Ending::Pause };
        sink.piece(writer, pending, ending).await;
        pending.clear();
    }
}

/// The length and ending of the first complete piece of `bytes`, if there is one. A `\r` as
/// the last byte waits for the next one while `more_may_follow` (it may start a `\r\n`).
pub fn next_piece(bytes: &[u8], more_may_follow: bool) -> Option<(usize, Ending)> {
    let end = bytes.iter().position(|byte| matches!(byte, b'\n' | b'\r'))?;
    if bytes[end] == b'\n' {
        return Some((end + 1, Ending::Newline));
    }
    match bytes.get(end + 1) {
        Some(b'\n') => Some((end + 2, Ending::Newline)),
        Some(_) => Some((end + 1, Ending::Return)),
        None if more_may_follow => None,
        None => Some((end + 1, Ending::Return)),
    }
}

fn trim_ending(piece: &[u8]) -> &[u8] {
    let end = piece.iter().rposition(|byte| !matches!(byte, b'\n' | b'\r')).map_or(0, |last| last + 1);
    &piece[..end]
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::output::logfiles::LogWriter;

    #[test]
    fn pieces_end_at_newlines_and_lone_carriage_returns() {
        assert_eq!(next_piece(b"a\nb", true), Some((2, Ending::Newline)));
        assert_eq!(next_piece(b"a\r\nb", true), Some((3, Ending::Newline)));
        assert_eq!(next_piece(b"10%\r20%", true), Some((4, Ending::Return)));
        assert_eq!(next_piece(b"10%\r", true), None, "a \\n may follow");
        assert_eq!(next_piece(b"10%\r", false), Some((4, Ending::Return)));
        assert_eq!(next_piece(b"name: ", true), None);
        assert_eq!(next_piece(b"name: ", false), None);
    }

    #[test]
    fn filters_match_substrings_but_never_an_empty_one() {
        assert!(contains(b"an apple a day", b"apple"));
        assert!(!contains(b"a pear", b"apple"));
        assert!(!contains(b"anything", b""), "torch: an empty filter list duplicates nothing");
        assert_eq!(trim_ending(b"line\r\n"), b"line");
        assert_eq!(trim_ending(b"\n"), b"");
    }

    fn temp_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("elastix-pump-{name}-{}", std::process::id()))
    }

    #[tokio::test]
    async fn output_reaches_the_file_as_written_and_lines_the_tail() {
        let path = temp_path("file");
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let writer = LogWriter::start().unwrap();
        let file = Some(writer.create(&path).unwrap());
        let sink = Sink { file, console: None, prefix: vec![], tail: Some(tail.clone()), duplicate: None };
        let mut input: Vec<u8> = (0..30).map(|i| format!("line {i}\n")).collect::<String>().into_bytes();
        input.extend_from_slice(b"50%\r100%\r\nno newline at the end");
        pump(std::io::Cursor::new(input.clone()), sink).await.unwrap();
        assert!(writer.finish(Duration::from_secs(30)).await.is_empty());
        assert_eq!(std::fs::read(&path).unwrap(), input);
        let tail = tail.lock().unwrap();
        assert_eq!(tail.len(), STDERR_TAIL_LINES);
        let last: Vec<&str> = tail.iter().rev().take(2).map(String::as_str).collect();
        assert_eq!(last, ["no newline at the end", "100%"], "progress steps stay out of the tail");
        std::fs::remove_file(&path).unwrap();
    }

    #[tokio::test]
    async fn an_unfinished_piece_is_relayed_after_a_pause() {
        let (mut writer, reader) = tokio::io::duplex(1024);
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let sink = Sink { file: None, console: None, prefix: vec![], tail: Some(tail.clone()), duplicate: None };
        let pumping = pump(reader, sink);
        tokio::io::AsyncWriteExt::write_all(&mut writer, b"name: ").await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tail.lock().unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "the prompt was never relayed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(tail.lock().unwrap().back().unwrap(), "name: ");
        drop(writer);
        pumping.await.unwrap();
    }

    #[tokio::test]
    async fn duplicates_are_copied_with_their_prefix() {
        let path = temp_path("dup");
        let writer = LogWriter::start().unwrap();
        let duplicate = Duplicate {
            filters: vec!["apple".to_owned(), "or,ange".to_owned()].into(),
            file: writer.create(&path).unwrap(),
        };
        let sink =
            Sink { file: None, console: None, prefix: b"[default0]:".to_vec(), tail: None, duplicate: Some(duplicate) };
        pump(std::io::Cursor::new(b"apple pie\npear\nor,ange\r\n".to_vec()), sink).await.unwrap();
        assert!(writer.finish(Duration::from_secs(30)).await.is_empty());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "[default0]:apple pie\n[default0]:or,ange\n");
        std::fs::remove_file(&path).unwrap();
    }
}
