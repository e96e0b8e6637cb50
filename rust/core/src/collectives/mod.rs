//! Building blocks of the CPU collectives (`elastix.collectives`), with no Python in sight.
//!
//! The algorithms live in Python; these are the pieces measurements showed Python could not do
//! well, and the ones that must be memory-safe whatever Python does:
//! * [`kernels`]: reductions in one pass over any number of sources into one or two
//!   destinations, for every dtype including float16 and bfloat16 (via the `half` crate), which
//!   NumPy adds 30x slower than float32;
//! * [`mapping`]: shared memory mapped and owned by Rust, its words reached by checked offsets;
//! * [`segment`]: a mapping that can be closed while other threads use it, without ever being
//!   unmapped under them;
//! * [`counters`] and [`rank_counters`]: waits on sequence counters in shared memory (spin, then yield,
//!   then a futex, checking the peers' liveness and abort words, with acquire/release ordering
//!   that Python cannot express);
//! * [`slots`]: the ranks' data buffers in a segment, staged and reduced by a small
//!   collective in one call (Python's own copies and list of views cost more than the step).

pub mod counters;
pub mod dtype;
pub mod kernels;
pub mod mapping;
pub mod rank_counters;
pub mod segment;
pub mod slots;

pub use counters::{publish, wait_all, wake, Liveness, Peer, SpinPolicy, WaitError};
pub use dtype::{DType, ReduceOp};
pub use kernels::{reduce, KernelError};
pub use mapping::{Backing, Handle, OffsetError, SharedMemory};
pub use rank_counters::{Descriptors, StepEnd, Waiter, Words};
pub use segment::{Segment, SegmentError};
pub use slots::{SlotError, Slots};
