//! Helpers for tests that run the real `kvfleet-worker` binary: start it on a free loopback port
//! (`--listen 127.0.0.1:0`, address read back from its first stdout line), connect the generated
//! tonic client, read event streams with deadlines, and kill + reap the process on drop (also when
//! a test panics).

#![allow(dead_code)]

use kvfleet_proto::v1;
use kvfleet_proto::v1::worker_client::WorkerClient;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tonic::transport::Channel;

pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running worker process.
pub struct WorkerProc {
    child: Child,
    pub addr: String,
    pub epoch_unix_ns: u64,
    stderr: Arc<Mutex<String>>,
    /// The test client's cluster identity when the worker runs with mutual TLS.
    client_tls: Option<kvfleet_pki::NodeIdentity>,
    /// stdout lines after the first (`metrics on ADDR`, ...).
    stdout: Mutex<mpsc::Receiver<String>>,
}

/// A cluster CA in a temp dir with certificates for workers and the test client.
pub struct TestPki {
    pub dir: std::path::PathBuf,
    ca: kvfleet_pki::ClusterCa,
}

impl TestPki {
    pub fn new(tag: &str) -> TestPki {
        let dir = std::env::temp_dir().join(format!("kvfleet-worker-pki-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = kvfleet_pki::ClusterCa::generate("worker tests").unwrap();
        ca.save(&dir).unwrap();
        TestPki { dir, ca }
    }

    /// Issue `stem` and return its TLS flags.
    pub fn flags(&self, stem: &str) -> Vec<String> {
        let files = kvfleet_pki::IdentityFiles::in_dir(&self.dir, stem);
        self.ca.issue(kvfleet_pki::Role::Worker, stem, &[]).unwrap().save(&files).unwrap();
        kvfleet_pki::TlsArgs::files(&files).to_args()
    }

    pub fn client(&self) -> kvfleet_pki::NodeIdentity {
        self.ca.issue(kvfleet_pki::Role::Coordinator, "test-coordinator", &[]).unwrap()
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn unix_now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_nanos() as u64
}

impl WorkerProc {
    /// Start `kvfleet-worker` with a small arena plus `extra` flags; waits for `listening on`.
    pub fn start(extra: &[&str]) -> WorkerProc {
        WorkerProc::launch(extra, &["--plaintext".to_string()], None)
    }

    /// Start with mutual TLS (and so a live-migration endpoint) under `pki`'s certificate `stem`.
    pub fn start_tls(extra: &[&str], pki: &TestPki, stem: &str) -> WorkerProc {
        WorkerProc::launch(extra, &pki.flags(stem), Some(pki.client()))
    }

    fn launch(extra: &[&str], tls: &[String], client_tls: Option<kvfleet_pki::NodeIdentity>) -> WorkerProc {
        let epoch_unix_ns = unix_now_ns();
        let epoch = epoch_unix_ns.to_string();
        let mut args = vec!["--listen", "127.0.0.1:0", "--epoch-unix-ns", &epoch];
        // Small arenas unless the test sizes them.
        for (flag, default) in [("--kv-memory", "256MiB"), ("--cpu-memory", "256MiB")] {
            if !extra.contains(&flag) {
                args.extend([flag, default]);
            }
        }
        args.extend_from_slice(extra);
        args.extend(tls.iter().map(String::as_str));
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfleet-worker"))
            .args(&args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kvfleet-worker");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr_pipe = child.stderr.take().expect("piped stderr");
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr_pipe).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let first = rx.recv_timeout(START_TIMEOUT);
        let mut proc =
            WorkerProc { child, addr: String::new(), epoch_unix_ns, stderr, client_tls, stdout: Mutex::new(rx) };
        let first = first.unwrap_or_else(|_| panic!("no `listening on` line; stderr:\n{}", proc.stderr()));
        proc.addr = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first stdout line was {first:?}"))
            .to_string();
        proc
    }

    /// The next stdout line after `listening on`.
    pub fn next_stdout_line(&self) -> String {
        self.stdout
            .lock()
            .unwrap()
            .recv_timeout(START_TIMEOUT)
            .unwrap_or_else(|_| panic!("no more stdout; stderr:\n{}", self.stderr()))
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub async fn client(&self) -> WorkerClient<Channel> {
        let ep = kvfleet_pki::endpoint(&self.addr, self.client_tls.as_ref()).expect("worker endpoint");
        WorkerClient::new(ep.connect().await.expect("connect to the worker")).max_decoding_message_size(64 << 20)
    }

    /// Cluster time now, in ns (the worker was started with this epoch).
    pub fn cluster_now_ns(&self) -> u64 {
        unix_now_ns().saturating_sub(self.epoch_unix_ns)
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Wait for the process to exit (polling with a deadline).
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "worker did not exit within {timeout:?}; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The final `kvfleet-worker: stopped:` line, once the stderr reader has seen it.
    pub fn stopped_line(&self, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self.stderr().lines().find(|l| l.starts_with("kvfleet-worker: stopped:")) {
                return l.to_string();
            }
            assert!(Instant::now() < deadline, "no stopped line; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` from a stopped line.
pub fn field(line: &str, key: &str) -> f64 {
    let prefix = format!("{key}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number in {line}"))
}

pub fn spec(id: u64, arrival_ns: u64, prompt: u32, reasoning: u32, answer: u32) -> v1::RequestSpec {
    v1::RequestSpec {
        id,
        arrival_ns,
        prompt_tokens: prompt,
        reasoning_tokens: reasoning,
        answer_tokens: answer,
        content_ids: Vec::new(),
    }
}

/// Everything a stream delivered, by kind.
#[derive(Default, Debug)]
pub struct Collected {
    pub seqs: Vec<u64>,
    pub tokens: std::collections::BTreeMap<u64, Vec<v1::Tokens>>,
    pub boundaries: std::collections::BTreeMap<u64, v1::PhaseBoundary>,
    pub finished: std::collections::BTreeMap<u64, v1::RequestRecord>,
    pub loads: Vec<v1::LoadReport>,
    pub prefill_done: Vec<v1::PrefillDone>,
    pub prefill_started: Vec<v1::PrefillStarted>,
    pub kv_events: Vec<kvfleet_core::kv::KvEvent>,
}

impl Collected {
    pub fn add(&mut self, ev: v1::WorkerEvent) {
        use v1::worker_event::Event;
        self.seqs.push(ev.seq);
        match ev.event.expect("every event has a body") {
            Event::Tokens(t) => self.tokens.entry(t.request_id).or_default().push(t),
            Event::Boundary(b) => {
                self.boundaries.insert(b.request_id, b);
            }
            Event::Finished(r) => {
                self.finished.insert(r.id, r);
            }
            Event::Load(l) => self.loads.push(l),
            Event::PrefillDone(p) => self.prefill_done.push(p),
            Event::PrefillStarted(p) => self.prefill_started.push(p),
            Event::KvEvents(k) => self.kv_events.extend(kvfleet_proto::kv_events_from_proto(&k)),
        }
    }
}

/// Read `client`'s event stream from `after_seq` until `done` holds (deadline: `timeout`).
pub async fn collect_until(
    client: &mut WorkerClient<Channel>,
    after_seq: u64,
    timeout: Duration,
    done: impl Fn(&Collected) -> bool,
) -> Collected {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut stream = client.events(v1::EventsRequest { after_seq }).await.expect("Events").into_inner();
    let mut got = Collected::default();
    while !done(&got) {
        match tokio::time::timeout_at(deadline, stream.message()).await {
            Ok(Ok(Some(ev))) => got.add(ev),
            Ok(Ok(None)) => panic!("event stream ended early: {got:?}"),
            Ok(Err(e)) => panic!("event stream failed: {e}"),
            Err(_) => panic!("timed out after {timeout:?} waiting for events: {got:?}"),
        }
    }
    got
}
