//! The reduction kernels against what they must compute.

use super::*;

fn run<T: Copy + Default>(dtype: DType, op: ReduceOp, inputs: &[Vec<T>], divisor: u32) -> Result<Vec<T>, KernelError> {
    let n = inputs[0].len();
    let mut out = vec![T::default(); n];
    let srcs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr() as *const u8).collect();
    // SAFETY: every input and `out` hold n elements of T.
    unsafe { reduce(dtype, op, &srcs, &[out.as_mut_ptr() as *mut u8], n, divisor)? };
    Ok(out)
}

#[test]
fn integer_ops_wrap_like_numpy() {
    let a: Vec<i8> = vec![100, -128, 3, 0, 7];
    let b: Vec<i8> = vec![100, -1, -5, 0, 12];
    assert_eq!(run(DType::I8, ReduceOp::Sum, &[a.clone(), b.clone()], 1).unwrap(), vec![-56, 127, -2, 0, 19]);
    assert_eq!(run(DType::I8, ReduceOp::Product, &[a.clone(), b.clone()], 1).unwrap(), vec![16, -128, -15, 0, 84]);
    assert_eq!(run(DType::I8, ReduceOp::Min, &[a.clone(), b.clone()], 1).unwrap(), vec![100, -128, -5, 0, 7]);
    assert_eq!(run(DType::I8, ReduceOp::Max, &[a.clone(), b.clone()], 1).unwrap(), vec![100, -1, 3, 0, 12]);
    assert_eq!(run(DType::I8, ReduceOp::BitXor, &[a, b], 1).unwrap(), vec![0, 127, -8, 0, 11]);
    let u: Vec<u64> = vec![u64::MAX, 5];
    assert_eq!(run(DType::U64, ReduceOp::Sum, &[u.clone(), vec![2, 6]], 1).unwrap(), vec![1, 11]);
    assert_eq!(run(DType::U64, ReduceOp::BitAnd, &[u, vec![2, 6]], 1).unwrap(), vec![2, 4]);
}

#[test]
fn many_sources_and_long_inputs_cross_blocks() {
    let n = BLOCK * 3 + 17;
    let inputs: Vec<Vec<i32>> = (0..5).map(|r| (0..n as i32).map(|i| i * (r + 1)).collect()).collect();
    let out = run(DType::I32, ReduceOp::Sum, &inputs, 1).unwrap();
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, i as i32 * 15);
    }
}

#[test]
fn floats_sum_in_order_and_average() {
    let a = vec![1.0f64, f64::NAN, 3.0];
    let b = vec![2.0f64, 1.0, -3.0];
    let s = run(DType::F64, ReduceOp::Sum, &[a.clone(), b.clone()], 2).unwrap();
    assert_eq!(s[0], 1.5);
    assert!(s[1].is_nan());
    assert_eq!(s[2], 0.0);
    let mn = run(DType::F64, ReduceOp::Min, &[b.clone(), a.clone()], 1).unwrap();
    assert_eq!(mn[0], 1.0);
    assert!(mn[1].is_nan(), "NaN propagates as in numpy.minimum");
    let mx = run(DType::F32, ReduceOp::Max, &[vec![1.0f32, 5.0], vec![f32::NAN, 2.0]], 1).unwrap();
    assert!(mx[0].is_nan());
    assert_eq!(mx[1], 5.0);
    let p = run(DType::F32, ReduceOp::Product, &[vec![1.5f32], vec![4.0], vec![0.5]], 1).unwrap();
    assert_eq!(p, vec![3.0]);
}

#[test]
fn bool_is_logical() {
    let a = vec![0u8, 0, 1, 1];
    let b = vec![0u8, 1, 0, 1];
    assert_eq!(run(DType::Bool, ReduceOp::Sum, &[a.clone(), b.clone()], 1).unwrap(), vec![0, 1, 1, 1]);
    assert_eq!(run(DType::Bool, ReduceOp::Product, &[a.clone(), b.clone()], 1).unwrap(), vec![0, 0, 0, 1]);
    assert_eq!(run(DType::Bool, ReduceOp::BitXor, &[a, b], 1).unwrap(), vec![0, 1, 1, 0]);
}

#[test]
fn halves_accumulate_in_f32() {
    let n = BLOCK + 9;
    let a: Vec<u16> = (0..n).map(|i| f16::from_f32(i as f32 * 0.25).to_bits()).collect();
    let b: Vec<u16> = (0..n).map(|_| f16::from_f32(1.0).to_bits()).collect();
    let out = run(DType::F16, ReduceOp::Sum, &[a.clone(), b.clone()], 2).unwrap();
    for i in 0..n {
        let expect = f16::from_f32((f16::from_bits(a[i]).to_f32() + 1.0) / 2.0).to_bits();
        assert_eq!(out[i], expect, "{i}");
    }
    let c: Vec<u16> = (0..n).map(|i| bf16::from_f32(i as f32).to_bits()).collect();
    let out = run(DType::BF16, ReduceOp::Max, &[c.clone(), vec![bf16::from_f32(100.0).to_bits(); n]], 1).unwrap();
    for i in 0..n {
        assert_eq!(bf16::from_bits(out[i]).to_f32(), bf16::from_bits(c[i]).to_f32().max(100.0));
    }
}

#[test]
fn unaligned_halves_give_what_aligned_ones_give() {
    let n = BLOCK + 5;
    for dtype in [DType::F16, DType::BF16] {
        let values: Vec<f32> = (0..n).map(|i| (i as f32 - 700.0) * 0.37).collect();
        let bits = |v: f32| match dtype {
            DType::F16 => f16::from_f32(v).to_bits(),
            _ => bf16::from_f32(v).to_bits(),
        };
        let a: Vec<u16> = values.iter().map(|v| bits(*v)).collect();
        let b: Vec<u16> = values.iter().map(|v| bits(v * 3.0)).collect();
        let aligned = run(dtype, ReduceOp::Sum, &[a.clone(), b.clone()], 1).unwrap();
        // the same data one byte into byte buffers
        let shift = |v: &[u16]| {
            let mut bytes = vec![0u8; 2 * v.len() + 1];
            for (i, x) in v.iter().enumerate() {
                bytes[1 + 2 * i..3 + 2 * i].copy_from_slice(&x.to_le_bytes());
            }
            bytes
        };
        let (sa, sb) = (shift(&a), shift(&b));
        let mut out = vec![0u8; 2 * n + 1];
        // SAFETY: every buffer holds 2 * n bytes after its first byte.
        unsafe {
            reduce(dtype, ReduceOp::Sum, &[sa.as_ptr().add(1), sb.as_ptr().add(1)], &[out.as_mut_ptr().add(1)], n, 1)
                .unwrap()
        };
        for i in 0..n {
            assert_eq!(u16::from_le_bytes([out[1 + 2 * i], out[2 + 2 * i]]), aligned[i], "{dtype:?} {i}");
        }
    }
}

#[test]
fn the_f16c_path_gives_what_the_half_crate_gives() {
    if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")) {
        return;
    }
    let n = BLOCK + 13;
    let mut rng = fastrand::Rng::with_seed(7);
    let a: Vec<u16> =
        (0..n).map(|_| f16::from_f32((rng.f32() - 0.5) * 2f32.powi(rng.i32(-20..16))).to_bits()).collect();
    let b: Vec<u16> = (0..n).map(|_| f16::from_f32((rng.f32() - 0.5) * 3.0).to_bits()).collect();
    let (mut plain, mut simd) = (vec![0u16; n], vec![0u16; n]);
    let srcs = [a.as_ptr() as *const u8, b.as_ptr() as *const u8];
    // SAFETY: every buffer holds n halves; the processor has AVX2 and F16C (checked above).
    unsafe {
        half_kernel::<f16, false>(ReduceOp::Sum, &srcs, &[plain.as_mut_ptr() as *mut u8], n, 3);
        half_kernel_avx2::<f16>(ReduceOp::Sum, &srcs, &[simd.as_mut_ptr() as *mut u8], n, 3);
    }
    assert_eq!(plain, simd);
}

#[test]
fn the_avx2_build_gives_what_the_baseline_gives_bit_for_bit() {
    if !std::is_x86_feature_detected!("avx2") {
        return;
    }
    let n = BLOCK * 2 + 29; // whole blocks and a tail
    let mut rng = fastrand::Rng::with_seed(11);
    for dtype in DType::ALL {
        let bytes = n * dtype.size();
        // random bits: floats include NaNs, infinities and subnormals; bools are 0 or 1
        let mut source = || -> Vec<u8> {
            (0..bytes).map(|_| if dtype == DType::Bool { rng.u8(0..2) } else { rng.u8(..) }).collect()
        };
        let inputs = [source(), source(), source()];
        for op in ReduceOp::ALL {
            for (sources, divisor) in [(2, 1), (3, 1), (2, 3)] {
                if (op.is_bitwise() && dtype.is_float()) || (divisor > 1 && !dtype.is_float()) {
                    continue;
                }
                let srcs: Vec<*const u8> = inputs[..sources].iter().map(|v| v.as_ptr()).collect();
                let (mut baseline, mut avx2) = (vec![0u8; bytes], vec![0u8; bytes]);
                // SAFETY: every buffer holds n elements of dtype; the processor has AVX2 (checked above).
                unsafe {
                    any_kernel(dtype, op, &srcs, &[baseline.as_mut_ptr()], n, divisor);
                    run_kernel_avx2(dtype, op, &srcs, &[avx2.as_mut_ptr()], n, divisor);
                }
                assert!(baseline == avx2, "{dtype:?} {op:?} from {sources} sources, divided by {divisor}");
            }
        }
    }
}

#[test]
fn the_direct_pass_gives_what_the_block_pass_gives() {
    // aligned and apart: the direct pass; the same data one byte off: the block pass
    let n = BLOCK + 21;
    let mut rng = fastrand::Rng::with_seed(5);
    for dtype in DType::ALL {
        let bytes = n * dtype.size();
        let mut source = || -> Vec<u64> {
            (0..bytes.div_ceil(8))
                .map(|_| if dtype == DType::Bool { 0x0101_0001_0100_0101 } else { rng.u64(..) })
                .collect()
        };
        let (a, b) = (source(), source());
        for op in ReduceOp::ALL {
            if op.is_bitwise() && dtype.is_float() {
                continue;
            }
            let mut direct = vec![0u64; bytes.div_ceil(8)];
            let mut shifted = vec![0u8; bytes + 1];
            let srcs = [a.as_ptr() as *const u8, b.as_ptr() as *const u8];
            // SAFETY: every buffer holds at least `bytes` bytes (the shifted one after its first).
            unsafe {
                reduce(dtype, op, &srcs, &[direct.as_mut_ptr() as *mut u8], n, 1).unwrap();
                reduce(dtype, op, &srcs, &[shifted.as_mut_ptr().add(1)], n, 1).unwrap();
            }
            // SAFETY: `direct` holds at least `bytes` bytes.
            let direct = unsafe { std::slice::from_raw_parts(direct.as_ptr() as *const u8, bytes) };
            assert!(direct == &shifted[1..], "{dtype:?} {op:?}");
        }
    }
}

#[test]
fn destination_may_be_a_source_and_several_destinations_get_the_same() {
    let n = BLOCK + 1;
    let mut a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = vec![1.0; n];
    let mut other = vec![0f32; n];
    let pa = a.as_mut_ptr() as *mut u8;
    // SAFETY: a, b and other hold n f32 each; a is both a source and a destination.
    unsafe {
        reduce(DType::F32, ReduceOp::Sum, &[pa, b.as_ptr() as *const u8], &[pa, other.as_mut_ptr() as *mut u8], n, 1)
            .unwrap()
    };
    for i in 0..n {
        assert_eq!(a[i], i as f32 + 1.0);
        assert_eq!(other[i], a[i]);
    }
}

#[test]
fn refusals() {
    assert_eq!(run::<f32>(DType::F32, ReduceOp::BitAnd, &[vec![1.0]], 1), Err(KernelError::BitwiseOnFloat(DType::F32)));
    assert_eq!(run::<i32>(DType::I32, ReduceOp::Sum, &[vec![1]], 2), Err(KernelError::DivisorOnInteger(DType::I32)));
    // SAFETY: no buffers, no elements.
    let err = unsafe { reduce(DType::F32, ReduceOp::Sum, &[], &[], 0, 1) };
    assert_eq!(err, Err(KernelError::NoSources));
}
