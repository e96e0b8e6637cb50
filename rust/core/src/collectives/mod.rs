//! Building blocks of the CPU collectives (`elastix.collectives`), with no Python in sight.
//!
//! The algorithms live in Python; these are the pieces measurements showed Python could not do
//! well: the reduction kernels ([`kernels`]: one pass over any number of sources into one or two
//! destinations, for every dtype including float16 and bfloat16, which NumPy adds 30x slower
//! than float32), and the waits on sequence counters in shared memory ([`wait`]: spin, then
//! yield, then a futex, checking the peers' liveness and abort words, with acquire/release
//! ordering that Python cannot express).

pub mod dtype;
pub mod half;
pub mod kernels;
pub mod wait;

pub use dtype::{DType, ReduceOp};
pub use kernels::{reduce, KernelError};
pub use wait::{publish, wait_all, wake, Liveness, Peer, SpinPolicy, WaitError};
