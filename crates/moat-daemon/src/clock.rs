//! Wall-clock time as the daemon stores and shows it: milliseconds since the Unix epoch, and
//! RFC 3339 text for the API. At the bottom of the daemon: it imports nothing of the crate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 for a clock set before it).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `ms` since the epoch as RFC 3339 with milliseconds (`1970-01-01T00:00:00.000Z`).
pub fn rfc3339(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_format() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(-5), "1970-01-01T00:00:00.000Z");
        assert!(now_ms() > 1_700_000_000_000);
    }
}
