//! Counters stored as decimal text, as ADD and BARRIER read and write them.

use std::io::Write;

/// Why a stored value cannot be used as a counter.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CounterError {
    #[error("value {0:?} is not an integer")]
    NotAnInteger(String),
    #[error("value {0:?} does not fit in a 64-bit integer")]
    OutOfRange(String),
}

/// Parses a stored counter the way torch's servers do (C's `strtoll` in base 10): leading
/// whitespace and one sign are allowed, parsing stops at the first non-digit, and at least one
/// digit is required. So `"12abc"` is 12 and `" 7"` is 7, while `"abc"` and `""` are errors.
pub fn parse_counter(value: &[u8]) -> Result<i64, CounterError> {
    let text = || String::from_utf8_lossy(value).into_owned();
    let mut rest = value;
    while let Some((first, tail)) = rest.split_first() {
        if !matches!(first, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
            break;
        }
        rest = tail;
    }
    let negative = match rest.first() {
        Some(b'-') => {
            rest = &rest[1..];
            true
        }
        Some(b'+') => {
            rest = &rest[1..];
            false
        }
        _ => false,
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return Err(CounterError::NotAnInteger(text()));
    }
    // Accumulate towards the sign so that i64::MIN parses without overflow.
    let mut total: i64 = 0;
    for &digit in &rest[..digits] {
        let digit = i64::from(digit - b'0');
        total = total
            .checked_mul(10)
            .and_then(|t| if negative { t.checked_sub(digit) } else { t.checked_add(digit) })
            .ok_or_else(|| CounterError::OutOfRange(text()))?;
    }
    Ok(total)
}

/// The most bytes a counter takes as text (`i64::MIN`).
pub const COUNTER_BYTES: usize = 20;

/// Formats a counter for storage into `buf`, with no allocation (ADD runs per request).
pub fn format_counter(value: i64, buf: &mut [u8; COUNTER_BYTES]) -> &[u8] {
    let mut rest = &mut buf[..];
    write!(rest, "{value}").expect("an i64 takes at most 20 bytes as text");
    let len = COUNTER_BYTES - rest.len();
    &buf[..len]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_like_strtoll() {
        assert_eq!(parse_counter(b"42"), Ok(42));
        assert_eq!(parse_counter(b"-9"), Ok(-9));
        assert_eq!(parse_counter(b"+3"), Ok(3));
        assert_eq!(parse_counter(b" 7"), Ok(7));
        assert_eq!(parse_counter(b"\t\n\r 5"), Ok(5));
        assert_eq!(parse_counter(b"12abc"), Ok(12));
        assert_eq!(parse_counter(b"-9223372036854775808"), Ok(i64::MIN));
        assert_eq!(parse_counter(b"9223372036854775807"), Ok(i64::MAX));
    }

    #[test]
    fn rejects_what_strtoll_rejects() {
        for bad in [&b"abc"[..], b"", b" ", b"-", b"+-1", b"x1"] {
            assert!(matches!(parse_counter(bad), Err(CounterError::NotAnInteger(_))), "{bad:?}");
        }
        assert!(matches!(parse_counter(b"99999999999999999999"), Err(CounterError::OutOfRange(_))));
        assert!(matches!(parse_counter(b"-9223372036854775809"), Err(CounterError::OutOfRange(_))));
    }

    #[test]
    fn formats_as_decimal_text() {
        let mut buf = [0; COUNTER_BYTES];
        assert_eq!(format_counter(i64::MIN, &mut buf), b"-9223372036854775808");
        assert_eq!(format_counter(3, &mut buf), b"3");
        assert_eq!(format_counter(-40, &mut buf), b"-40");
    }
}
