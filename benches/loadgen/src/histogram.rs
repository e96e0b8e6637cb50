//! Fixed-bucket latency histogram (log-linear, 32 buckets per power of two, so a reported
//! percentile is within ~3% of the true one). Recording is an index computation and an
//! increment: no allocation or sorting on the hot path.

const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = ((64 - SUB_BITS as u64 + 1) * SUB) as usize;

pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

impl Histogram {
    pub fn new() -> Self {
        Histogram { counts: vec![0; BUCKETS], total: 0, max: 0 }
    }

    pub fn record(&mut self, nanos: u64) {
        self.counts[index(nanos)] += 1;
        self.total += 1;
        self.max = self.max.max(nanos);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// The value at quantile `q` (0..=1), as its bucket's midpoint; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (idx, &count) in self.counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                let (low, width) = bounds(idx);
                return (low + width / 2).min(self.max);
            }
        }
        self.max
    }
}

fn index(v: u64) -> usize {
    if v < 2 * SUB {
        return v as usize;
    }
    let shift = 63 - v.leading_zeros() - SUB_BITS; // keeps the top SUB_BITS+1 bits
    ((shift as u64 + 1) * SUB + ((v >> shift) - SUB)) as usize
}

/// Lowest value and width of bucket `idx`.
fn bounds(idx: usize) -> (u64, u64) {
    let idx = idx as u64;
    if idx < 2 * SUB {
        return (idx, 1);
    }
    let shift = idx / SUB - 1;
    ((idx % SUB + SUB) << shift, 1 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_contain_their_values() {
        for v in (0..100_000u64).chain([u64::MAX / 3, u64::MAX]) {
            let (low, width) = bounds(index(v));
            assert!(low <= v && v - low < width, "{v} -> [{low}, +{width})");
        }
        assert_eq!(index(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_are_within_bucket_precision() {
        let mut h = Histogram::new();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        for (q, want) in [(0.5, 5_000_000.0), (0.99, 9_900_000.0), (0.999, 9_990_000.0)] {
            let got = h.quantile(q) as f64;
            assert!((got - want).abs() / want < 0.04, "q{q}: {got} vs {want}");
        }
    }
}
