//! QUIC vs raw TCP goodput between two processes on this host (what `kvfleet bench migration`
//! measures; this example exercises the same library functions).
//!
//! ```sh
//! cargo run --release -p kvfleet-transport --example goodput -- --bytes 2GiB --streams 1,4,8
//! cargo run --release -p kvfleet-transport --example goodput -- --cc bbr --mtu 9000 --no-gso
//! ```
//!
//! The parent makes a throwaway cluster CA, starts itself as the sink process (`--sink tcp|quic`),
//! sends to it and prints one row per configuration with the QUIC ÷ TCP ratio. Tuning flags
//! (`--cc`, `--mtu`, `--no-gso`, `--no-fairness`, `--stream-window`, `--conn-window`, `--udp-buffer`, `--shared-runtime`) apply to
//! both ends; `GOODPUT_THREADS=1` runs each process on a current-thread tokio runtime (default 2
//! worker threads).

use kvfleet_pki::{ClusterCa, IdentityFiles, NodeIdentity, Role};
use kvfleet_transport::bench::{self, Goodput, SinkKind, DEFAULT_CHUNK_BYTES};
use kvfleet_transport::{CongestionControl, QuicTuning};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

struct Args {
    bytes: u64,
    streams: Vec<usize>,
    chunk: usize,
    tuning: QuicTuning,
    tuning_args: Vec<String>,
    sink: Option<SinkKind>,
    tls_dir: Option<PathBuf>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mult) = match s {
        _ if s.ends_with("GiB") => (&s[..s.len() - 3], 1u64 << 30),
        _ if s.ends_with("MiB") => (&s[..s.len() - 3], 1 << 20),
        _ if s.ends_with("KiB") => (&s[..s.len() - 3], 1 << 10),
        _ => (s, 1),
    };
    num.parse::<u64>().map(|n| n * mult).map_err(|e| format!("bad size {s:?}: {e}"))
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        bytes: 1 << 30,
        streams: vec![1, 4, 8],
        chunk: DEFAULT_CHUNK_BYTES,
        tuning: QuicTuning::default(),
        tuning_args: Vec::new(),
        sink: None,
        tls_dir: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--bytes" => a.bytes = parse_size(&value()?)?,
            "--chunk" => a.chunk = parse_size(&value()?)? as usize,
            "--streams" => {
                a.streams = value()?
                    .split(',')
                    .map(|s| s.parse().map_err(|e| format!("--streams: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--sink" => {
                a.sink = Some(match value()?.as_str() {
                    "tcp" => SinkKind::Tcp,
                    "quic" => SinkKind::Quic,
                    other => return Err(format!("--sink tcp|quic, not {other}")),
                })
            }
            "--tls-dir" => a.tls_dir = Some(PathBuf::from(value()?)),
            "--cc" => {
                let v = value()?;
                a.tuning.congestion = match v.as_str() {
                    "cubic" => CongestionControl::Cubic,
                    "bbr" => CongestionControl::Bbr,
                    "newreno" => CongestionControl::NewReno,
                    other => return Err(format!("--cc cubic|bbr|newreno, not {other}")),
                };
                a.tuning_args.extend(["--cc".into(), v]);
            }
            "--mtu" => {
                let v = value()?;
                a.tuning.mtu_upper_bound = v.parse().map_err(|e| format!("--mtu: {e}"))?;
                a.tuning_args.extend(["--mtu".into(), v]);
            }
            "--stream-window" => {
                let v = value()?;
                a.tuning.stream_receive_window_bytes = parse_size(&v)?;
                a.tuning_args.extend(["--stream-window".into(), v]);
            }
            "--conn-window" => {
                let v = value()?;
                a.tuning.receive_window_bytes = parse_size(&v)?;
                a.tuning_args.extend(["--conn-window".into(), v]);
            }
            "--shared-runtime" => {
                a.tuning.dedicated_thread = false;
                a.tuning_args.push(flag);
            }
            "--no-gso" => {
                a.tuning.segmentation_offload = false;
                a.tuning_args.push(flag);
            }
            "--no-fairness" => {
                a.tuning.send_fairness = false;
                a.tuning_args.push(flag);
            }
            "--udp-buffer" => {
                let v = value()?;
                a.tuning.socket_buffer_bytes = parse_size(&v)? as usize;
                a.tuning_args.extend(["--udp-buffer".into(), v]);
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

/// Start this program as a sink process; returns it and its address.
fn spawn_sink(kind: &str, dir: &std::path::Path, tuning_args: &[String]) -> Result<(Child, SocketAddr), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["--sink", kind, "--tls-dir"])
        .arg(dir)
        .args(tuning_args)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the sink: {e}"))?;
    let stdout = child.stdout.take().ok_or("no sink stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).map_err(|e| e.to_string())?;
    let addr = line.trim().strip_prefix("LISTENING ").ok_or(format!("sink said {line:?}"))?;
    Ok((child, addr.parse().map_err(|e| format!("sink address {addr:?}: {e}"))?))
}

fn row(what: &str, streams: usize, g: &Goodput, tcp: Option<f64>) {
    let ratio = tcp.map(|t| format!("{:.2}", g.gbit_per_s() / t)).unwrap_or_default();
    println!("{what:<6} {streams:>7} {:>10.2} {:>9.3} {ratio:>10}", g.gbit_per_s(), g.elapsed_s);
}

fn main() -> Result<(), String> {
    let threads: usize = std::env::var("GOODPUT_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let rt = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build()
    }
    .map_err(|e| format!("tokio runtime: {e}"))?;
    rt.block_on(run())
}

async fn run() -> Result<(), String> {
    let args = parse()?;
    if let Some(kind) = args.sink {
        let dir = args.tls_dir.ok_or("--sink needs --tls-dir")?;
        let identity =
            NodeIdentity::load(&IdentityFiles::in_dir(&dir, "sink")).map_err(|e| format!("sink identity: {e}"))?;
        let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
        return bench::serve_sink(kind, listen, Some(&identity), args.tuning, |addr| println!("LISTENING {addr}"))
            .await
            .map_err(|e| e.to_string());
    }

    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let ca = ClusterCa::generate("goodput").map_err(|e| e.to_string())?;
    let sink_id = ca.issue(Role::Worker, "sink", &[]).map_err(|e| e.to_string())?;
    sink_id.save(&IdentityFiles::in_dir(dir.path(), "sink")).map_err(|e| e.to_string())?;
    let sender_id = ca.issue(Role::Worker, "sender", &[]).map_err(|e| e.to_string())?;

    println!("{} MiB per run, QUIC frames of {} KiB, tuning {:?}", args.bytes >> 20, args.chunk >> 10, args.tuning);
    println!("{:<6} {:>7} {:>10} {:>9} {:>10}", "proto", "streams", "Gbit/s", "seconds", "QUIC/TCP");
    let (mut tcp_child, tcp_addr) = spawn_sink("tcp", dir.path(), &[])?;
    let (mut quic_child, quic_addr) = spawn_sink("quic", dir.path(), &args.tuning_args)?;
    for &streams in &args.streams {
        let tcp = bench::tcp_send(tcp_addr, args.bytes, streams).await.map_err(|e| e.to_string())?;
        row("tcp", streams, &tcp, None);
        let quic =
            bench::quic_send_measured(quic_addr, &sender_id, args.tuning.clone(), args.bytes, streams, args.chunk)
                .await
                .map_err(|e| e.to_string())?;
        row("quic", streams, &quic.goodput, Some(tcp.gbit_per_s()));
        println!("       {} of {} packets lost", quic.lost_packets, quic.sent_packets);
    }
    let _ = tcp_child.kill();
    let _ = quic_child.kill();
    let _ = tcp_child.wait();
    let _ = quic_child.wait();
    Ok(())
}
