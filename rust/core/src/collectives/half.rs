//! float16 and bfloat16 as raw 16-bit patterns: conversions to and from f32 (round to nearest,
//! ties to even, NaN kept NaN), one value at a time and a block at a time (with the F16C
//! instructions where the processor has them).

/// IEEE binary16 bits to f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    if exp == 0 {
        // zero or subnormal: man * 2^-24
        let magnitude = man as f32 * f32::from_bits(0x3380_0000);
        return f32::from_bits(magnitude.to_bits() | sign);
    }
    if exp == 0x1f {
        return f32::from_bits(sign | 0x7f80_0000 | (man << 13));
    }
    f32::from_bits(sign | ((exp + 112) << 23) | (man << 13))
}

/// f32 to IEEE binary16 bits, rounding to nearest with ties to even; overflow gives infinity.
pub fn f32_to_f16(value: f32) -> u16 {
    let x = value.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let man = x & 0x7f_ffff;
    if exp == 0xff {
        let nan = if man != 0 { 0x200 | (man >> 13) as u16 } else { 0 };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let mut half = m >> shift;
        let rest = m & ((1 << shift) - 1);
        let halfway = 1 << (shift - 1);
        if rest > halfway || (rest == halfway && half & 1 == 1) {
            half += 1;
        }
        return sign | half as u16;
    }
    let mut half = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && half & 1 == 1) {
        half += 1; // a carry into the exponent is the right answer, up to infinity
    }
    sign | half as u16
}

/// bfloat16 bits to f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to bfloat16 bits, rounding to nearest with ties to even; NaN stays a (quiet) NaN.
pub fn f32_to_bf16(value: f32) -> u16 {
    let x = value.to_bits();
    if value.is_nan() {
        return ((x >> 16) | 0x40) as u16;
    }
    let rounding = 0x7fff + ((x >> 16) & 1);
    (x.wrapping_add(rounding) >> 16) as u16
}

/// Which 16-bit float format a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    F16,
    BF16,
}

/// Reads `out.len()` 16-bit values at `src` (any alignment) as f32.
///
/// # Safety
/// `src` must be valid for reading `2 * out.len()` bytes.
pub unsafe fn load_block(kind: Half, src: *const u8, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kind == Half::F16 && f16c_available() {
        return x86::f16_to_f32(src, out);
    }
    let src = src as *const u16;
    match kind {
        Half::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_to_f32(src.add(i).read_unaligned());
            }
        }
        Half::BF16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16_to_f32(src.add(i).read_unaligned());
            }
        }
    }
}

/// Writes `values` as 16-bit floats at `dst` (any alignment).
///
/// # Safety
/// `dst` must be valid for writing `2 * values.len()` bytes.
pub unsafe fn store_block(kind: Half, values: &[f32], dst: *mut u8) {
    #[cfg(target_arch = "x86_64")]
    if kind == Half::F16 && f16c_available() {
        return x86::f32_to_f16(values, dst);
    }
    let dst = dst as *mut u16;
    match kind {
        Half::F16 => {
            for (i, v) in values.iter().enumerate() {
                dst.add(i).write_unaligned(f32_to_f16(*v));
            }
        }
        Half::BF16 => {
            for (i, v) in values.iter().enumerate() {
                dst.add(i).write_unaligned(f32_to_bf16(*v));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn f16c_available() -> bool {
    std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn f16_to_f32(src: *const u8, out: &mut [f32]) {
        let n = out.len();
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        for (j, slot) in out.iter_mut().enumerate().skip(i) {
            *slot = super::f16_to_f32((src as *const u16).add(j).read_unaligned());
        }
    }

    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn f32_to_f16(values: &[f32], dst: *mut u8) {
        let n = values.len();
        let mut i = 0;
        while i + 8 <= n {
            let f = _mm256_loadu_ps(values.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
            _mm_storeu_si128(dst.add(2 * i) as *mut __m128i, h);
            i += 8;
        }
        for (j, value) in values.iter().enumerate().skip(i) {
            (dst as *mut u16).add(j).write_unaligned(super::f32_to_f16(*value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_known_values() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // rounds up to infinity
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000); // tie, to even
        assert_eq!(f32_to_f16(2f32.powi(-25) * 1.5), 0x0001);
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00); // tie, to even
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02); // tie, to even (up)
    }

    #[test]
    fn f16_round_trips_every_value() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
            } else {
                assert_eq!(f32_to_f16(f), h, "{h:#06x}");
            }
        }
    }

    #[test]
    fn f16_rounding_matches_the_rule_between_neighbours() {
        // every f32 halfway between two adjacent finite halves rounds to the even one
        for h in 0..0x7bffu16 {
            let (lo, hi) = (f16_to_f32(h) as f64, f16_to_f32(h + 1) as f64);
            let mid = ((lo + hi) / 2.0) as f32;
            let expect = if h & 1 == 0 { h } else { h + 1 };
            assert_eq!(f32_to_f16(mid), expect, "{h:#06x}");
            let below = f32::from_bits(mid.to_bits() - 1);
            if below as f64 > lo {
                assert_eq!(f32_to_f16(below), h);
            }
        }
    }

    #[test]
    fn bf16_conversions() {
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, to even (up)
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        for b in 0..=u16::MAX {
            let f = bf16_to_f32(b);
            if !f.is_nan() {
                assert_eq!(f32_to_bf16(f), b);
            }
        }
    }

    #[test]
    fn block_paths_agree_with_scalar_ones() {
        let mut rng = fastrand::Rng::with_seed(7);
        let values: Vec<f32> = (0..1003).map(|_| (rng.f32() - 0.5) * 2f32.powi(rng.i32(-30..20))).collect();
        for kind in [Half::F16, Half::BF16] {
            let mut bytes = vec![0u8; 2 * values.len() + 1];
            unsafe { store_block(kind, &values, bytes.as_mut_ptr().add(1)) }; // unaligned on purpose
            let mut back = vec![0f32; values.len()];
            unsafe { load_block(kind, bytes.as_ptr().add(1), &mut back) };
            for (i, v) in values.iter().enumerate() {
                let bits = u16::from_le_bytes([bytes[1 + 2 * i], bytes[2 + 2 * i]]);
                let (expect_bits, expect) = match kind {
                    Half::F16 => (f32_to_f16(*v), f16_to_f32(f32_to_f16(*v))),
                    Half::BF16 => (f32_to_bf16(*v), bf16_to_f32(f32_to_bf16(*v))),
                };
                assert_eq!(bits, expect_bits, "{kind:?} {v}");
                assert_eq!(back[i], expect);
            }
        }
    }
}
