//! The coordinator's OpenAI-compatible HTTP API, end to end: a real coordinator (embedded store,
//! `--http-listen`) and a real worker; the official `openai` Python client streams and
//! non-streams against it, and raw HTTP checks the wire format and the error objects, token
//! limits (`max_completion_tokens` bounds reasoning + answer), and the optional API key
//! (`--api-key`: 401 with OpenAI's error bodies on `/v1/*`).

use kvfleet_tests::TempDir;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A child process killed (and reaped) on drop, with the addresses it printed.
type Proc = kvfleet_tests::Child;

/// A coordinator serving HTTP and one worker registered with it.
struct Cluster {
    _worker: Proc,
    _coordinator: Proc,
    http: String,
    grpc: String,
    _tmp: TempDir,
}

impl Cluster {
    fn start(tag: &str) -> Cluster {
        Cluster::start_with(tag, &[])
    }

    /// A cluster whose coordinator also gets `coordinator_args` (e.g. `--api-key KEY`).
    fn start_with(tag: &str, coordinator_args: &[&str]) -> Cluster {
        let tmp = TempDir::new(tag);
        let mut args = vec!["--plaintext", "--http-listen", "127.0.0.1:0", "--worker-ttl-ms", "60000"];
        args.extend_from_slice(coordinator_args);
        let coordinator = Proc::spawn("kvfleet-coordinator", &args, &tmp.join("coordinator.log"), 2);
        assert!(coordinator.lines[0].starts_with("listening on "), "{:?}", coordinator.lines);
        let grpc = coordinator.addr("listening on ");
        let http = coordinator.addr("http on ");
        let worker = Proc::spawn(
            "kvfleet-worker",
            &[
                "--plaintext",
                "--instance",
                "0",
                "--coordinator",
                &grpc,
                "--kv-memory",
                "64MiB",
                "--cpu-memory",
                "64MiB",
            ],
            &tmp.join("worker.log"),
            1,
        );
        // The worker registers through the leader: poll /health until the leader sees it.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((200, body)) = try_http(&http, "GET", "/health", None) {
                let h: Value = serde_json::from_str(&body).expect("/health is JSON");
                if h["leader"] == true && h["workers"].as_u64().unwrap_or(0) >= 1 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the worker did not register within 30 s; coordinator log:\n{}",
                std::fs::read_to_string(tmp.join("coordinator.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Cluster { _worker: worker, _coordinator: coordinator, http, grpc, _tmp: tmp }
    }
}

/// One HTTP/1.1 request on a fresh connection: (status, body), chunked bodies decoded.
fn try_http(addr: &str, method: &str, path: &str, body: Option<&[u8]>) -> std::io::Result<(u16, String)> {
    try_http_with(addr, method, path, "", body)
}

/// [`try_http`] with extra header lines (`headers`: each ending in `\r\n`).
fn try_http_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: Option<&[u8]>,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    Ok((status, if chunked { dechunk(body) } else { body.to_string() }))
}

fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    try_http(addr, method, path, body.map(str::as_bytes)).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// [`http`] with `Authorization: {auth}` when `auth` is given.
fn http_auth(addr: &str, method: &str, path: &str, auth: Option<&str>, body: Option<&str>) -> (u16, String) {
    let headers = auth.map(|a| format!("Authorization: {a}\r\n")).unwrap_or_default();
    try_http_with(addr, method, path, &headers, body.map(str::as_bytes))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Decode an HTTP/1.1 chunked body.
fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or_else(|_| panic!("bad chunk size {size:?}"));
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").expect("CRLF after a chunk");
    }
    out
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The `openai` package, or why not.
fn python_openai() -> Result<(), String> {
    match Command::new("python3").args(["-c", "import openai"]).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => Err(format!("python3: {e}")),
    }
}

/// Run `openai_client.py` against `cluster` (plus `extra` arguments); its stdout.
fn run_python_client(cluster: &Cluster, extra: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(["--base-url", &format!("http://{}/v1", cluster.http), "--reasoning", "12", "--answer", "8"])
        .args(extra)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_client.py failed:\n--- stdout\n{stdout}--- stderr\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    stdout
}

#[test]
fn the_official_openai_client_streams_emulated_token_counts() {
    if let Err(why) = python_openai() {
        println!("SKIPPED: the official `openai` Python package is not importable ({why}); `pip install openai`");
        return;
    }
    let cluster = Cluster::start("openai-python");
    println!("{}", run_python_client(&cluster, &[]));
}

#[test]
fn the_official_openai_client_authenticates_with_the_api_key() {
    if let Err(why) = python_openai() {
        println!("SKIPPED: the official `openai` Python package is not importable ({why}); `pip install openai`");
        return;
    }
    let key = "sk-kvfleet-python-0123456789";
    let cluster = Cluster::start_with("openai-python-key", &["--api-key", key]);
    let stdout = run_python_client(&cluster, &["--api-key", key]);
    assert!(stdout.contains("ok authentication"), "{stdout}");
    println!("{stdout}");
}

#[test]
fn openai_api_key_guards_v1_routes_with_openai_error_bodies_and_limits_count_reasoning() {
    let key = "kvfleet-test-key-0123456789";
    let cluster = Cluster::start_with("openai-key", &["--api-key", key]);
    let addr = &cluster.http;
    let bearer = format!("Bearer {key}");
    let right = Some(bearer.as_str());
    let chat = |extra: &str| {
        format!(r#"{{"model":"r1-distill-qwen-32b","messages":[{{"role":"user","content":"x"}}]{extra}}}"#)
    };

    // A wrong key: 401 with OpenAI's body, the key mostly masked (4 of 27 characters shown).
    let wrong = "kvfleet-test-key-0123456780";
    let (status, body) =
        http_auth(addr, "POST", "/v1/chat/completions", Some(&format!("Bearer {wrong}")), Some(&chat("")));
    assert_eq!(status, 401, "{body}");
    let masked = format!("kvfl{}6780", "*".repeat(19));
    let want = format!(
        r#"{{"error":{{"message":"Incorrect API key provided: {masked}. You can find your API key at https://platform.openai.com/account/api-keys.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}}}"#
    );
    assert_eq!(body, want, "byte for byte OpenAI's body");
    // No key (no header, or another scheme): OpenAI's "You didn't provide an API key", code null.
    let missing = String::from(
        r#"{"error":{"message":"You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password field (with blank username) if you're accessing the API from your browser and are prompted for a username. You can obtain an API key from https://platform.openai.com/account/api-keys.","type":"invalid_request_error","param":null,"code":null}}"#,
    );
    for (method, path, auth, body) in [
        ("POST", "/v1/chat/completions", None, Some(chat(""))),
        ("GET", "/v1/models", None, None),
        ("POST", "/v1/completions", Some(format!("Basic {key}")), Some("{}".to_string())),
        ("GET", "/v1/no-such-route", None, None),
    ] {
        let (status, reply) = http_auth(addr, method, path, auth.as_deref(), body.as_deref());
        assert_eq!(status, 401, "{method} {path} {auth:?}: {reply}");
        assert_eq!(reply, missing, "{method} {path} {auth:?}");
    }
    // /health and /metrics stay open.
    assert_eq!(http(addr, "GET", "/health", None).0, 200);
    assert_eq!(http(addr, "GET", "/metrics", None).0, 200);

    // The right key: served.
    let (status, body) = http_auth(addr, "GET", "/v1/models", right, None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["data"][0]["id"], "r1-distill-qwen-32b");

    // max_completion_tokens bounds reasoning + answer: 5 + 3 asked, limit 6 → 5 + 1, "length".
    let req = chat(r#","kvfleet_reasoning_tokens":5,"kvfleet_answer_tokens":3,"max_completion_tokens":6"#);
    let (status, body) = http_auth(addr, "POST", "/v1/chat/completions", right, Some(&req));
    assert_eq!(status, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["usage"]["completion_tokens"], 6, "{body}");
    assert_eq!(v["usage"]["completion_tokens_details"]["reasoning_tokens"], 5, "{body}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(v["choices"][0]["message"]["content"].as_str().map(|t| t.split_whitespace().count()), Some(1));
    // Streamed, the limit inside reasoning (legacy max_tokens): 3 tokens, the last one an answer.
    let req = chat(
        r#","stream":true,"stream_options":{"include_usage":true},"kvfleet_reasoning_tokens":5,"kvfleet_answer_tokens":3,"max_tokens":3"#,
    );
    let (status, body) = http_auth(addr, "POST", "/v1/chat/completions", right, Some(&req));
    assert_eq!(status, 200, "{body}");
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| json(e)).collect();
    let field = |c: &Value, f: &str| c["choices"][0]["delta"].get(f).is_some();
    let kinds: String = chunks
        .iter()
        .filter(|c| field(c, "reasoning_content") || field(c, "content"))
        .map(|c| if field(c, "reasoning_content") { 'r' } else { 'a' })
        .collect();
    assert_eq!(kinds, "rra", "{body}");
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(chunks[chunks.len() - 1]["usage"]["completion_tokens"], 3, "{body}");
    // Within the limit: untouched, "stop".
    let req = r#"{"model":"r1-distill-qwen-32b","prompt":"a","kvfleet_reasoning_tokens":2,"kvfleet_answer_tokens":4,"max_tokens":6}"#;
    let (status, body) = http_auth(addr, "POST", "/v1/completions", right, Some(req));
    assert_eq!(status, 200, "{body}");
    let v = json(&body);
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(6), Some("stop"))
    );
}

#[test]
fn openai_raw_http_streams_sse_chunks_and_rejects_bad_input() {
    let cluster = Cluster::start("openai-raw");
    let addr = &cluster.http;
    // No API key configured: /v1 answers without an Authorization header, and with any.
    let (status, body) = http(addr, "GET", "/v1/models", None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(http_auth(addr, "GET", "/v1/models", Some("Bearer anything"), None).0, 200);
    let model = json(&body)["data"][0]["id"].as_str().expect("a model id").to_string();
    assert_eq!(model, "r1-distill-qwen-32b");

    // Streaming chat over raw SSE: one chunk per token, reasoning first, then usage and [DONE].
    let req = format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"stream":true,
            "stream_options":{{"include_usage":true}},"kvfleet_reasoning_tokens":5,"kvfleet_answer_tokens":3}}"#
    );
    let (status, body) = http(addr, "POST", "/v1/chat/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let events: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| json(e)).collect();
    let field = |c: &Value, f: &str| c["choices"][0]["delta"].get(f).is_some();
    let kinds: String = chunks
        .iter()
        .filter(|c| field(c, "reasoning_content") || field(c, "content"))
        .map(|c| if field(c, "reasoning_content") { 'r' } else { 'a' })
        .collect();
    assert_eq!(kinds, "rrrrraaa", "token chunks in order: {body}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop", "{body}");
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(usage["completion_tokens"], 8, "{body}");
    assert_eq!(usage["completion_tokens_details"]["reasoning_tokens"], 5, "{body}");

    // Non-streaming completion: answer tokens only in `text`, the emulation's measurements attached.
    let req =
        format!(r#"{{"model":"{model}","prompt":"a b c","kvfleet_reasoning_tokens":2,"kvfleet_answer_tokens":4}}"#);
    let (status, body) = http(addr, "POST", "/v1/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"].as_str().map(|t| t.split_whitespace().count()), Some(4), "{body}");
    assert_eq!(v["usage"]["prompt_tokens"], 4, "3 words × 1.3, rounded up");
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert!(v["kvfleet"]["ttft_s"].as_f64().is_some_and(|t| t > 0.0), "{body}");
    assert!(v["kvfleet"]["request_id"].as_u64().is_some_and(|id| id & (1 << 62) != 0), "{body}");

    // Bad input: OpenAI-style error objects naming the field, with the right status.
    let chat = |extra: &str| format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", "{\"model\": ".to_string(), 400, None),
        ("/v1/chat/completions", format!(r#"{{"model":"{model}"}}"#), 400, Some("messages")),
        ("/v1/completions", format!(r#"{{"model":"{model}","prompt":"x","max_tokens":-1}}"#), 400, Some("max_tokens")),
        ("/v1/chat/completions", chat(r#","kvfleet_answer_tokens":0"#), 400, Some("kvfleet_answer_tokens")),
        (
            "/v1/chat/completions",
            chat(r#","kvfleet_reasoning_tokens":99999999999"#),
            400,
            Some("kvfleet_reasoning_tokens"),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"x"}]}"#.into(),
            404,
            Some("model"),
        ),
        ("/v1/nope", "{}".into(), 404, None),
    ];
    for (path, body, want, param) in cases {
        let (status, reply) = http(addr, "POST", path, Some(&body));
        assert_eq!(status, want, "{path} {body}: {reply}");
        let e = json(&reply);
        assert!(e["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{reply}");
        assert!(e["error"]["type"].is_string(), "{reply}");
        assert_eq!(e["error"]["param"].as_str(), param, "{path} {body}: {reply}");
    }
    let (status, reply) = oversized(addr, 5 << 20);
    assert_eq!(status, 413, "{reply}");
    assert_eq!(json(&reply)["error"]["code"], "request_too_large", "{reply}");
    let (status, body) = http(addr, "GET", "/health", None);
    assert_eq!((status, json(&body)["leader"].clone()), (200, Value::Bool(true)), "{body}");

    // Prometheus metrics on the same port: the leader, its worker, the two finished requests.
    let (status, body) = http(addr, "GET", "/metrics", None);
    assert_eq!(status, 200, "{body}");
    let sample = |name: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{body}"))
    };
    assert_eq!(sample("kvfleet_leader"), 1.0);
    assert_eq!(sample("kvfleet_workers_alive"), 1.0);
    assert_eq!(sample("kvfleet_requests_finished_total"), 2.0, "the streamed chat and the completion");
    assert_eq!(sample("kvfleet_requests_in_flight"), 0.0);
    assert!(body.contains("# TYPE kvfleet_migration_downtime_seconds histogram"), "{body}");

    // `kvfleet status`: one screen naming the leader and the registered instance.
    let out = kvfleet_tests::run_kvfleet(["status", "--coordinator", &cluster.grpc, "--plaintext"]);
    assert!(out.status.success(), "{}", kvfleet_tests::describe(&out));
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(screen.contains(&format!("leader {}", cluster.grpc)), "{screen}");
    assert!(screen.contains("requests: 0 in flight, 2 finished"), "{screen}");
    let row = screen.lines().find(|l| l.trim_start().starts_with("0 ")).unwrap_or_else(|| panic!("{screen}"));
    assert!(row.contains("yes") && row.contains("ok"), "{row}");
}

/// POST a body of `len` bytes from a second thread while reading the reply (the server answers
/// 413 before it has read everything).
/// `kvfleet status` of the cluster, as text.
fn status(cluster: &Cluster) -> String {
    let out = kvfleet_tests::run_kvfleet(["status", "--coordinator", &cluster.grpc, "--plaintext"]);
    assert!(out.status.success(), "{}", kvfleet_tests::describe(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `kvfleet status` until it contains `want` (30 s at most).
fn await_status(cluster: &Cluster, want: &str) -> String {
    await_status_where(cluster, want, |s| s.contains(want))
}

/// Polls `kvfleet status` until `done` holds (30 s at most); `want` describes it.
fn await_status_where(cluster: &Cluster, want: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(cluster);
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "`kvfleet status` never showed `{want}`:\n{s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A client that goes away cancels its request: streaming (the connection closes after a few
/// chunks) or not (the connection closes while it waits). The worker stops it and frees its KV,
/// the leader no longer counts it in flight, and a request that finished is not cancelled.
#[test]
fn a_client_that_goes_away_cancels_its_request() {
    let cluster = Cluster::start("openai-cancel");
    let addr = &cluster.http;
    // 236 output tokens (the worker's 64 MiB hold 256 tokens of this model) at ~25 ms each:
    // about 6 s, unless cancelled.
    let body = |stream: bool| {
        format!(
            r#"{{"model":"r1-distill-qwen-32b","messages":[{{"role":"user","content":"hi"}}],"stream":{stream},
                "kvfleet_reasoning_tokens":200,"kvfleet_answer_tokens":36}}"#
        )
    };
    let send = |body: &str| {
        let mut conn = TcpStream::connect(addr).expect("connects");
        conn.set_read_timeout(Some(Duration::from_secs(20))).expect("a read timeout");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).and_then(|()| conn.write_all(body.as_bytes())).expect("request sent");
        conn
    };
    // Streaming: read until a few token chunks came, then hang up.
    let mut conn = send(&body(true));
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(6).filter(|w| w == b"data: ").count() < 3 {
        let n = conn.read(&mut buf).expect("reads the stream");
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(status(&cluster).contains("1 in flight"), "{}", status(&cluster));
    // The instance row's GPU blocks (`used/total`): the worker holds the request's KV now.
    // Columns: instance, address, alive, role, GPU blocks, ...
    let gpu_used = |s: &str| -> Vec<u32> {
        s.lines()
            .filter(|l| l.split_whitespace().nth(2) == Some("yes"))
            .filter_map(|l| l.split_whitespace().nth(4)?.split('/').next()?.parse().ok())
            .collect()
    };
    await_status_where(&cluster, "KV in use", |s| gpu_used(s).iter().any(|&b| b > 0));
    drop(conn);
    let s = await_status(&cluster, "1 cancelled");
    assert!(s.contains("0 in flight"), "{s}");
    // The worker stopped it (its log says so: a request left to run would free its KV too, later)
    // and freed its KV (its next load report says so).
    let worker_log = cluster._tmp.join("worker.log");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&worker_log).unwrap_or_default().contains("cancelled: its client left") {
        assert!(Instant::now() < deadline, "the worker never stopped the request: {}", worker_log.display());
        std::thread::sleep(Duration::from_millis(50));
    }
    await_status_where(&cluster, "no KV in use", |s| gpu_used(s) == [0]);
    // Not streaming: the client waits for the whole answer, then gives up.
    let conn = send(&body(false));
    await_status(&cluster, "1 in flight");
    drop(conn);
    let s = await_status(&cluster, "2 cancelled");
    assert!(s.contains("0 in flight") && s.contains("0 finished"), "{s}");
    // One that finishes is delivered and not cancelled.
    let short = r#"{"model":"r1-distill-qwen-32b","messages":[{"role":"user","content":"hi"}],
                    "kvfleet_reasoning_tokens":3,"kvfleet_answer_tokens":3}"#;
    assert_eq!(http(addr, "POST", "/v1/chat/completions", Some(short)).0, 200);
    let s = await_status(&cluster, "1 finished");
    assert!(s.contains("2 cancelled"), "{s}");
}

fn oversized(addr: &str, len: usize) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    );
    let mut w = s.try_clone().expect("clone the socket");
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(head.as_bytes());
        // The server may stop reading once it has refused the body: write errors are expected.
        let _ = w.write_all(&vec![b' '; len]);
    });
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let _ = writer.join();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, body.to_string())
}

/// `kvfleet serve --api-key KEY`: the coordinator gets the key in its environment (not its
/// argv, where `ps` shows it), `/v1` needs it, and the printed `curl` and `clients` lines carry it.
#[test]
fn kvfleet_serve_hands_its_api_key_to_the_coordinator_by_environment() {
    let tmp = TempDir::new("serve-key");
    let out = tmp.join("out");
    let key = "sk-serve-key-0123456789";
    let serve = kvfleet_tests::Serve::start(
        &out,
        &[
            "--workers",
            "1",
            "--kv-memory",
            "64MiB",
            "--cpu-memory",
            "64MiB",
            "--kv-fill",
            "stamp",
            "--no-traces",
            "--no-etcd",
            "--plaintext",
            "--api-key",
            key,
        ],
        &["KVFLEET_API_KEY"],
    );
    let text = serve.said.join("\n");
    assert!(serve.line("try ").contains(&format!("-H 'Authorization: Bearer {key}'")), "{text}");
    assert!(serve.line("clients ").contains(&format!("OPENAI_API_KEY={key} ")), "{text}");
    let listen = serve.listen.clone();

    // The coordinator: the key in its environment, not in its command line.
    let pids = std::fs::read_to_string(out.join("pids.txt")).expect("pids.txt written");
    let pid = pids.lines().find(|l| l.ends_with(" coordinator-0")).and_then(|l| l.split_whitespace().next());
    let pid = pid.unwrap_or_else(|| panic!("no coordinator in pids.txt:\n{pids}"));
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("the coordinator's cmdline");
    assert!(!String::from_utf8_lossy(&cmdline).contains(key), "the key is in the coordinator's argv");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("the coordinator's environment");
    let var = format!("KVFLEET_API_KEY={key}");
    assert!(environ.split(|b| *b == 0).any(|v| v == var.as_bytes()), "KVFLEET_API_KEY not in its environment");

    // And the API needs it.
    assert_eq!(http(&listen, "GET", "/v1/models", None).0, 401);
    assert_eq!(http_auth(&listen, "GET", "/v1/models", Some("Bearer nope-nope"), None).0, 401);
    let (status, body) = http_auth(&listen, "GET", "/v1/models", Some(&format!("Bearer {key}")), None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(http(&listen, "GET", "/health", None).0, 200);
}
