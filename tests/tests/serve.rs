//! `kvfleet serve`: one command starts a local cluster and keeps an OpenAI-compatible endpoint up
//! for real clients; the official `openai` Python client streams against it; Ctrl-C (SIGINT)
//! drains and stops every process it started.

use kvfleet_tests::{kvfleet_bin, TempDir};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Kills `kvfleet serve` (and so, through its drop guards, its children) if the test fails early.
struct Serve(std::process::Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-INT").arg(self.0.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn alive(pid: &str) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

#[test]
fn serve_keeps_an_openai_endpoint_up_until_ctrl_c_and_leaves_no_process() {
    let tmp = TempDir::new("serve");
    let out = tmp.join("out");
    let listen = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(kvfleet_bin())
        .args(["serve", "--listen", &listen, "--workers", "2", "--kv-memory", "256MiB", "--cpu-memory", "256MiB"])
        .args(["--kv-fill", "stamp", "--no-traces", "--out", out.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvfleet serve");
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut serve = Serve(child);
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let stderr_lines =
        std::thread::spawn(move || BufReader::new(stderr).lines().map_while(Result::ok).collect::<Vec<_>>());
    // Up: it says where and how, then waits.
    let mut said = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !said.iter().any(|l: &String| l.contains("Ctrl-C to stop")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => said.push(l),
            Err(_) => panic!("kvfleet serve did not come up within 90 s; it said:\n{}", said.join("\n")),
        }
    }
    let text = said.join("\n");
    let base = format!("http://{listen}/v1");
    assert!(text.contains(&format!("endpoint at {base}")), "{text}");
    assert!(text.contains("curl ") && text.contains("r1-distill-qwen-32b"), "a curl line naming the model:\n{text}");

    // The official client, streaming and not, against it (skipped where `openai` is missing).
    let python = Command::new("python3").args(["-c", "import openai"]).output();
    if python.is_ok_and(|o| o.status.success()) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("openai_client.py");
        let run = Command::new("python3")
            .arg(&script)
            .args(["--base-url", &base, "--reasoning", "12", "--answer", "8"])
            .output()
            .expect("run python3");
        let (o, e) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
        assert!(run.status.success() && o.contains("all checks passed"), "openai_client.py:\n{o}\n{e}");
    } else {
        println!("SKIPPED the openai client part: `pip install openai`");
    }

    // Ctrl-C: everything drains and stops.
    let pids = std::fs::read_to_string(out.join("pids.txt")).expect("pids.txt written");
    Command::new("kill").arg("-INT").arg(serve.0.id().to_string()).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = serve.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "kvfleet serve did not stop within 60 s of SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = stderr_lines.join().unwrap().join("\n");
    assert!(status.success(), "kvfleet serve exited with {status}:\n{err}");
    assert!(err.contains("stopped worker-0: exit status: 0"), "workers drained and exited cleanly:\n{err}");
    for line in pids.lines() {
        let pid = line.split_whitespace().next().unwrap();
        assert!(!alive(pid), "process left behind: {line}");
    }
}
