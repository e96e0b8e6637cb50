//! The agent's interface to the etcd rendezvous ([`Backend`]).

use super::*;

impl Backend for EtcdRendezvous {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn run_id(&self) -> &str {
        EtcdRendezvous::run_id(self)
    }

    fn next_rendezvous(&mut self) -> Fut<'_, RendezvousInfo> {
        Box::pin(EtcdRendezvous::next_rendezvous(self))
    }

    fn report_failure(&mut self) -> Fut<'_, i64> {
        Box::pin(EtcdRendezvous::report_failure(self))
    }

    fn record_restart(&mut self) -> Fut<'_, i64> {
        Box::pin(EtcdRendezvous::record_restart(self))
    }

    fn restart_count(&mut self) -> Fut<'_, i64> {
        Box::pin(EtcdRendezvous::restart_count(self))
    }

    fn describe_store(&self) -> String {
        EtcdRendezvous::describe_store(self)
    }

    fn secret(&self) -> Option<&crate::auth::Secret> {
        self.settings.secret.as_ref()
    }

    fn loss_window(&self) -> Duration {
        self.settings.node_lost_after()
    }

    fn num_nodes_waiting(&mut self) -> Fut<'_, u32> {
        Box::pin(EtcdRendezvous::num_nodes_waiting(self))
    }

    fn is_closed(&mut self) -> Fut<'_, bool> {
        Box::pin(EtcdRendezvous::is_closed(self))
    }

    fn set_closed_with<'a>(&'a mut self, reason: &'a str) -> Fut<'a, ()> {
        Box::pin(EtcdRendezvous::set_closed_with(self, reason))
    }

    fn closed_reason(&mut self) -> Fut<'_, Option<String>> {
        Box::pin(EtcdRendezvous::closed_reason(self))
    }

    fn changes(&self) -> Option<watch::Receiver<Option<MembershipChange>>> {
        EtcdRendezvous::changes(self)
    }

    fn publish_node_status(&mut self, facts: AgentFacts) -> Fut<'_, ()> {
        Box::pin(EtcdRendezvous::publish_node_status(self, facts))
    }

    fn publish_failure<'a>(&'a mut self, failure: &'a FailureRecord) -> Fut<'a, ()> {
        Box::pin(EtcdRendezvous::publish_failure(self, failure))
    }

    fn status_writer(&self) -> Option<StatusWriter> {
        EtcdRendezvous::status_writer(self)
    }

    fn census<'a>(&'a mut self, only: Option<&'a [u32]>) -> Fut<'a, Census> {
        Box::pin(EtcdRendezvous::census(self, only))
    }

    fn round_ended(&mut self) -> Fut<'_, Option<MembershipChange>> {
        Box::pin(EtcdRendezvous::round_ended(self))
    }

    fn shutdown(&mut self) {
        EtcdRendezvous::shutdown(self);
    }

    fn linger(&mut self, _within: Duration) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        self.disconnect();
        Box::pin(std::future::ready(()))
    }
}
