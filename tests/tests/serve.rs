//! `kvfleet serve`: one command starts a local cluster and keeps an OpenAI-compatible endpoint up
//! for real clients; the official `openai` Python client streams against it; Ctrl-C (SIGINT)
//! drains and stops every process it started.

use kvfleet_tests::{Serve, TempDir};
use std::path::Path;
use std::process::Command;

#[test]
fn serve_keeps_an_openai_endpoint_up_until_ctrl_c_and_leaves_no_process() {
    let tmp = TempDir::new("serve");
    let out = tmp.join("out");
    let serve = Serve::start(
        &out,
        &["--workers", "2", "--kv-memory", "256MiB", "--cpu-memory", "256MiB", "--kv-fill", "stamp", "--no-traces"],
        &[],
    );
    // Up: it says where and how, then waits.
    let text = serve.said.join("\n");
    let base = format!("http://{}/v1", serve.listen);
    assert!(text.contains(&format!("endpoint at {base}")), "{text}");
    assert!(
        serve.line("try ").contains("curl ") && text.contains("r1-distill-qwen-32b"),
        "a curl line naming the model:\n{text}"
    );

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
    let (status, err) = serve.stop();
    assert!(status.success(), "kvfleet serve exited with {status}:\n{err}");
    assert!(err.contains("stopped worker-0: exit status: 0"), "workers drained and exited cleanly:\n{err}");
    for line in pids.lines() {
        let pid = line.split_whitespace().next().unwrap();
        assert!(!kvfleet_tests::process_alive(pid), "process left behind: {line}");
    }
}

/// A Ctrl-C the moment `kvfleet serve` says "Ctrl-C to stop" stops it cleanly: it listens for the
/// signal before saying so (it used to die of the signal in that window).
#[test]
fn ctrl_c_right_after_the_prompt_stops_cleanly() {
    for round in 0..3 {
        let tmp = TempDir::new("serve-ctrl-c");
        let serve = Serve::start(
            &tmp.join("out"),
            &["--workers", "1", "--kv-memory", "64MiB", "--cpu-memory", "64MiB", "--kv-fill", "stamp", "--no-traces"],
            &[],
        );
        let (status, err) = serve.stop();
        assert!(status.success(), "round {round}: kvfleet serve exited with {status}:\n{err}");
    }
}
