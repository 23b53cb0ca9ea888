//! Helpers for cross-process tests: locate the built binaries, make temp dirs.
//!
//! The integration tests under `tests/tests/` run the real `kvfleet` executable the way a user
//! does (exit code 0 on success, 1 on a runtime failure, 2 on invalid input, as `cli/src/main.rs`
//! promises), so they exercise argument parsing, config loading and the files written to disk —
//! the parts that in-process unit tests cannot reach. The binary is the one
//! `cargo build --workspace --all-targets` puts next to the test executables; these helpers find
//! it, give each test a private scratch directory, and read outputs back for comparison.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

/// The `kvfleet` binary of the build that produced this test executable.
///
/// Test executables live in `<target>/<profile>/deps/`; the binary is `<target>/<profile>/kvfleet`.
/// Panics (with what to run) when it is missing.
pub fn kvfleet_bin() -> PathBuf {
    workspace_bin("kvfleet")
}

/// A binary of this workspace (`kvfleet`, `kvfleet-coordinator`, `kvfleet-worker`) from the
/// build that produced this test executable. Panics (with what to run) when it is missing.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable knows its own path");
    let deps = exe.parent().expect("the test executable lives in a directory");
    // `<target>/<profile>/deps/test-exe`; tolerate an executable placed directly in `<profile>/`.
    let profile_dir = if deps.file_name().is_some_and(|n| n == "deps") { deps.parent().unwrap_or(deps) } else { deps };
    let bin = profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{name} binary not found at {}: run `cargo build --workspace --all-targets` first \
         (with the same CARGO_TARGET_DIR and profile as the tests)",
        bin.display()
    );
    bin
}

/// A workspace binary running as a child process, killed and reaped on drop (also when a test
/// panics). Its first stdout lines (`listening on ADDR`, `http on ADDR`, ...) are read at start;
/// stderr goes to a log file named in failures.
pub struct Child {
    child: std::process::Child,
    /// The first stdout lines, trimmed.
    pub lines: Vec<String>,
}

impl Child {
    /// Start `bin args…` (a [`workspace_bin`]) and read `lines` stdout lines.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(bin: &str, args: &[S], log: &Path, lines: usize) -> Child {
        use std::io::{BufRead, BufReader};
        let mut child = Command::new(workspace_bin(bin))
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(log).expect("log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut got = Vec::new();
        for _ in 0..lines {
            let mut line = String::new();
            let _ = stdout.read_line(&mut line);
            got.push(line.trim().to_string());
        }
        let proc = Child { child, lines: got };
        if proc.lines.iter().any(String::is_empty) {
            panic!(
                "{bin} did not start: printed {:?}; log:\n{}",
                proc.lines,
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        proc
    }

    /// The address of the first stdout line starting with `prefix` (e.g. `"listening on "`).
    pub fn addr(&self, prefix: &str) -> String {
        self.lines
            .iter()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in {:?}", self.lines))
            .to_string()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `tests/fixtures/<name>`: a config checked in for these tests.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// Runs `kvfleet` with `args` (working directory: this crate's root) and returns what it did.
pub fn run_kvfleet<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let bin = kvfleet_bin();
    Command::new(&bin)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()))
}

/// stdout and stderr of a finished command, for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every regular file directly inside `dir`, by name, with its bytes (sorted by name).
pub fn read_dir_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
    let mut files = BTreeMap::new();
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
        let path = entry.path();
        if path.is_file() {
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            files.insert(entry.file_name().to_string_lossy().into_owned(), bytes);
        }
    }
    files
}

/// A fresh, empty directory under [`std::env::temp_dir`], removed with its contents on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new directory whose name contains `tag`, the process id and a per-process counter, so
    /// concurrent tests (threads or processes) never share one.
    pub fn new(tag: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kvfleet-tests-{tag}-{}-{n}", std::process::id()));
        // A leftover from a crashed run with a recycled pid: start clean.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `self/<name>` (not created).
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Writes `text` to `self/<name>` and returns its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.join(name);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The `requests-*.csv` a `kvfleet sim`/`kvfleet up` run wrote into `dir` (panics if absent).
pub fn requests_csv(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.starts_with("requests-")))
        .unwrap_or_else(|| panic!("no requests-*.csv in {}", dir.display()))
}

/// Whether an `etcd` binary is on `PATH` (tests that need one skip, saying so, without it).
pub fn etcd_installed() -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("etcd").is_file()))
}

/// Whether process `pid` is still running (a zombie, exited but not reaped, counts as gone).
pub fn process_alive(pid: &str) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

/// A running `kvfleet serve` (on a free loopback port, with its output under `out`), up once it
/// printed "Ctrl-C to stop". Dropped, it gets SIGINT (then SIGKILL after 30 s), so its children
/// are stopped even when a test fails.
pub struct Serve {
    child: Option<std::process::Child>,
    /// Where its OpenAI API listens (`127.0.0.1:PORT`).
    pub listen: String,
    /// What it printed up to "Ctrl-C to stop".
    pub said: Vec<String>,
    stderr: PathBuf,
}

impl Serve {
    /// `kvfleet serve --listen <free port> --out out <args…>`, with `env_remove` variables
    /// removed from its environment; waits up to 90 s for it to come up.
    pub fn start(out: &Path, args: &[&str], env_remove: &[&str]) -> Serve {
        use std::io::{BufRead, BufReader};
        let listen = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        std::fs::create_dir_all(out).unwrap();
        let stderr = out.with_extension("serve-stderr.log");
        let mut command = Command::new(kvfleet_bin());
        command.args(["serve", "--listen", &listen, "--out", out.to_str().expect("utf-8 path")]).args(args);
        for var in env_remove {
            command.env_remove(var);
        }
        let mut child = command
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr log"))
            .spawn()
            .expect("start kvfleet serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut serve = Serve { child: Some(child), listen, said: Vec::new(), stderr };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
        while !serve.said.iter().any(|l| l.contains("Ctrl-C to stop")) {
            match rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
                Ok(l) => serve.said.push(l),
                Err(_) => panic!(
                    "kvfleet serve did not come up within 90 s; it said:\n{}\nstderr:\n{}",
                    serve.said.join("\n"),
                    std::fs::read_to_string(&serve.stderr).unwrap_or_default()
                ),
            }
        }
        serve
    }

    /// The first printed line starting (after indentation) with `prefix`.
    pub fn line(&self, prefix: &str) -> &str {
        self.said
            .iter()
            .find(|l| l.trim_start().starts_with(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{}", self.said.join("\n")))
    }

    /// Ctrl-C (SIGINT) and wait up to 60 s: its exit status and everything it wrote to stderr.
    pub fn stop(mut self) -> (std::process::ExitStatus, String) {
        let mut child = self.child.take().expect("running");
        Command::new("kill").arg("-INT").arg(child.id().to_string()).status().expect("kill -INT");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait") {
                break s;
            }
            assert!(std::time::Instant::now() < deadline, "kvfleet serve did not stop within 60 s of SIGINT");
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        (status, std::fs::read_to_string(&self.stderr).unwrap_or_default())
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let Some(child) = self.child.as_mut() else { return };
        let _ = Command::new("kill").arg("-INT").arg(child.id().to_string()).status();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_dirs_are_distinct_and_removed_on_drop() {
        let a = TempDir::new("unit");
        let b = TempDir::new("unit");
        assert_ne!(a.path(), b.path());
        assert!(a.path().is_dir() && b.path().is_dir());
        let file = a.write("x.txt", "hello");
        std::fs::create_dir(a.join("sub")).unwrap();
        a.write("sub/y.txt", "nested");
        assert_eq!(
            read_dir_files(a.path()).into_iter().collect::<Vec<_>>(),
            vec![("x.txt".to_string(), b"hello".to_vec())]
        );
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists() && !file.exists());
        assert!(b.path().is_dir());
    }

    #[test]
    fn fixtures_dir_is_this_crates() {
        assert!(fixture("small-sweep.toml").is_file());
        assert!(fixture("azure-code-trace.toml").is_file());
    }
}
