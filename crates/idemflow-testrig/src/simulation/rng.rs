//! A small seeded random source (SplitMix64): every decision of a schedule comes from it, so a
//! seed names a schedule. Public for other seeded choices (which process to kill, and when), so
//! a printed seed replays them too.

/// A seeded stream of random numbers.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The stream named by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next number of the stream.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// A number in `low..=high`.
    pub(crate) fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high.saturating_sub(low) + 1)
    }

    /// `true` with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1_u64 << 53) as f64 <= p
    }

    /// One of `choices`, each as likely as its weight.
    pub(crate) fn weighted<T: Copy>(&mut self, choices: &[(u32, T)]) -> T {
        let total: u64 = choices.iter().map(|(weight, _)| u64::from(*weight)).sum();
        let mut pick = self.below(total);
        for (weight, choice) in choices {
            let weight = u64::from(*weight);
            if pick < weight {
                return *choice;
            }
            pick -= weight;
        }
        choices[choices.len() - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_names_one_stream() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let first: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        let second: Vec<u64> = (0..5).map(|_| b.next_u64()).collect();
        assert_eq!(first, second);
        assert_ne!(
            first,
            (0..5).map(|_| Rng::new(8).next_u64()).collect::<Vec<_>>()
        );
        let mut c = Rng::new(1);
        assert!((0..1000).all(|_| c.between(3, 5) >= 3 && c.between(3, 5) <= 5));
        assert_eq!(c.weighted(&[(0, 'a'), (1, 'b')]), 'b');
    }
}
