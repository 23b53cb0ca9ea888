//! A small seeded random number generator with the distributions the workloads need.
//!
//! We carry our own (xoshiro256++ seeded through splitmix64) rather than `rand` so that a seed
//! gives byte-identical runs forever: results must not change when a dependency changes its
//! algorithms. Randomness is always passed in; nothing in `core` seeds from the environment.

/// Seeded PRNG (xoshiro256++). Cheap to clone; `fork` derives independent streams.
#[derive(Clone, Debug)]
pub struct SimRng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SimRng {
    /// A generator whose whole stream is determined by `seed` (expanded through splitmix64).
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut sm = seed;
        let s = [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)];
        SimRng { s }
    }

    /// An independent stream for a named purpose (e.g. arrivals vs lengths), so adding draws to
    /// one stream never shifts another.
    pub fn fork(&self, stream: u64) -> SimRng {
        let mut sm = self.s[0] ^ self.s[3].rotate_left(17) ^ stream.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        SimRng { s: [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)] }
    }

    /// The next 64 uniformly random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[0].wrapping_add(self.s[3]).rotate_left(23).wrapping_add(self.s[0]);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in (0, 1]: safe to take the log of.
    pub fn f64_open0(&mut self) -> f64 {
        1.0 - self.f64()
    }

    /// Uniform integer in [0, n). `n` must be > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "SimRng::below(0)");
        // Lemire's multiply-shift with rejection: unbiased.
        let mut m = (self.next_u64() as u128) * (n as u128);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = (self.next_u64() as u128) * (n as u128);
            }
        }
        (m >> 64) as u64
    }

    /// Exponential with the given rate (mean 1/rate).
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -self.f64_open0().ln() / rate
    }

    /// Standard normal (Box–Muller, one draw per call for reproducibility of call counts).
    pub fn standard_normal(&mut self) -> f64 {
        let u1 = self.f64_open0();
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Log-normal with the given median and sigma of the underlying normal.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.standard_normal()).exp()
    }

    /// Gamma(shape k, scale θ), Marsaglia–Tsang; shape < 1 via the boost `U^(1/k)`.
    pub fn gamma(&mut self, shape: f64, scale: f64) -> f64 {
        if shape < 1.0 {
            let u = self.f64_open0();
            return self.gamma(shape + 1.0, scale) * u.powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.standard_normal();
            let v = 1.0 + c * x;
            if v <= 0.0 {
                continue;
            }
            let v = v * v * v;
            let u = self.f64_open0();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v * scale;
            }
        }
    }

    /// Weibull(shape c, scale λ) by inversion.
    pub fn weibull(&mut self, shape: f64, scale: f64) -> f64 {
        scale * (-self.f64_open0().ln()).powf(1.0 / shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean(xs: &[f64]) -> f64 {
        xs.iter().sum::<f64>() / xs.len() as f64
    }

    #[test]
    fn same_seed_same_stream_and_forks_differ() {
        let mut a = SimRng::seed_from_u64(7);
        let mut b = SimRng::seed_from_u64(7);
        let xs: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..16).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        let mut f1 = a.fork(1);
        let mut f2 = a.fork(2);
        assert_ne!(f1.next_u64(), f2.next_u64());
    }

    #[test]
    fn distribution_means_match_theory() {
        let mut r = SimRng::seed_from_u64(1);
        let n = 200_000;
        let exp: Vec<f64> = (0..n).map(|_| r.exponential(4.0)).collect();
        assert!((mean(&exp) - 0.25).abs() < 0.005, "exp mean {}", mean(&exp));
        let g: Vec<f64> = (0..n).map(|_| r.gamma(0.5, 2.0)).collect();
        assert!((mean(&g) - 1.0).abs() < 0.02, "gamma mean {}", mean(&g));
        let g: Vec<f64> = (0..n).map(|_| r.gamma(3.0, 0.5)).collect();
        assert!((mean(&g) - 1.5).abs() < 0.02, "gamma mean {}", mean(&g));
        let u: Vec<f64> = (0..n).map(|_| r.below(10) as f64).collect();
        assert!((mean(&u) - 4.5).abs() < 0.03);
        let mut ln: Vec<f64> = (0..n).map(|_| r.lognormal(600.0, 1.0)).collect();
        ln.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = ln[n / 2];
        assert!((med - 600.0).abs() < 15.0, "lognormal median {med}");
        let w: Vec<f64> = (0..n).map(|_| r.weibull(1.0, 3.0)).collect();
        assert!((mean(&w) - 3.0).abs() < 0.05);
    }
}
