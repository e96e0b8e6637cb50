//! Reduction kernels: `dst = src[0] op src[1] op ... op src[n-1]` (optionally divided by a
//! count, for averages) written to one or more destinations, in one pass over the sources.
//!
//! The sources are combined in the order given, block by block (a few KiB that stay in L1), so
//! every rank that reduces the same sources in the same order gets bit-identical results.
//! float16 and bfloat16 are accumulated in f32 and rounded once per block.
//! Integers wrap on overflow, as NumPy's do; bool is logical (sum and max are "or", product and
//! min are "and"); float min and max propagate NaN, as NumPy's `minimum`/`maximum` do.

use std::mem::{align_of, size_of};
use std::ptr::copy_nonoverlapping;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::dtype::{DType, ReduceOp};

pub mod streaming;

/// Elements per block: the accumulator lives on the stack.
const BLOCK: usize = 2048;

/// Why a reduction was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("a reduction needs at least one source")]
    NoSources,
    #[error("bitwise reductions need integer or bool data, not {0:?}")]
    BitwiseOnFloat(DType),
    #[error("an average needs floating-point data, not {0:?}")]
    DivisorOnInteger(DType),
}

/// Reduces `n` elements of type `dtype` from every source into every destination.
/// `divisor` > 1 divides the result (floats only: averages).
///
/// # Safety
/// Every source must be valid for reading, and every destination for writing, `n *
/// dtype.size()` bytes. A destination may be the very same address as a source (each block is
/// read entirely before it is written); buffers that otherwise overlap get meaningless values
/// (they are reached through raw pointers, never through two references at once).
pub unsafe fn reduce(
    dtype: DType,
    op: ReduceOp,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    divisor: u32,
) -> Result<(), KernelError> {
    if srcs.is_empty() {
        return Err(KernelError::NoSources);
    }
    if op.is_bitwise() && dtype.is_float() {
        return Err(KernelError::BitwiseOnFloat(dtype));
    }
    if divisor > 1 && !dtype.is_float() {
        return Err(KernelError::DivisorOnInteger(dtype));
    }
    // SAFETY: the caller's guarantees (above) are what every kernel needs.
    unsafe { run_kernel(dtype, op, srcs, dsts, n, divisor) };
    Ok(())
}

/// Runs the kernel compiled for AVX2 where the processor has it (twice the vector width of
/// the x86-64 baseline's SSE2: a 2-source float32 sum into two destinations ran 1.3x faster).
/// Results are the same either way: each element is combined in the same order.
///
/// # Safety
/// As for [`reduce`], with the arguments already checked.
unsafe fn run_kernel(dtype: DType, op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize, divisor: u32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2 (checked above); the rest is the caller's.
        return unsafe { run_kernel_avx2(dtype, op, srcs, dsts, n, divisor) };
    }
    // SAFETY: the caller passes on `reduce`'s guarantees.
    unsafe { any_kernel(dtype, op, srcs, dsts, n, divisor) }
}

/// # Safety
/// As for [`reduce`], with the arguments already checked, on a processor with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_kernel_avx2(dtype: DType, op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize, divisor: u32) {
    // SAFETY: the caller passes on `reduce`'s guarantees.
    unsafe { any_kernel(dtype, op, srcs, dsts, n, divisor) }
}

/// The kernel for `dtype`, inlined into each of [`run_kernel`]'s builds.
///
/// # Safety
/// As for [`reduce`], with the arguments already checked.
#[inline(always)]
unsafe fn any_kernel(dtype: DType, op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize, divisor: u32) {
    // SAFETY: the caller passes on `reduce`'s guarantees.
    unsafe {
        match dtype {
            DType::Bool => bool_kernel(op, srcs, dsts, n),
            DType::I8 => int_kernel::<i8>(op, srcs, dsts, n),
            DType::U8 => int_kernel::<u8>(op, srcs, dsts, n),
            DType::I16 => int_kernel::<i16>(op, srcs, dsts, n),
            DType::U16 => int_kernel::<u16>(op, srcs, dsts, n),
            DType::I32 => int_kernel::<i32>(op, srcs, dsts, n),
            DType::U32 => int_kernel::<u32>(op, srcs, dsts, n),
            DType::I64 => int_kernel::<i64>(op, srcs, dsts, n),
            DType::U64 => int_kernel::<u64>(op, srcs, dsts, n),
            DType::F32 => float_kernel::<f32>(op, srcs, dsts, n, divisor),
            DType::F64 => float_kernel::<f64>(op, srcs, dsts, n, divisor),
            DType::F16 => half_dispatch::<f16>(op, srcs, dsts, n, divisor),
            DType::BF16 => half_dispatch::<bf16>(op, srcs, dsts, n, divisor),
        }
    }
}

/// Runs `combine` over the sources and writes `post(result)` to every destination. Two aligned
/// sources whose destinations provably do not overlap them wrongly take one pass over slices
/// ([`direct`]); otherwise the sources are combined block by block in a stack buffer (first two
/// fused) that is then copied out. Both vectorise: a pass over raw pointers into destinations
/// that may alias the sources did not (it ran at 40% of the block path's speed).
///
/// # Safety
/// As for [`reduce`]: sources readable and destinations writable for `n` elements of `T`.
#[inline(always)]
unsafe fn drive<T: Copy + Default>(
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    combine: impl Fn(T, T) -> T + Copy,
    post: impl Fn(T) -> T + Copy,
) {
    // SAFETY: the caller's contract, passed on.
    if unsafe { direct::<T>(srcs, dsts, n, combine, post) } {
        return;
    }
    let size = size_of::<T>();
    let mut block = [T::default(); BLOCK];
    let mut done = 0;
    while done < n {
        let len = BLOCK.min(n - done);
        let acc = &mut block[..len];
        let offset = done * size;
        // SAFETY: elements done..done + len are inside every buffer (the caller's contract);
        // the stack block never overlaps them; a destination that is a source is written only
        // after the whole block was read.
        unsafe {
            if srcs.len() >= 2 {
                let (a, b) = (srcs[0].add(offset) as *const T, srcs[1].add(offset) as *const T);
                for (i, x) in acc.iter_mut().enumerate() {
                    *x = combine(a.add(i).read_unaligned(), b.add(i).read_unaligned());
                }
            } else {
                copy_nonoverlapping(srcs[0].add(offset), acc.as_mut_ptr() as *mut u8, len * size);
            }
            for src in srcs.iter().skip(2) {
                let src = src.add(offset) as *const T;
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = combine(*a, src.add(i).read_unaligned());
                }
            }
            for x in acc.iter_mut() {
                *x = post(*x);
            }
            for dst in dsts {
                copy_nonoverlapping(acc.as_ptr() as *const u8, dst.add(offset), len * size);
            }
        }
        done += len;
    }
}

/// Two sources, aligned, whose destinations are either the first source itself or apart from
/// both: one fused pass into one destination, as slices the compiler can vectorise knowing
/// they do not overlap, then a copy into the others (while the first is in cache). False when
/// the buffers do not qualify; nothing was written then.
///
/// The block path costs a second pass through the stack: a 2-rank reduce_scatter's reduction
/// into its output (32 MiB) took 4.4 ms on it, NumPy's `add` 2.0 ms.
///
/// # Safety
/// As for [`drive`].
#[inline(always)]
unsafe fn direct<T: Copy>(
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    combine: impl Fn(T, T) -> T + Copy,
    post: impl Fn(T) -> T + Copy,
) -> bool {
    let [a, b] = srcs else { return false };
    if n == 0 {
        return true;
    }
    let bytes = n * size_of::<T>();
    let range = |p: usize| p..p + bytes;
    let apart = |p: usize, q: usize| range(p).end <= q || range(q).end <= p;
    let aligned =
        srcs.iter().map(|p| *p as usize).chain(dsts.iter().map(|p| *p as usize)).all(|p| p % align_of::<T>() == 0);
    let (a, b) = (*a as usize, *b as usize);
    let in_place = dsts.iter().position(|d| *d as usize == a);
    let target = in_place.unwrap_or(0);
    let Some(&first) = dsts.get(target) else { return false };
    let first = first as usize;
    let fits = dsts.iter().enumerate().all(|(i, d)| {
        let d = *d as usize;
        apart(d, b)
            && (Some(i) == in_place || apart(d, a))
            && dsts.iter().enumerate().all(|(j, e)| i == j || apart(d, *e as usize))
    });
    if !aligned || !fits {
        return false;
    }
    // SAFETY: every buffer is valid for n elements of T (the caller's contract) and aligned for
    // T (checked); the target overlaps no buffer it is borrowed beside (checked: it is apart from
    // `b`, and either is `a`, which is then not borrowed, or is apart from it).
    unsafe {
        let out = std::slice::from_raw_parts_mut(first as *mut T, n);
        let b = std::slice::from_raw_parts(b as *const T, n);
        if in_place.is_some() {
            for (o, y) in out.iter_mut().zip(b) {
                *o = post(combine(*o, *y));
            }
        } else {
            let a = std::slice::from_raw_parts(a as *const T, n);
            for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
                *o = post(combine(*x, *y));
            }
        }
        for (i, d) in dsts.iter().enumerate() {
            if i != target {
                copy_nonoverlapping(first as *const u8, *d, bytes);
            }
        }
    }
    true
}

/// No finishing step.
#[inline(always)]
fn keep<T>(x: T) -> T {
    x
}

/// Integer arithmetic that wraps, as NumPy's does.
trait Int: Copy + Default + Ord {
    fn wadd(self, other: Self) -> Self;
    fn wmul(self, other: Self) -> Self;
    fn and(self, other: Self) -> Self;
    fn or(self, other: Self) -> Self;
    fn xor(self, other: Self) -> Self;
}

macro_rules! int_impl {
    ($($t:ty),*) => {$(
        impl Int for $t {
            #[inline(always)]
            fn wadd(self, other: Self) -> Self { self.wrapping_add(other) }
            #[inline(always)]
            fn wmul(self, other: Self) -> Self { self.wrapping_mul(other) }
            #[inline(always)]
            fn and(self, other: Self) -> Self { self & other }
            #[inline(always)]
            fn or(self, other: Self) -> Self { self | other }
            #[inline(always)]
            fn xor(self, other: Self) -> Self { self ^ other }
        }
    )*};
}
int_impl!(i8, u8, i16, u16, i32, u32, i64, u64);

/// # Safety
/// As for [`reduce`].
#[inline(always)]
unsafe fn int_kernel<T: Int>(op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize) {
    // SAFETY: the caller passes on `reduce`'s guarantees.
    unsafe {
        match op {
            ReduceOp::Sum => drive::<T>(srcs, dsts, n, T::wadd, keep::<T>),
            ReduceOp::Product => drive::<T>(srcs, dsts, n, T::wmul, keep::<T>),
            ReduceOp::Min => drive::<T>(srcs, dsts, n, Ord::min, keep::<T>),
            ReduceOp::Max => drive::<T>(srcs, dsts, n, Ord::max, keep::<T>),
            ReduceOp::BitAnd => drive::<T>(srcs, dsts, n, T::and, keep::<T>),
            ReduceOp::BitOr => drive::<T>(srcs, dsts, n, T::or, keep::<T>),
            ReduceOp::BitXor => drive::<T>(srcs, dsts, n, T::xor, keep::<T>),
        }
    }
}

/// # Safety
/// As for [`reduce`].
#[inline(always)]
unsafe fn bool_kernel(op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize) {
    // NumPy bools are bytes holding 0 or 1, so logical ops are the bitwise ones on u8.
    // SAFETY: the caller passes on `reduce`'s guarantees.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BitOr => drive::<u8>(srcs, dsts, n, |a, b| a | b, keep::<u8>),
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BitAnd => {
                drive::<u8>(srcs, dsts, n, |a, b| a & b, keep::<u8>)
            }
            ReduceOp::BitXor => drive::<u8>(srcs, dsts, n, |a, b| a ^ b, keep::<u8>),
        }
    }
}

trait Float:
    Copy + Default + PartialOrd + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + std::ops::Div<Output = Self>
{
    fn from_u32(v: u32) -> Self;
    fn nan(self) -> bool;
}

impl Float for f32 {
    #[inline(always)]
    fn from_u32(v: u32) -> Self {
        v as f32
    }
    #[inline(always)]
    fn nan(self) -> bool {
        self.is_nan()
    }
}

impl Float for f64 {
    #[inline(always)]
    fn from_u32(v: u32) -> Self {
        v as f64
    }
    #[inline(always)]
    fn nan(self) -> bool {
        self.is_nan()
    }
}

/// NumPy's `minimum`: NaN wins.
#[inline(always)]
fn fmin<T: Float>(a: T, b: T) -> T {
    if a < b || a.nan() {
        a
    } else {
        b
    }
}

/// NumPy's `maximum`: NaN wins.
#[inline(always)]
fn fmax<T: Float>(a: T, b: T) -> T {
    if a > b || a.nan() {
        a
    } else {
        b
    }
}

#[inline(always)]
fn combiner<T: Float>(op: ReduceOp) -> fn(T, T) -> T {
    match op {
        ReduceOp::Sum => |a, b| a + b,
        ReduceOp::Product => |a, b| a * b,
        ReduceOp::Min => fmin,
        _ => fmax, // Max (bitwise ops were refused earlier)
    }
}

/// # Safety
/// As for [`reduce`].
#[inline(always)]
unsafe fn float_kernel<T: Float>(op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize, divisor: u32) {
    let d = T::from_u32(divisor.max(1));
    let divide = move |x: T| x / d;
    // Each arm is its own monomorphised loop, so the compiler can vectorise it.
    // SAFETY: the caller passes on `reduce`'s guarantees.
    unsafe {
        match (op, divisor > 1) {
            (ReduceOp::Sum, false) => drive::<T>(srcs, dsts, n, |a, b| a + b, keep::<T>),
            (ReduceOp::Sum, true) => drive::<T>(srcs, dsts, n, |a, b| a + b, divide),
            (ReduceOp::Product, false) => drive::<T>(srcs, dsts, n, |a, b| a * b, keep::<T>),
            (ReduceOp::Min, false) => drive::<T>(srcs, dsts, n, fmin, keep::<T>),
            (ReduceOp::Max, false) => drive::<T>(srcs, dsts, n, fmax, keep::<T>),
            (op, _) => drive::<T>(srcs, dsts, n, combiner::<T>(op), divide),
        }
    }
}

/// float16 or bfloat16.
trait Half16: Copy + Default {
    const IS_F16: bool;
}

impl Half16 for f16 {
    const IS_F16: bool = true;
}

impl Half16 for bf16 {
    const IS_F16: bool = false;
}

/// Runs [`half_kernel`] compiled for AVX2 and F16C where the processor has them: bfloat16
/// loops vectorise better, and float16 converts 8 values per instruction (the `half` crate's
/// slice conversion calls its F16C routine through a function pointer per 8 values, which
/// made float16 reductions 2x slower than this).
///
/// # Safety
/// As for [`reduce`].
unsafe fn half_dispatch<H: Half16>(op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize, divisor: u32)
where
    [H]: HalfFloatSliceExt,
{
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
        // SAFETY: the processor has AVX2 and F16C (checked above); the rest is the caller's.
        return unsafe { half_kernel_avx2::<H>(op, srcs, dsts, n, divisor) };
    }
    // SAFETY: the caller passes on `reduce`'s guarantees.
    unsafe { half_kernel::<H, false>(op, srcs, dsts, n, divisor) }
}

/// # Safety
/// As for [`reduce`], on a processor with AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn half_kernel_avx2<H: Half16>(op: ReduceOp, srcs: &[*const u8], dsts: &[*mut u8], n: usize, divisor: u32)
where
    [H]: HalfFloatSliceExt,
{
    // SAFETY: the caller passes on `reduce`'s guarantees, on a processor with F16C.
    unsafe { half_kernel::<H, true>(op, srcs, dsts, n, divisor) }
}

/// float16 or bfloat16 (`H`), accumulated in f32 a block at a time.
///
/// # Safety
/// As for [`reduce`]; with `F16C`, the processor must have AVX and F16C.
#[inline(always)]
unsafe fn half_kernel<H: Half16, const F16C: bool>(
    op: ReduceOp,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
    divisor: u32,
) where
    [H]: HalfFloatSliceExt,
{
    let combine = combiner::<f32>(op);
    let d = divisor.max(1) as f32;
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    let mut done = 0;
    while done < n {
        let len = BLOCK.min(n - done);
        let offset = done * 2;
        // SAFETY: elements done..done + len are inside every buffer (the caller's contract).
        unsafe { load_halves::<H, F16C>(srcs[0].add(offset), &mut acc[..len]) };
        for src in &srcs[1..] {
            // SAFETY: as above.
            unsafe { load_halves::<H, F16C>(src.add(offset), &mut tmp[..len]) };
            match op {
                ReduceOp::Sum => acc[..len].iter_mut().zip(&tmp[..len]).for_each(|(a, b)| *a += *b),
                _ => acc[..len].iter_mut().zip(&tmp[..len]).for_each(|(a, b)| *a = combine(*a, *b)),
            }
        }
        if divisor > 1 {
            acc[..len].iter_mut().for_each(|a| *a /= d);
        }
        for dst in dsts {
            // SAFETY: as above; the whole block was read before it is written.
            unsafe { store_halves::<H, F16C>(&acc[..len], dst.add(offset)) };
        }
        done += len;
    }
}

/// Reads `out.len()` (<= BLOCK) 16-bit floats at `src`, of any alignment, as f32 (the `half`
/// crate's slice conversion, with F16C where the processor has it).
///
/// # Safety
/// `src` must be valid for reading `2 * out.len()` bytes.
#[inline(always)]
unsafe fn load_halves<H: Half16, const F16C: bool>(src: *const u8, out: &mut [f32])
where
    [H]: HalfFloatSliceExt,
{
    #[cfg(target_arch = "x86_64")]
    if F16C && H::IS_F16 {
        // SAFETY: the processor has F16C (the caller's contract with F16C); the rest as here.
        return unsafe { f16c::load(src, out) };
    }
    if (src as usize) % align_of::<H>() == 0 {
        // SAFETY: readable for out.len() halves (the caller's contract) and aligned; H (f16 or
        // bf16) is valid for every bit pattern, so a peer writing meanwhile only changes values;
        // the slice is dropped before this kernel writes anything (a destination may be it).
        let halves = unsafe { std::slice::from_raw_parts(src as *const H, out.len()) };
        halves.convert_to_f32_slice(out);
    } else {
        let mut staged = [H::default(); BLOCK];
        let staged = &mut staged[..out.len()];
        // SAFETY: readable for the bytes copied (the caller's contract), into our own buffer.
        unsafe { copy_nonoverlapping(src, staged.as_mut_ptr() as *mut u8, 2 * out.len()) };
        staged.convert_to_f32_slice(out);
    }
}

/// Writes `values` (<= BLOCK) as 16-bit floats at `dst`, of any alignment.
///
/// # Safety
/// `dst` must be valid for writing `2 * values.len()` bytes, and nothing else may hold a
/// reference to them meanwhile.
#[inline(always)]
unsafe fn store_halves<H: Half16, const F16C: bool>(values: &[f32], dst: *mut u8)
where
    [H]: HalfFloatSliceExt,
{
    #[cfg(target_arch = "x86_64")]
    if F16C && H::IS_F16 {
        // SAFETY: the processor has F16C (the caller's contract with F16C); the rest as here.
        return unsafe { f16c::store(values, dst) };
    }
    if (dst as usize) % align_of::<H>() == 0 {
        // SAFETY: writable for values.len() halves (the caller's contract) and aligned; no
        // other reference into them exists while this one lives (sources were read already).
        let halves = unsafe { std::slice::from_raw_parts_mut(dst as *mut H, values.len()) };
        halves.convert_from_f32_slice(values);
    } else {
        let mut staged = [H::default(); BLOCK];
        let staged = &mut staged[..values.len()];
        staged.convert_from_f32_slice(values);
        // SAFETY: writable for the bytes copied (the caller's contract), from our own buffer.
        unsafe { copy_nonoverlapping(staged.as_ptr() as *const u8, dst, 2 * values.len()) };
    }
}

/// float16 with the F16C instructions, 8 values at a time (round to nearest, ties to even, as
/// the `half` crate does); the last few values through `half`.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    use half::f16;

    /// # Safety
    /// The processor has AVX and F16C; `src` is readable for `2 * out.len()` bytes.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    pub unsafe fn load(src: *const u8, out: &mut [f32]) {
        let whole = out.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: values i..i + 8 are readable (unaligned load) and inside `out`.
            unsafe {
                let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for (i, o) in out.iter_mut().enumerate().skip(whole) {
            // SAFETY: value i is readable.
            *o = f16::from_bits(unsafe { (src as *const u16).add(i).read_unaligned() }).to_f32();
        }
    }

    /// # Safety
    /// The processor has AVX and F16C; `dst` is writable for `2 * values.len()` bytes.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    pub unsafe fn store(values: &[f32], dst: *mut u8) {
        let whole = values.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: values i..i + 8 are inside `values` and writable at `dst` (unaligned store).
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(values.as_ptr().add(i)));
                _mm_storeu_si128(dst.add(2 * i) as *mut __m128i, h);
            }
        }
        for (i, v) in values.iter().enumerate().skip(whole) {
            // SAFETY: value i is writable.
            unsafe { (dst as *mut u16).add(i).write_unaligned(f16::from_f32(*v).to_bits()) };
        }
    }
}

#[cfg(test)]
mod tests;
