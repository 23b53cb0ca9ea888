//! The control plane's mutual TLS, end to end with the real binaries: a coordinator and a worker
//! started with cluster certificates serve their members, and a process without a cluster
//! certificate (none, a self-made one, or one from another CA) cannot register a worker, submit a
//! request or read results — neither through the coordinator nor directly at the worker — and a
//! member's certificate only does what its role may (a client cannot stop a worker).

use kvfleet_pki::{ClusterCa, IdentityFiles, NodeIdentity, Role, TlsArgs};
use kvfleet_proto::v1;
use kvfleet_proto::v1::coordinator_client::CoordinatorClient;
use kvfleet_proto::v1::worker_client::WorkerClient;
use kvfleet_tests::TempDir;
use std::time::Duration;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

type Proc = kvfleet_tests::Child;

fn identity_args(dir: &std::path::Path, stem: &str) -> Vec<String> {
    TlsArgs::files(&IdentityFiles::in_dir(dir, stem)).to_args()
}

fn member_channel(addr: &str, id: &NodeIdentity) -> Channel {
    kvfleet_pki::endpoint(addr, Some(id)).unwrap().connect_timeout(Duration::from_secs(2)).connect_lazy()
}

/// The ways an outsider can try to talk to the cluster.
fn outsider_channels(addr: &str, ours: &ClusterCa, theirs: &NodeIdentity) -> Vec<(&'static str, Channel)> {
    let lazy = |ep: Endpoint| ep.connect_timeout(Duration::from_secs(2)).connect_lazy();
    let plain = Endpoint::from_shared(format!("http://{addr}")).unwrap();
    // TLS that trusts our CA (an outsider who got hold of ca.pem) but has no client certificate.
    let anonymous = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ours.cert_pem()))
                .domain_name(kvfleet_pki::CLUSTER_SERVER_NAME),
        )
        .unwrap();
    // A certificate from another CA, still trusting our CA (so only the server's check stops it).
    let foreign = NodeIdentity { ca_pem: ours.cert_pem().to_string(), ..theirs.clone() };
    vec![
        ("plain text", lazy(plain)),
        ("TLS without a client certificate", lazy(anonymous)),
        ("a certificate from another CA", member_channel(addr, &foreign)),
    ]
}

fn spec(id: u64) -> v1::RequestSpec {
    v1::RequestSpec {
        id,
        arrival_ns: 0,
        prompt_tokens: 16,
        reasoning_tokens: 4,
        answer_tokens: 4,
        content_ids: Vec::new(),
    }
}

#[test]
fn only_cluster_members_register_submit_or_read() {
    let tmp = TempDir::new("security");
    let pki = tmp.join("pki");
    let ca = ClusterCa::generate("security test").unwrap();
    ca.save(&pki).unwrap();
    for (role, stem) in [(Role::Coordinator, "coordinator"), (Role::Worker, "worker"), (Role::Client, "client")] {
        ca.issue(role, stem, &[]).unwrap().save(&IdentityFiles::in_dir(&pki, stem)).unwrap();
    }
    let member = NodeIdentity::load(&IdentityFiles::in_dir(&pki, "client")).unwrap();
    let outsider = ClusterCa::generate("someone else").unwrap().issue(Role::Worker, "intruder", &[]).unwrap();

    let coordinator = Proc::spawn(
        "kvfleet-coordinator",
        &[&["--worker-ttl-ms".to_string(), "60000".into()][..], &identity_args(&pki, "coordinator")].concat(),
        &tmp.join("coordinator.log"),
        1,
    );
    let coordinator_addr = coordinator.addr("listening on ");
    let worker_args = [
        &[
            "--instance".to_string(),
            "0".into(),
            "--kv-memory".into(),
            "64MiB".into(),
            "--cpu-memory".into(),
            "64MiB".into(),
            "--coordinator".into(),
            coordinator_addr.clone(),
        ][..],
        &identity_args(&pki, "worker"),
    ]
    .concat();
    let worker = Proc::spawn("kvfleet-worker", &worker_args, &tmp.join("worker.log"), 1);
    let worker_addr = worker.addr("listening on ");

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        // Members: the worker registered over mutual TLS, and a member client is served.
        let mut c = CoordinatorClient::new(member_channel(&coordinator_addr, &member));
        let status = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if let Ok(s) = c.status(v1::StatusRequest {}).await {
                    let s = s.into_inner();
                    if s.instances.iter().any(|i| i.alive) {
                        return s;
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the worker registers through the TLS coordinator within 30 s");
        assert_eq!(status.instances.len(), 1);
        let mut stream =
            c.submit(v1::ClientSubmit { spec: Some(spec(1)) }).await.expect("a member submits").into_inner();
        let mut finished = None;
        while let Some(ev) = stream.message().await.expect("a member reads its stream") {
            if let Some(v1::client_event::Event::Finished(r)) = ev.event {
                finished = Some(r);
            }
        }
        assert_eq!(finished.expect("the final record reaches the member").id, 1);

        // Outsiders, at the coordinator: register, submit, resume (read results), status.
        let intruder_worker = v1::WorkerInfo { instance: 7, advertise: "127.0.0.1:1".into(), ..status_info(&status) };
        for (how, ch) in outsider_channels(&coordinator_addr, &ca, &outsider) {
            let mut c = CoordinatorClient::new(ch);
            let e = c.register(intruder_worker.clone()).await.expect_err(how);
            assert_refused(how, "register", &e);
            let e = c.submit(v1::ClientSubmit { spec: Some(spec(2)) }).await.map(|_| ()).expect_err(how);
            assert_refused(how, "submit", &e);
            let e = c.resume(v1::ResumeRequest { request_id: 1 }).await.map(|_| ()).expect_err(how);
            assert_refused(how, "resume", &e);
            let e = c.status(v1::StatusRequest {}).await.expect_err(how);
            assert_refused(how, "status", &e);
        }
        // Outsiders, directly at the worker: submit work, read its event log (results).
        for (how, ch) in outsider_channels(&worker_addr, &ca, &outsider) {
            let mut w = WorkerClient::new(ch);
            let e = w.submit(v1::SubmitRequest { spec: Some(spec(3)), incarnation: 0 }).await.expect_err(how);
            assert_refused(how, "worker submit", &e);
            let e = w.events(v1::EventsRequest { after_seq: 0 }).await.map(|_| ()).expect_err(how);
            assert_refused(how, "worker events", &e);
        }
        // Nothing an outsider tried took effect: one worker, and request 2 unknown.
        let s = c.status(v1::StatusRequest {}).await.expect("member status").into_inner();
        assert_eq!(
            s.instances.iter().filter_map(|i| i.info.as_ref().map(|w| w.instance)).collect::<Vec<_>>(),
            vec![0],
            "no intruder registered"
        );
        let e = c.resume(v1::ResumeRequest { request_id: 2 }).await.map(|_| ()).expect_err("request 2 never existed");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e}");

        // Members in the wrong role are refused by the application, naming what is needed: a
        // client may not stop a worker, drain it or order its migrations; a worker may not submit.
        let mut w = WorkerClient::new(member_channel(&worker_addr, &member));
        let e = w.shutdown(v1::ShutdownRequest {}).await.expect_err("a client may not shut a worker down");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        assert!(
            e.message().contains(
                "Worker/Shutdown needs a coordinator or operator certificate; the caller's is a client certificate"
            ),
            "{e}"
        );
        let e = w.drain(v1::DrainRequest {}).await.expect_err("nor drain it");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        let moving = v1::MigrateOutRequest { request_id: 1, ..Default::default() };
        let e = w.migrate_out(moving).await.expect_err("nor order a migration");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        let e = w
            .submit(v1::SubmitRequest { spec: Some(spec(5)), incarnation: 0 })
            .await
            .expect_err("nor submit past the leader");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        let as_worker = NodeIdentity::load(&IdentityFiles::in_dir(&pki, "worker")).unwrap();
        let mut cw = CoordinatorClient::new(member_channel(&coordinator_addr, &as_worker));
        let e =
            cw.submit(v1::ClientSubmit { spec: Some(spec(4)) }).await.map(|_| ()).expect_err("a worker may not submit");
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        // The worker still serves: the shutdown was refused, not performed.
        let s = c.status(v1::StatusRequest {}).await.expect("member status").into_inner();
        assert!(s.instances.iter().any(|i| i.alive), "the worker is still registered: {s:?}");
        let mut stream =
            c.submit(v1::ClientSubmit { spec: Some(spec(6)) }).await.expect("a client submits").into_inner();
        let mut done = false;
        while let Some(ev) = stream.message().await.expect("stream") {
            done |= matches!(ev.event, Some(v1::client_event::Event::Finished(_)));
        }
        assert!(done, "the worker ran request 6 after the refused shutdown");
    });
    drop(worker);
    drop(coordinator);
}

/// A plausible registration: the real worker's, under another instance id.
fn status_info(s: &v1::ClusterStatus) -> v1::WorkerInfo {
    s.instances.first().and_then(|i| i.info.clone()).unwrap_or_default()
}

/// Refused at the connection (TLS handshake or a plain-text request to a TLS port), never by the
/// application: the status is Unavailable/Unknown/Internal/Cancelled with a transport error, never a reply
/// such as NotFound or FailedPrecondition that would mean the RPC was served.
fn assert_refused(how: &str, what: &str, e: &tonic::Status) {
    assert!(
        matches!(
            e.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled
        ),
        "{how}: {what} was not refused at the connection: {e:?}"
    );
}

#[test]
fn certs_cli_makes_a_ca_and_identities_processes_can_load() {
    let tmp = TempDir::new("certs-cli");
    let ca_dir = tmp.join("ca");
    let out = kvfleet_tests::run_kvfleet(["certs", "init", "--dir", ca_dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", kvfleet_tests::describe(&out));
    // A second init would overwrite the CA key: refused as bad input.
    let again = kvfleet_tests::run_kvfleet(["certs", "init", "--dir", ca_dir.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2), "{}", kvfleet_tests::describe(&again));
    let node_dir = tmp.join("worker-3");
    let out = kvfleet_tests::run_kvfleet([
        "certs",
        "issue",
        "--ca-dir",
        ca_dir.to_str().unwrap(),
        "--role",
        "worker",
        "--name",
        "worker-3",
        "--host",
        "10.0.0.3",
        "--out",
        node_dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", kvfleet_tests::describe(&out));
    let args = TlsArgs { tls_dir: Some(node_dir), ..TlsArgs::default() };
    let id = args.load().expect("the issued identity loads").expect("not plain text");
    assert_eq!(id.ca_pem, std::fs::read_to_string(ca_dir.join("ca.pem")).unwrap());
    let missing = kvfleet_tests::run_kvfleet([
        "certs",
        "issue",
        "--ca-dir",
        "/nonexistent",
        "--role",
        "client",
        "--name",
        "c",
        "--out",
        "x",
    ]);
    assert_eq!(missing.status.code(), Some(2), "{}", kvfleet_tests::describe(&missing));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent"));
}
