//! The behavioural suite (`tests/suite`) against the in-process `MemStore`, with TTLs short
//! enough that lease expiry costs a fraction of a second.

mod suite;

use std::sync::Arc;
use std::time::Duration;

use kvfleet_meta::{MemStore, MetaStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memstore_passes_the_suite() {
    let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
    assert_eq!(store.store_kind(), "embedded");
    let opts = suite::SuiteOpts { short_ttl: Duration::from_millis(200), patience: Duration::from_secs(5) };
    suite::run_all(store, "/t", &opts).await;
}
