//! The collectives a `Waiter` does in one lock-step on its slots
//! (`elastix_core::collectives::slots`): the copies in, the step, the copies or the reduction
//! out, in one call from Python, whose own copies, slices and lists of views cost more than the
//! step. Arrays come through the buffer protocol; the step is the caller's (`Waiter::step`).

use elastix_core::collectives::{DType, ReduceOp, SegmentError, SlotError, Slots};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::RawBuf;
use crate::collectives::DETACH_BYTES;

/// How a step ended, as `Waiter.step` returns it (None: every rank arrived, in agreement).
pub(crate) type Outcome = Option<(&'static str, Vec<u64>)>;

fn segment_error(err: SegmentError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

fn slot_error(err: SlotError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

/// Runs `f` without the GIL when it moves `len` bytes or more.
fn detach_if<R: Send>(py: Python<'_>, len: usize, f: impl FnOnce() -> R + Send) -> R {
    if len >= DETACH_BYTES {
        py.detach(f)
    } else {
        f()
    }
}

pub(crate) fn kernel(dtype: u8, op: u8) -> PyResult<(DType, ReduceOp)> {
    let dtype = DType::from_code(dtype).ok_or_else(|| PyValueError::new_err(format!("unknown dtype code {dtype}")))?;
    let op = ReduceOp::from_code(op).ok_or_else(|| PyValueError::new_err(format!("unknown op code {op}")))?;
    Ok((dtype, op))
}

/// `x` into this rank's slot, the step, then (`reduce_here`) every rank's slot reduced into `x`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_reduce(
    py: Python<'_>,
    slots: &Slots,
    seq: u64,
    x: &Bound<'_, PyAny>,
    (dtype, op): (DType, ReduceOp),
    divisor: u32,
    reduce_here: bool,
    step: impl FnOnce() -> PyResult<Outcome>,
) -> PyResult<Outcome> {
    let buf = RawBuf::get(x, reduce_here)?;
    let (addr, len) = (buf.addr(), buf.len());
    // SAFETY: `buf` holds the array (alive, contiguous, `len` bytes, writable where it is
    // reduced into) until we return; it is the caller's array, not a view of the slots.
    detach_if(py, len, || unsafe { slots.stage(seq, 0, addr as *const u8, len) }).map_err(segment_error)?;
    let outcome = step()?;
    if outcome.is_none() && reduce_here {
        // SAFETY: as for the stage.
        detach_if(py, len, || unsafe { slots.reduce_into(seq, 0, dtype, op, addr as *mut u8, len, divisor, None) })
            .map_err(slot_error)?;
    }
    Ok(outcome)
}

/// `send` (if any) into this rank's slot, the step, then `recv[j]` (where not None) gets the
/// start of rank j's slot: an all_gather, a gather's root, a broadcast.
pub(crate) fn copy(
    py: Python<'_>,
    slots: &Slots,
    seq: u64,
    send: Option<&Bound<'_, PyAny>>,
    recv: &Bound<'_, PyAny>,
    step: impl FnOnce() -> PyResult<Outcome>,
) -> PyResult<Outcome> {
    if let Some(send) = send {
        let buf = RawBuf::get(send, false)?;
        let (addr, len) = (buf.addr(), buf.len());
        // SAFETY: `buf` holds the array (alive, contiguous, `len` bytes) until this block ends.
        detach_if(py, len, || unsafe { slots.stage(seq, 0, addr as *const u8, len) }).map_err(segment_error)?;
    }
    let targets = recv
        .try_iter()?
        .map(|t| t.and_then(|t| if t.is_none() { Ok(None) } else { RawBuf::get(&t, true).map(Some) }))
        .collect::<PyResult<Vec<_>>>()?;
    if targets.len() > slots.ranks() {
        return Err(PyValueError::new_err(format!("{} targets for {} ranks", targets.len(), slots.ranks())));
    }
    let outcome = step()?;
    if outcome.is_none() {
        let plan: Vec<(usize, usize, usize)> =
            targets.iter().enumerate().filter_map(|(j, t)| t.as_ref().map(|t| (j, t.addr(), t.len()))).collect();
        let total = plan.iter().map(|&(_, _, len)| len).sum();
        detach_if(py, total, || {
            plan.iter().try_for_each(|&(j, addr, len)| {
                // SAFETY: `targets` holds each array (alive, contiguous, writable, `len` bytes)
                // until we return; they are the caller's arrays, not views of the slots.
                unsafe { slots.fetch(seq, j, 0, addr as *mut u8, len) }
            })
        })
        .map_err(segment_error)?;
    }
    Ok(outcome)
}

/// `ins[j]` (j not this rank) into this rank's slot at `j * region`, the step, then `out` gets
/// the reduction of every rank's operand for this rank (its own from `ins[me]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_scatter(
    py: Python<'_>,
    slots: &Slots,
    seq: u64,
    ins: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    region: usize,
    (dtype, op): (DType, ReduceOp),
    divisor: u32,
    step: impl FnOnce() -> PyResult<Outcome>,
) -> PyResult<Outcome> {
    let sources = ins.try_iter()?.map(|s| RawBuf::get(&s?, false)).collect::<PyResult<Vec<_>>>()?;
    let target = RawBuf::get(out, true)?;
    let len = target.len();
    if sources.len() != slots.ranks() || sources.iter().any(|s| s.len() != len) {
        return Err(PyValueError::new_err(format!("reduce_scatter needs {} inputs of {len} bytes", slots.ranks())));
    }
    let me = slots.me();
    let staged: Vec<(usize, usize)> =
        sources.iter().enumerate().filter(|&(j, _)| j != me).map(|(j, s)| (j, s.addr())).collect();
    detach_if(py, len * staged.len(), || {
        staged.iter().try_for_each(|&(j, addr)| {
            let offset = j.checked_mul(region).ok_or(SegmentError::Invalid("data larger than a slot"))?;
            // SAFETY: `sources` holds each array (alive, contiguous, `len` bytes) until we return.
            unsafe { slots.stage(seq, offset, addr as *const u8, len) }
        })
    })
    .map_err(segment_error)?;
    let outcome = step()?;
    if outcome.is_none() {
        let (into, own) = (target.addr(), sources[me].addr());
        let offset =
            me.checked_mul(region).ok_or_else(|| segment_error(SegmentError::Invalid("data larger than a slot")))?;
        detach_if(py, len, || {
            // SAFETY: `target` and `sources` hold the arrays (alive, contiguous, `len` bytes,
            // the target writable) until we return; they are the caller's, not the slots.
            unsafe { slots.reduce_into(seq, offset, dtype, op, into as *mut u8, len, divisor, Some(own as *const u8)) }
        })
        .map_err(slot_error)?;
    }
    Ok(outcome)
}
