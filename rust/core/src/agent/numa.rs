//! `--numa-binding`: the CPUs each local rank's processes are bound to, as the launcher chose
//! them (python/elastix/agent/numa.py), checked and turned into what the kernel takes.

use nix::sched::CpuSet;
use serde::Deserialize;

use super::error::{AgentError, Result};

/// torch's modes of `--numa-binding` (`AffinityMode`).
pub const NUMA_MODES: &[&str] = &["node", "socket", "exclusive", "core-complex"];

/// What `--numa-binding` chose: the mode (for messages) and, per local rank, CPU ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaBinding {
    pub mode: String,
    pub cpus: Vec<Vec<usize>>,
}

impl NumaBinding {
    /// The CPUs `local_rank`'s processes are bound to (`None`: a rank it does not name).
    pub fn cpu_set(&self, local_rank: usize) -> Option<CpuSet> {
        let mut set = CpuSet::new();
        for &cpu in self.cpus.get(local_rank)? {
            // checked in `check`: every id fits
            set.set(cpu).ok()?;
        }
        Some(set)
    }

    /// `--numa-binding MODE: CPUs 0-3,8` for `local_rank`, for messages.
    pub fn describe(&self, local_rank: usize) -> Option<String> {
        Some(format!("--numa-binding {}: CPUs {}", self.mode, cpu_list(self.cpus.get(local_rank)?)))
    }

    pub(super) fn check(&self, local_ranks: usize) -> Result<()> {
        let mode = &self.mode;
        if !NUMA_MODES.contains(&mode.as_str()) {
            return Err(AgentError::Config(format!(
                "--numa-binding: unknown mode {mode:?} (choose from {})",
                NUMA_MODES.join(", ")
            )));
        }
        if self.cpus.len() != local_ranks {
            return Err(AgentError::Config(format!(
                "--numa-binding {mode}: CPUs for {} local ranks, but there are {local_ranks}",
                self.cpus.len()
            )));
        }
        for (local_rank, cpus) in self.cpus.iter().enumerate() {
            if cpus.is_empty() {
                return Err(AgentError::Config(format!("--numa-binding {mode}: no CPU for local rank {local_rank}")));
            }
            if let Some(cpu) = cpus.iter().find(|cpu| **cpu >= CpuSet::count()) {
                return Err(AgentError::Config(format!(
                    "--numa-binding {mode}: CPU {cpu} (local rank {local_rank}) is beyond the {} CPUs a binding can name",
                    CpuSet::count()
                )));
            }
        }
        Ok(())
    }
}

/// CPU ids as sysfs and `numactl` write them: `0-3,8,10-11`.
pub fn cpu_list(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for cpu in sorted {
        match ranges.last_mut() {
            Some((_, end)) if *end + 1 == cpu => *end = cpu,
            _ => ranges.push((cpu, cpu)),
        }
    }
    let text: Vec<String> =
        ranges.iter().map(|&(low, high)| if low == high { low.to_string() } else { format!("{low}-{high}") }).collect();
    text.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_read_as_sysfs_writes_them() {
        assert_eq!(cpu_list(&[]), "");
        assert_eq!(cpu_list(&[5]), "5");
        assert_eq!(cpu_list(&[11, 0, 1, 2, 3, 8, 10, 3]), "0-3,8,10-11");
    }
}
