//! The `elastix-store` binary as a user runs it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn start(args: &[&str]) -> (Child, String) {
    start_command(Command::new(env!("CARGO_BIN_EXE_elastix-store")).args(args))
}

fn start_command(command: &mut Command) -> (Child, String) {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    (child, line)
}

fn port_of(line: &str) -> u16 {
    assert!(line.starts_with("elastix-store listening on "), "{line:?}");
    line.trim().rsplit(':').next().unwrap().parse().unwrap()
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "elastix-store did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// VALIDATE, PING 7, expecting the echo.
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stream.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 7, 0, 0, 0]).unwrap();
    let mut echo = [0u8; 4];
    stream.read_exact(&mut echo).is_ok() && echo == [7, 0, 0, 0]
}

#[test]
fn serves_on_a_free_port_and_stops_cleanly_on_sigterm() {
    let (mut child, line) = start(&["--port", "0", "--log-level", "warn"]);
    let port = port_of(&line);
    assert_ne!(port, 0);
    assert!(ping(port));
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    assert!(wait_exit(&mut child).success());
    assert!(!ping(port), "the port must be closed after exit");
}

#[test]
fn stops_cleanly_on_sigint_while_a_client_waits() {
    let (mut child, line) = start(&["--port", "0", "--host", "127.0.0.1"]);
    let port = port_of(&line);
    let mut waiter = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // VALIDATE, then WAIT on one missing key "/k"
    waiter.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c]).unwrap();
    let mut wait = vec![6u8];
    wait.extend(1u64.to_le_bytes());
    wait.extend(2u64.to_le_bytes());
    wait.extend(b"/k");
    waiter.write_all(&wait).unwrap();
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    assert!(wait_exit(&mut child).success());
    let mut rest = Vec::new();
    waiter.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(waiter.read_to_end(&mut rest).unwrap_or(0), 0, "the waiter sees EOF");
}

#[test]
fn a_taken_port_is_reported_with_a_failing_exit_code() {
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let output = Command::new(env!("CARGO_BIN_EXE_elastix-store")).args(["--port", &port]).output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&port) && stderr.contains("in use"), "{stderr}");
}

#[test]
fn bad_arguments_are_a_usage_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_elastix-store")).args(["--port", "http"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--port"));
    for (args, needle) in [
        (["--idle-timeout", "0"], "must be positive"),
        (["--idle-timeout", "soon"], "is not a duration"),
        (["--log-level", "loud"], "invalid log level"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_elastix-store")).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn past_max_connections_clients_are_refused_with_one_warning() {
    let (mut child, line) = start(&["--port", "0", "--max-connections", "1", "--log-level", "warn"]);
    let port = port_of(&line);
    let mut served = TcpStream::connect(("127.0.0.1", port)).unwrap();
    served.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    served.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 7, 0, 0, 0]).unwrap();
    let mut echo = [0u8; 4];
    served.read_exact(&mut echo).unwrap();
    for _ in 0..4 {
        assert!(!ping(port), "the second client must be refused");
    }
    served.write_all(&[0x0d, 9, 0, 0, 0]).unwrap();
    served.read_exact(&mut echo).unwrap();
    assert_eq!(echo, [9, 0, 0, 0], "the served client goes on");
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    assert!(wait_exit(&mut child).success());
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert_eq!(stderr.matches("refusing connections: 1 served already").count(), 1, "{stderr}");
    assert!(stderr.contains("1 refused since the last warning, the latest from 127.0.0.1:"), "{stderr}");
}

/// The rest of a stopped server's stderr.
fn stderr_of(mut child: Child) -> String {
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    assert!(wait_exit(&mut child).success());
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    stderr
}

#[test]
fn each_io_serves_and_says_which_it_is() {
    for (io, said) in [("uring", "store server listening (io_uring)"), ("epoll", "store server listening local_addr")] {
        let (child, line) = start(&["--port", "0", "--host", "127.0.0.1", "--io", io]);
        assert!(ping(port_of(&line)), "--io {io}");
        let stderr = stderr_of(child);
        assert!(stderr.contains(said), "--io {io}: {stderr}");
    }
    // auto takes io_uring where it can, and says why not where it does not
    let (child, line) = start(&["--port", "0", "--host", "127.0.0.1"]);
    assert!(ping(port_of(&line)));
    assert!(stderr_of(child).contains("(io_uring)"));
    let (child, line) = start(&["--port", "0", "--host", "127.0.0.1", "--threads", "2"]);
    assert!(ping(port_of(&line)));
    assert!(stderr_of(child).contains("serving on epoll: --threads asks for more than one thread"));
}

#[test]
fn io_uring_with_a_job_secret_is_a_usage_error() {
    let dir = std::env::temp_dir().join(format!("elastix-store-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "correct horse battery staple 9431 elastix").unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_elastix-store"))
        .args(["--port", "0", "--io", "uring", "--auth-token-file"])
        .arg(&token)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--io uring: the job secret's handshake runs on epoll"), "{stderr}");
}

/// elastix-store with io_uring_setup refused (EPERM), as a container's seccomp profile does.
fn without_io_uring(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_elastix-store"));
    command.args(args);
    // SAFETY: between fork and exec the closure only calls prctl, which is async-signal-safe,
    // with a filter that lives on this closure's stack until the call returns.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            const IO_URING_SETUP: u32 = 425; // the same number on every architecture
            let filter = [
                libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 }, // load the syscall number
                libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: IO_URING_SETUP }, // is it io_uring_setup?
                libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x0005_0000 | libc::EPERM as u32 }, // EPERM
                libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 }, // allow
            ];
            let program = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &program as *const _, 0, 0) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
}

#[test]
fn where_io_uring_is_forbidden_auto_serves_on_epoll_and_says_why_and_uring_fails() {
    let (child, line) = start_command(&mut without_io_uring(&["--port", "0", "--host", "127.0.0.1"]));
    assert!(ping(port_of(&line)));
    let stderr = stderr_of(child);
    assert!(stderr.contains("serving on epoll: io_uring is not available to this process"), "{stderr}");
    assert!(stderr.contains("Operation not permitted"), "{stderr}");
    let output = without_io_uring(&["--port", "0", "--io", "uring"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("io_uring is not available to this process"), "{stderr}");
}

#[test]
fn a_backlog_larger_than_io_urings_receive_pool_is_all_served() {
    // Stopped, the server lets 64 clients' 256 KiB requests pile up in the kernel; continued,
    // its receives take buffers faster than it gives them back (16 MiB against a 4 MiB pool),
    // find none, and must be rearmed
    use elastix_core::store::request::Request;
    let (mut child, line) = start(&["--port", "0", "--host", "127.0.0.1", "--io", "uring"]);
    let port = port_of(&line);
    let value = vec![7u8; 256 << 10];
    let mut clients: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    let pid = Pid::from_raw(child.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    for (i, client) in clients.iter_mut().enumerate() {
        let mut wire = bytes::BytesMut::new();
        Request::Validate { magic: 0x3C85_F7CE }.encode(&mut wire);
        Request::Set { key: format!("/backlog/{i}").as_bytes(), value: &value }.encode(&mut wire);
        Request::Ping { nonce: i as u32 }.encode(&mut wire);
        client.write_all(&wire).unwrap();
    }
    kill(pid, Signal::SIGCONT).unwrap();
    for (i, client) in clients.iter_mut().enumerate() {
        client.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut echo = [0u8; 4];
        client.read_exact(&mut echo).unwrap_or_else(|err| panic!("client {i}: {err}"));
        assert_eq!(u32::from_le_bytes(echo), i as u32);
    }
    kill(pid, Signal::SIGTERM).unwrap();
    assert!(wait_exit(&mut child).success());
}
