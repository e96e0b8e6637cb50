//! Exponential backoff with jitter for connection retries, so that many clients starting at
//! once (a large job's agents, 1000 workers) do not retry in lockstep.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
    multiplier: f64,
    /// Each delay is drawn uniformly from `next * [1 - jitter, 1 + jitter]`.
    jitter: f64,
    rng: fastrand::Rng,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration, multiplier: f64, jitter: f64) -> Self {
        Backoff {
            next: initial,
            max,
            multiplier: multiplier.max(1.0),
            jitter: jitter.clamp(0.0, 1.0),
            rng: fastrand::Rng::new(),
        }
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let spread = 1.0 + self.jitter * (2.0 * self.rng.f64() - 1.0);
        let delay = self.next.mul_f64(spread);
        self.next = self.next.mul_f64(self.multiplier).min(self.max);
        delay
    }
}

impl Default for Backoff {
    /// Starts fast (a server that is a few milliseconds late costs little), grows by 1.5x
    /// to at most 2 s, with +-50% jitter.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(10), Duration::from_secs(2), 1.5, 0.5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_within_the_jitter_band() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(400), 2.0, 0.5);
        let expected_centres = [100, 200, 400, 400, 400];
        for centre in expected_centres {
            let delay = backoff.next_delay().as_secs_f64() * 1000.0;
            let centre = centre as f64;
            assert!(delay >= centre * 0.5 - 1e-9 && delay <= centre * 1.5 + 1e-9, "{delay} vs {centre}");
        }
    }

    #[test]
    fn jitter_spreads_clients_apart() {
        let delays: Vec<Duration> = (0..16).map(|_| Backoff::default().next_delay()).collect();
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 8, "{delays:?}");
    }
}
