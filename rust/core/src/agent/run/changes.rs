//! The round's membership changes, as the rendezvous reports them, and waits for the next.

use tokio::sync::watch;

use crate::rendezvous::MembershipChange;

/// The round's membership changes, as the rendezvous reports them (`None`: a backend without).
pub(super) type Changes = Option<watch::Receiver<Option<MembershipChange>>>;

/// The next membership change (never, for a backend without any).
pub(super) async fn next_change(changes: &mut Changes) -> MembershipChange {
    let Some(receiver) = changes else { return std::future::pending().await };
    loop {
        if let Some(change) = receiver.borrow_and_update().clone() {
            return change;
        }
        if receiver.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// The next membership change not seen yet (never, for a backend without any).
pub(super) async fn new_change(changes: &mut Changes) -> MembershipChange {
    let Some(receiver) = changes else { return std::future::pending().await };
    loop {
        if receiver.changed().await.is_err() {
            return std::future::pending().await;
        }
        if let Some(change) = receiver.borrow_and_update().clone() {
            return change;
        }
    }
}
