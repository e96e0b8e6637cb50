//! The `elastix-store` binary as a user runs it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn start(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_elastix-store"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
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
