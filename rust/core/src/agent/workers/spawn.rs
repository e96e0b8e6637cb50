//! Starting one worker of a group: its place and environment, a warm standby or a cold start,
//! its output pumped to the console and its files, and its exit reported to the group.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::agent::config::{AgentConfig, STD_ERR, STD_OUT};
use crate::agent::error::{AgentError, Result};
use crate::agent::hangs::activity::Activity;
use crate::agent::hangs::heartbeats;
use crate::agent::output::logfiles::{LogFile, LogWriter};
use crate::agent::output::logs::{expand_prefix, DEFAULT_TEE_PREFIX};
use crate::agent::output::pump::{pump, Duplicate, Sink};
use crate::agent::workers::env::{worker_args, worker_env, WorkerPlace};
use crate::agent::workers::process::{Output, Supervised, SupervisedCommand};
use crate::agent::workers::ranks::Assignment;
use crate::agent::workers::reaper::{Cgroup, Watch};
use crate::agent::workers::standby::Standby;
use crate::console;
use crate::rendezvous::RendezvousInfo;

/// One worker of the group, as its group keeps it.
pub(super) struct Worker {
    pub(super) place: WorkerPlace,
    pub(super) pid: u32,
    pub(super) exit: Option<(ExitStatus, SystemTime)>,
    pub(super) pumps: Vec<JoinHandle<()>>,
    pub(super) stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// Where it dumps its stacks when asked.
    pub(super) stacks_file: PathBuf,
    /// What the kernel showed of its main process: whether its main thread runs, and its CPU
    /// use (a worker in a long C call is busy, not hung).
    pub(super) activity: Activity,
    /// Dropped after the group is killed: the watchdog forgets the group only then.
    pub(super) watch: Watch,
}

/// What a group needs to start.
pub struct Launch<'a> {
    pub config: &'a AgentConfig,
    pub info: &'a RendezvousInfo,
    pub assignment: &'a Assignment,
    pub restart_count: i64,
    /// `None` when log files are off: no files, and an empty error file path (torch's rule).
    pub attempt_dir: Option<&'a Path>,
    /// Writes the log files under `attempt_dir`.
    pub log_writer: &'a LogWriter,
    pub host: &'a str,
    /// Where each local rank's workers write.
    pub outputs: &'a [Output],
}

/// The attempt's duplicate-filter files, shared by its workers: stdout's and stderr's.
pub(super) type DuplicateFiles = [Option<(Arc<[String]>, LogFile)>; 2];

pub(super) fn duplicate_files(launch: &Launch<'_>) -> Result<DuplicateFiles> {
    let config = launch.config;
    let open = |filters: &[String], name: &str| -> Result<Option<(Arc<[String]>, LogFile)>> {
        match launch.attempt_dir {
            Some(dir) if filters.iter().any(|filter| !filter.is_empty()) => {
                Ok(Some((filters.into(), launch.log_writer.create(&dir.join(name))?)))
            }
            _ => Ok(None),
        }
    };
    Ok([
        open(&config.duplicate_stdout_filters, "filtered_stdout.log")?,
        open(&config.duplicate_stderr_filters, "filtered_stderr.log")?,
    ])
}

/// Where a worker's exit goes: its index, how it ended, when.
pub(super) type Exits = mpsc::UnboundedSender<(usize, std::io::Result<ExitStatus>, SystemTime)>;

/// What every worker of an attempt shares.
pub(super) struct Spawner<'a> {
    pub(super) launch: &'a Launch<'a>,
    pub(super) duplicates: &'a DuplicateFiles,
    /// The heartbeat slots' page, when hangs are watched.
    pub(super) heartbeat_page: Option<&'a Path>,
    pub(super) cgroup: Option<&'a Cgroup>,
    pub(super) exits: Exits,
}

impl Spawner<'_> {
    /// Starts local rank `local_rank`'s worker, from `standby` if one is ready.
    pub(super) fn spawn(&self, local_rank: u32, standby: Option<Standby>) -> Result<Worker> {
        let config = self.launch.config;
        let rank_dir = self.launch.attempt_dir.map(|dir| dir.join(local_rank.to_string()));
        let error_file =
            rank_dir.as_ref().map(|dir| dir.join("error.json").to_string_lossy().into_owned()).unwrap_or_default();
        let place = WorkerPlace::new(local_rank, self.launch.assignment, self.launch.restart_count, error_file);
        let args = worker_args(&config.args, local_rank);
        let mut env = worker_env(config, self.launch.info, self.launch.assignment, &place);
        let stacks_file = match &rank_dir {
            Some(dir) => dir.join("stacks.log"),
            None => std::env::temp_dir().join(format!("elastix-stacks-{}-{}", std::process::id(), place.global_rank)),
        };
        if let Some(page) = self.heartbeat_page {
            env.insert(heartbeats::FILE_VAR.to_owned(), page.to_string_lossy().into_owned());
            env.insert(heartbeats::SLOT_VAR.to_owned(), local_rank.to_string());
            env.insert(heartbeats::STACKS_VAR.to_owned(), stacks_file.to_string_lossy().into_owned());
        }
        let Supervised { mut child, pid, watch } = self.process(&place, &args, &env, standby)?;
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let mut pumps = Vec::new();
        if let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) {
            let streams = (rank_dir.as_deref(), &place);
            pumps.push(pump(stdout, self.sink(streams, STD_OUT, "stdout.log", None)?));
            pumps.push(pump(stderr, self.sink(streams, STD_ERR, "stderr.log", Some(stderr_tail.clone()))?));
        }
        let (index, reaped, exits) = (local_rank as usize, watch.clone(), self.exits.clone());
        tokio::spawn(async move {
            let status = child.wait().await;
            reaped.release_if_empty();
            let _ = exits.send((index, status, SystemTime::now()));
        });
        Ok(Worker { place, pid, exit: None, pumps, stderr_tail, stacks_file, activity: Activity::default(), watch })
    }

    /// The worker's process: the standby given its environment, or a cold start (bound to its
    /// CPUs, in the job's cgroup).
    fn process(
        &self,
        place: &WorkerPlace,
        args: &[String],
        env: &std::collections::BTreeMap<String, String>,
        standby: Option<Standby>,
    ) -> Result<Supervised> {
        let (config, local_rank) = (self.launch.config, place.local_rank);
        let activated = standby.and_then(|standby| {
            let pid = standby.pid();
            // before it runs the worker's program, so that all it starts is in the cgroup too
            if let Some(Err(err)) = self.cgroup.map(|cgroup| cgroup.adopt(pid)) {
                tracing::debug!(
                    "cannot move the standby (pid {pid}) of {} into the workers' cgroup: {err}",
                    place.name(None)
                );
            }
            standby
                .activate(args, env)
                .map_err(|err| {
                    tracing::warn!(
                        "the standby (pid {pid}) of {} is unusable ({err}); starting it cold",
                        place.name(None)
                    )
                })
                .ok()
        });
        if let Some(process) = activated {
            return Ok(process);
        }
        let output = self.launch.outputs[local_rank as usize];
        let mut command = SupervisedCommand::new(&config.entrypoint, args, env, output, self.cgroup.cloned());
        if let Some(cpus) = config.cpu_set(local_rank as usize) {
            command.bind_to(cpus);
        }
        command.spawn().map_err(|err| {
            let bound = config.binding_of(local_rank as usize).map(|b| format!(", {b}")).unwrap_or_default();
            AgentError::Spawn(format!(
                "cannot start {} ({} {:?}{bound}): {err}",
                place.name(None),
                config.entrypoint,
                config.args
            ))
        })
    }

    /// Where one of the worker's streams (`mask`: stdout's or stderr's) goes: its file in the
    /// rank's directory, the console, with its prefix and duplicate filter.
    fn sink(
        &self,
        (rank_dir, place): (Option<&Path>, &WorkerPlace),
        mask: u8,
        name: &str,
        tail: Option<Arc<Mutex<VecDeque<String>>>>,
    ) -> Result<Sink> {
        let (config, local) = (self.launch.config, place.local_rank as usize);
        let file = match rank_dir {
            Some(dir) if config.file_mask(local) & mask != 0 => Some(self.launch.log_writer.create(&dir.join(name))?),
            _ => None,
        };
        let console = if mask == STD_OUT { console::stdout() } else { console::stderr() };
        let shown = config.console_mask(local) & mask != 0;
        let tee = config.tee[local] & mask != 0;
        let template = config.line_prefix.as_deref().or(tee.then_some(DEFAULT_TEE_PREFIX));
        let prefix = template
            .map(|t| expand_prefix(t, &config.role, place.global_rank, place.local_rank, self.launch.host))
            .unwrap_or_default();
        // torchrun duplicates tee'd lines only
        let duplicate = self.duplicates[usize::from(mask == STD_ERR)]
            .as_ref()
            .filter(|_| tee)
            .map(|(filters, file)| Duplicate { filters: filters.clone(), file: file.clone() });
        Ok(Sink { file, console: shown.then_some(console), prefix, tail, duplicate })
    }
}
