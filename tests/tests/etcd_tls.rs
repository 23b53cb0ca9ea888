//! The etcd of `kvfleet up` / `kvfleet serve` runs with client-certificate TLS from the cluster
//! CA: a client without a cluster certificate (plain http, TLS without a certificate, or a
//! certificate from another CA) can neither read nor write the cluster's state; a cluster
//! certificate can. `--plaintext` keeps etcd on plain http.

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use kvfleet_meta::{layout, EtcdOptions, EtcdStore, EtcdTls, MetaStore};
use kvfleet_pki::{ClusterCa, IdentityFiles, Role};
use kvfleet_tests::{etcd_installed, Serve, TempDir};
use std::path::Path;
use std::time::Duration;

/// `kvfleet serve` with one small worker, up.
fn serve(out: &Path, extra: &[&str]) -> Serve {
    let mut args =
        vec!["--workers", "1", "--kv-memory", "64MiB", "--cpu-memory", "64MiB", "--kv-fill", "stamp", "--no-traces"];
    args.extend(extra);
    Serve::start(out, &args, &[])
}

/// The URL of its `etcd        URL (...)` line.
fn etcd_url(serve: &Serve) -> String {
    serve.line("etcd ").strip_prefix("etcd").unwrap_or("").split_whitespace().next().unwrap_or("").to_string()
}

/// Ctrl-C, and it stopped cleanly.
fn stop(serve: Serve) {
    let (status, err) = serve.stop();
    assert!(status.success(), "kvfleet serve exited with {status}:\n{err}");
}

/// A read and a write with a raw etcd client: both must be refused. Returns what each got.
async fn refused(what: &str, endpoint: &str, options: Option<ConnectOptions>) -> String {
    let bound = Duration::from_secs(5);
    let client = match tokio::time::timeout(bound, Client::connect([endpoint], options)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return format!("{what}: connect refused ({e})"),
        Err(_) => return format!("{what}: connect timed out"),
    };
    let mut kv = client.kv_client();
    let read = tokio::time::timeout(bound, kv.get(layout::CLUSTER, None)).await;
    assert!(!matches!(read, Ok(Ok(_))), "{what}: read {} succeeded", layout::CLUSTER);
    let write = tokio::time::timeout(bound, kv.put(layout::worker(99), "fake worker", None)).await;
    assert!(!matches!(write, Ok(Ok(_))), "{what}: write {} succeeded", layout::worker(99));
    format!("{what}: read {read:?}, write {write:?}")
}

#[test]
fn etcd_refuses_clients_without_a_cluster_certificate() {
    if !etcd_installed() {
        println!("SKIPPED: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("etcd-tls");
    let out = tmp.join("out");
    let serve = serve(&out, &[]);
    let url = etcd_url(&serve);
    let port = url.strip_prefix("https://127.0.0.1:").unwrap_or_else(|| panic!("etcd serves https: {url}"));
    let pki = out.join("pki");
    let client = IdentityFiles::in_dir(&pki, "client");
    let ca_pem = std::fs::read(&client.ca).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        // Plain http against the TLS port.
        let plain_url = format!("http://127.0.0.1:{port}");
        let err = EtcdStore::connect(std::slice::from_ref(&plain_url), &EtcdOptions::default()).await.err();
        assert!(err.is_some(), "plain http connected");
        println!("{}", refused("plain http", &plain_url, None).await);

        // TLS that trusts the cluster CA but presents no certificate.
        let anonymous = EtcdOptions {
            tls: Some(EtcdTls { ca_cert_pem: Some(client.ca.clone()), ..EtcdTls::default() }),
            ..EtcdOptions::default()
        };
        let err = EtcdStore::connect(std::slice::from_ref(&url), &anonymous).await.err();
        assert!(err.is_some(), "TLS without a client certificate connected");
        let tls_only = TlsOptions::new().ca_certificate(Certificate::from_pem(ca_pem.clone()));
        println!("{}", refused("no certificate", &url, Some(ConnectOptions::new().with_tls(tls_only))).await);

        // A certificate from another CA (with a kvfleet role, trusting our CA).
        let outsider = ClusterCa::generate("someone else").unwrap().issue(Role::Coordinator, "intruder", &[]).unwrap();
        let foreign = TlsOptions::new()
            .ca_certificate(Certificate::from_pem(ca_pem.clone()))
            .identity(Identity::from_pem(outsider.cert_pem, outsider.key_pem));
        println!("{}", refused("foreign certificate", &url, Some(ConnectOptions::new().with_tls(foreign))).await);

        // A cluster certificate: reads the cluster's state; the refused write did not land.
        let member = EtcdOptions {
            tls: Some(EtcdTls {
                ca_cert_pem: Some(client.ca.clone()),
                client_cert_pem: Some(client.cert.clone()),
                client_key_pem: Some(client.key.clone()),
                domain_name: None,
            }),
            ..EtcdOptions::default()
        };
        let store = EtcdStore::connect(std::slice::from_ref(&url), &member).await.expect("a cluster certificate");
        assert!(store.get(layout::CLUSTER).await.unwrap().is_some(), "{} is there", layout::CLUSTER);
        assert!(store.get(&layout::worker(0)).await.unwrap().is_some(), "worker 0 registered through TLS");
        assert!(store.get(&layout::worker(99)).await.unwrap().is_none(), "the refused write did not land");
    });
    stop(serve);
}

#[test]
fn plaintext_keeps_etcd_on_plain_http() {
    if !etcd_installed() {
        println!("SKIPPED: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("etcd-plain");
    let out = tmp.join("out");
    let serve = serve(&out, &["--plaintext"]);
    let url = etcd_url(&serve);
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let store = EtcdStore::connect(std::slice::from_ref(&url), &EtcdOptions::default()).await.unwrap();
        assert!(store.get(layout::CLUSTER).await.unwrap().is_some());
    });
    stop(serve);
}
