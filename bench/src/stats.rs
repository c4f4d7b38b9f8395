//! Summary statistics of a row's samples.

use std::time::Duration;

/// Median, 95th percentile and minimum of a set of samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub median: Duration,
    pub p95: Duration,
    pub min: Duration,
    pub runs: usize,
}

/// Summarises `samples`; `None` when there are none.
pub fn summarize(samples: &[Duration]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let n = sorted.len();
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2
    };
    Some(Summary {
        median,
        p95: sorted[nearest_rank(n, 95)],
        min: sorted[0],
        runs: n,
    })
}

/// Index of the `pct`th percentile of `n` sorted samples (nearest-rank method).
fn nearest_rank(n: usize, pct: usize) -> usize {
    let rank = (pct * n).div_ceil(100);
    rank.clamp(1, n) - 1
}

/// Milliseconds with two decimals (three below 1 ms).
pub fn fmt_ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 1.0 {
        format!("{ms:.3}")
    } else {
        format!("{ms:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn empty() {
        assert_eq!(summarize(&[]), None);
    }

    #[test]
    fn odd_and_even() {
        let s = summarize(&[ms(3), ms(1), ms(2)]).unwrap();
        assert_eq!((s.median, s.min, s.p95, s.runs), (ms(2), ms(1), ms(3), 3));
        let s = summarize(&[ms(4), ms(1), ms(2), ms(3)]).unwrap();
        assert_eq!(s.median, Duration::from_micros(2500));
    }

    #[test]
    fn p95_nearest_rank() {
        let samples: Vec<_> = (1..=100).map(ms).collect();
        let s = summarize(&samples).unwrap();
        assert_eq!(s.p95, ms(95));
        assert_eq!(s.min, ms(1));
        let samples: Vec<_> = (1..=5).map(ms).collect();
        assert_eq!(summarize(&samples).unwrap().p95, ms(5));
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_ms(Duration::from_micros(12_345)), "12.35");
        assert_eq!(fmt_ms(Duration::from_micros(450)), "0.450");
    }
}
