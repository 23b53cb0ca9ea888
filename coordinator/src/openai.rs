//! The OpenAI-compatible HTTP front door (axum): OpenAI clients and benchmark tools drive the
//! emulated cluster without glue. Served by `kvfleet-coordinator --http-listen ADDR` next to gRPC.
//!
//! | route | answer | needs the API key (when one is set) |
//! |---|---|---|
//! | `GET /health` | `{"status":"ok","leader":bool,"workers":n,"model":…}` (`workers`: live instances, leader only) | no |
//! | `GET /metrics` | the coordinator's Prometheus metrics ([`crate::metrics`]) | no |
//! | `GET /v1/models` | the one model the cluster serves, in OpenAI's list format | yes |
//! | `POST /v1/chat/completions` | chat completion; `stream: true` → server-sent events | yes |
//! | `POST /v1/completions` | text completion; `stream: true` → server-sent events | yes |
//!
//! **Emulated tokens.** Each request becomes one cluster request (`RequestSpec`) placed by the
//! leader's policy. Token *text* is synthetic (one word per token from a fixed list), but their
//! number and timing are the emulation's: one chunk per output token, sent as the worker's token
//! event reaches the leader. Chat streams reasoning tokens as `delta.reasoning_content` and answer
//! tokens as `delta.content`; completions put only answer tokens in `text` (reasoning tokens come
//! as chunks with an empty `text` and the token in `reasoning_content`). `usage` counts
//! `completion_tokens` = reasoning + answer, with `completion_tokens_details.reasoning_tokens`;
//! streams send it in a last chunk when `stream_options.include_usage` is true. Non-streamed
//! responses also carry a `kvfleet` object with the emulation's measurements (TTFT, TTFAT, QoE,
//! instance, migrations).
//!
//! **Request lengths** (whole numbers, at most [`MAX_TOKENS_PER_FIELD`]):
//! - `kvfleet_prompt_tokens` (≥ 1): default, a rough count of the input text (whitespace-separated
//!   words × 1.3, at least 1; token-id prompts count their ids);
//! - `kvfleet_reasoning_tokens` (≥ 0): default [`DEFAULT_REASONING_TOKENS`];
//! - `kvfleet_answer_tokens` (≥ 1): default what the token limit leaves after reasoning, else
//!   (no limit) [`DEFAULT_ANSWER_TOKENS`].
//!
//! **Token limits**, as OpenAI counts them ([`apply_limit`]): `max_completion_tokens` (or its
//! legacy alias `max_tokens`; the former wins when both are given) bounds reasoning **plus**
//! answer tokens, `usage.completion_tokens`. The `kvfleet_*` lengths are what the emulated model
//! would generate; the limit then cuts generation where the total reaches it:
//!
//! | request (R reasoning, A answer, limit L) | reasoning, answer emulated | `finish_reason` |
//! |---|---|---|
//! | R + A ≤ L | R, A | `stop` |
//! | R < L < R + A | R, L − R | `length` |
//! | R ≥ L (the limit falls inside reasoning) | L − 1, 1 | `length` |
//! | no `kvfleet_answer_tokens`, R < L | R, L − R (the output is exactly L tokens) | `stop` |
//! | no `kvfleet_answer_tokens`, R ≥ L | L − 1, 1 | `length` |
//!
//! OpenAI returns an empty answer when the limit is reached during reasoning; an emulated request
//! needs at least one answer token, so the limit's last token is always an answer token (the
//! closest faithful rule: the total, `usage.completion_tokens`, still equals the limit).
//! `usage.completion_tokens` is always reasoning + answer actually produced.
//!
//! Other OpenAI fields (temperature, stop, tools, …) are accepted and ignored; `n` must be 1.
//!
//! **Errors** are OpenAI-style `{"error":{"message","type","param","code"}}`: 401 without the
//! right API key (OpenAI's own bodies, see below), 400 for malformed
//! JSON or a bad field (named in `param`), 404 `model_not_found` for a model other than the
//! served one (the cluster serves exactly one model, so a wrong name is a client mistake),
//! 413 for a body over [`MAX_BODY_BYTES`], 503 on a standby coordinator (naming the leader's
//! address when known) or with no workers registered.
//!
//! **Security.** This is plain HTTP — OpenAI clients do not speak the cluster's mutual TLS. It
//! is off unless `--http-listen` is given. With `--api-key KEY` (or `KVFLEET_API_KEY`), every
//! `/v1/*` route needs `Authorization: Bearer KEY`, as OpenAI's API does; a missing key gets 401
//! with OpenAI's `"You didn't provide an API key. …"` (`code: null`), a wrong one 401 with
//! `"Incorrect API key provided: <the key, mostly masked>. …"` (`code: "invalid_api_key"`);
//! keys are compared in constant time. `/health` and `/metrics` stay open (probes and scrapers
//! carry no key; they show liveness and counters, never request contents, and accept no work).
//! The key crosses the network in clear text: bind `--http-listen` to loopback, or put a
//! TLS-terminating proxy in front.

mod auth;
mod chunks;
mod request;

pub use auth::{check as check_api_key, mask_key, ApiKey, MISSING_KEY_MESSAGE};
pub use chunks::{full_response, token_text, ResponseMeta, TokenTracker, Usage};
pub use request::{
    apply_limit, parse_request, ApiError, CompletionRequest, Endpoint, Lengths, DEFAULT_ANSWER_TOKENS,
    DEFAULT_REASONING_TOKENS, MAX_TOKENS_PER_FIELD,
};

use crate::leader::{ClientTx, Leader, LeaderError};
use crate::node::Node;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvfleet_core::{RequestId, RequestSpec};
use kvfleet_meta::layout as keys;
use kvfleet_proto::v1;
use kvfleet_proto::v1::client_event::Event as ClientEvent;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Request ids of HTTP requests have this bit set; gRPC clients (`kvfleet up` numbers from 0)
/// do not, so the two never collide.
pub const HTTP_REQUEST_ID_BIT: u64 = 1 << 62;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let json = [(axum::http::header::CONTENT_TYPE, "application/json")];
        (self.status, json, self.body_text()).into_response()
    }
}

impl From<LeaderError> for ApiError {
    fn from(e: LeaderError) -> ApiError {
        match e {
            LeaderError::Control(kvfleet_control::ControlError::Duplicate(id)) => {
                ApiError::internal(format!("request id {id} collided with an earlier request; retry"))
            }
            other => ApiError::unavailable(other.to_string()),
        }
    }
}

/// Allocates cluster request ids for HTTP requests: [`HTTP_REQUEST_ID_BIT`] plus a random
/// 62-bit start (so ids do not repeat across coordinator restarts or between coordinators)
/// plus a counter.
#[derive(Debug)]
pub struct RequestIds {
    start: u64,
    next: AtomicU64,
}

impl RequestIds {
    /// Ids starting at a random point (std's per-process random hash keys mixed with the clock).
    pub fn random() -> RequestIds {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        h.write_u32(std::process::id());
        RequestIds::starting_at(h.finish())
    }

    /// Ids from `start` on (tests).
    pub fn starting_at(start: u64) -> RequestIds {
        RequestIds { start, next: AtomicU64::new(0) }
    }

    /// The next id: always has [`HTTP_REQUEST_ID_BIT`] set.
    pub fn next(&self) -> u64 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        HTTP_REQUEST_ID_BIT | (self.start.wrapping_add(n) & (HTTP_REQUEST_ID_BIT - 1))
    }
}

/// Shared by the handlers.
struct Api {
    node: Arc<Node>,
    ids: RequestIds,
}

/// The API's routes, serving `node`; with `api_key`, `/v1/*` needs `Authorization: Bearer KEY`.
pub fn router(node: Arc<Node>, api_key: Option<ApiKey>) -> Router {
    let api = Arc::new(Api { node, ids: RequestIds::random() });
    let routes = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(api);
    auth::guard(routes, api_key)
}

/// Serve the API on `listener` until `shutdown` resolves (`api_key`: see [`router`]).
pub async fn serve_http(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    api_key: Option<ApiKey>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(no_delay(listener), router(node, api_key)).with_graceful_shutdown(shutdown).await
}

/// `listener` with Nagle's algorithm off on every connection: streamed tokens are small writes,
/// and with it on one written while the last was unacknowledged waited for the client's delayed
/// ACK (40 ms on Linux).
fn no_delay(
    listener: tokio::net::TcpListener,
) -> axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    use axum::serve::ListenerExt;
    fn set(tcp: &mut tokio::net::TcpStream) {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
    }
    listener.tap_io(set as fn(&mut tokio::net::TcpStream))
}

/// The leader if this coordinator is it; else 503 naming the leader (as gRPC's
/// `leader_or_redirect` does).
async fn leader_or_unavailable(node: &Node) -> Result<Arc<Leader>, ApiError> {
    if let Some(l) = node.current_leader().await {
        if !l.is_deposed() {
            return Ok(l);
        }
    }
    let leader =
        node.store.leader(keys::ELECTION).await.ok().flatten().map(|v| String::from_utf8_lossy(&v).into_owned());
    Err(ApiError::unavailable(match leader {
        Some(addr) => {
            format!("this coordinator is not the leader; the leader is at {addr} (its --http-listen address)")
        }
        None => "no leader elected yet; retry".to_string(),
    }))
}

/// Prometheus metrics of this coordinator (`crate::metrics`).
async fn metrics(State(api): State<Arc<Api>>) -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, kvfleet_telemetry::prom::CONTENT_TYPE)],
        crate::metrics::render(&api.node).await,
    )
}

async fn health(State(api): State<Arc<Api>>) -> Json<Value> {
    let leader = api.node.current_leader().await.filter(|l| !l.is_deposed());
    let workers = leader.as_ref().map(|l| l.status("", api.node.clock()).instances.iter().filter(|i| i.alive).count());
    Json(json!({
        "status": "ok",
        "leader": leader.is_some(),
        "workers": workers,
        "model": api.node.opts.model.model,
    }))
}

async fn models(State(api): State<Arc<Api>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": api.node.opts.model.model,
            "object": "model",
            "created": api.node.epoch_unix_ns() / 1_000_000_000,
            "owned_by": "kvfleet",
        }],
    }))
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such route; this server offers /health, /v1/models, /v1/chat/completions, /v1/completions".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("unknown_url"),
    }
}

async fn chat_completions(State(api): State<Arc<Api>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(api, Endpoint::Chat, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(api): State<Arc<Api>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(api, Endpoint::Completions, body).await.unwrap_or_else(IntoResponse::into_response)
}

fn body_error(r: BytesRejection) -> ApiError {
    let status = r.status();
    let code = if status == StatusCode::PAYLOAD_TOO_LARGE { "request_too_large" } else { "invalid_body" };
    ApiError {
        status,
        message: format!("cannot read the request body (at most {MAX_BODY_BYTES} bytes): {}", r.body_text()),
        kind: "invalid_request_error",
        param: None,
        code: Some(code),
    }
}

/// Submit one request to the leader, then answer with a stream or a whole response.
async fn complete(
    api: Arc<Api>,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let req = parse_request(endpoint, &body, &api.node.opts.model.model)?;
    let leader = leader_or_unavailable(&api.node).await?;
    let id = api.ids.next();
    let spec = RequestSpec {
        content_ids: Vec::new(),
        id: RequestId(id),
        arrival: api.node.clock().now(),
        prompt_tokens: req.prompt_tokens,
        reasoning_tokens: req.reasoning_tokens,
        answer_tokens: req.answer_tokens,
    };
    // The leader drops token notifications (never the final record) when this fills up.
    let (tx, mut rx): (ClientTx, _) = mpsc::channel(1024);
    leader.submit(spec, tx).await?;
    // From here on a client that goes away (this future dropped, the stream closed) cancels it.
    let guard = CancelOnDrop { leader: Some(leader), id: RequestId(id) };
    let meta = ResponseMeta::new(endpoint, id, keys::unix_now_ns() / 1_000_000_000, &req.model);
    tracing::debug!(request = id, ?endpoint, stream = req.stream, "HTTP request accepted");
    if req.stream {
        let (out, events) = mpsc::channel::<Result<Event, Infallible>>(256);
        tokio::spawn(stream_events(rx, id, req, meta, out, guard));
        return Ok(Sse::new(ReceiverStream::new(events)).keep_alive(KeepAlive::default()).into_response());
    }
    let mut guard = guard;
    loop {
        let event = rx.recv().await;
        if !matches!(
            event,
            Some(Ok(v1::ClientEvent { event: Some(ClientEvent::Tokens(_) | ClientEvent::AcceptedOn(_)) }))
        ) {
            // Finished, or the cluster side ended: nothing left to cancel.
            guard.disarm();
        }
        match event {
            Some(Ok(v1::ClientEvent { event: Some(ClientEvent::Finished(rec)) })) => {
                if rec.rejected {
                    return Err(rejected(&req));
                }
                return Ok(Json(full_response(&meta, &req, &rec)).into_response());
            }
            Some(Ok(_)) => {}
            Some(Err(status)) => return Err(ApiError::unavailable(status.message().to_string())),
            None => return Err(lost(id)),
        }
    }
}

fn rejected(req: &CompletionRequest) -> ApiError {
    ApiError {
        code: Some("context_length_exceeded"),
        ..ApiError::invalid(
            "kvfleet_prompt_tokens",
            format!(
                "the request ({} prompt + {} output tokens) can never fit an instance's KV cache",
                req.prompt_tokens,
                req.reasoning_tokens + req.answer_tokens
            ),
        )
    }
}

fn lost(id: u64) -> ApiError {
    ApiError::unavailable(format!(
        "the leader stepped down before request {id} finished; it continues in the cluster (gRPC Resume {id})"
    ))
}

/// One SSE event of JSON.
fn data(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Cancels its request ([`Leader::cancel`]) when dropped armed: the HTTP client went away
/// before the request finished. gRPC clients are not cancelled on a broken stream (they resume).
struct CancelOnDrop {
    leader: Option<Arc<Leader>>,
    id: RequestId,
}

impl CancelOnDrop {
    /// The request ended (finished, rejected, or the cluster side failed): nothing to cancel.
    fn disarm(&mut self) {
        self.leader = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(leader) = self.leader.take() {
            let id = self.id;
            tracing::info!(request = id.0, "HTTP client went away: cancelling its request");
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { leader.cancel(id).await });
            }
        }
    }
}

/// Forward the leader's events to an SSE stream, one chunk per output token; when the client
/// goes away (the stream is dropped) the request is cancelled.
async fn stream_events(
    mut rx: mpsc::Receiver<Result<v1::ClientEvent, tonic::Status>>,
    id: u64,
    req: CompletionRequest,
    meta: ResponseMeta,
    out: mpsc::Sender<Result<Event, Infallible>>,
    mut guard: CancelOnDrop,
) {
    let mut tracker = TokenTracker::new(req.reasoning_tokens, req.answer_tokens);
    let mut first = true;
    let send_tokens = |range: std::ops::Range<u32>, tracker: &TokenTracker, first: &mut bool| {
        range
            .map(|i| {
                let chunk = chunks::token_chunk(&meta, i, tracker.is_reasoning(i), *first);
                *first = false;
                chunk
            })
            .collect::<Vec<_>>()
    };
    let error = loop {
        let event = tokio::select! {
            event = rx.recv() => event,
            // The client is gone: `guard` cancels the request.
            () = out.closed() => return,
        };
        if !matches!(
            event,
            Some(Ok(v1::ClientEvent { event: Some(ClientEvent::Tokens(_) | ClientEvent::AcceptedOn(_)) }))
        ) {
            guard.disarm();
        }
        let chunks = match event {
            Some(Ok(v1::ClientEvent { event: Some(ClientEvent::Tokens(t)) })) => {
                let range = tracker.advance(t.first_index, t.count);
                send_tokens(range, &tracker, &mut first)
            }
            Some(Ok(v1::ClientEvent { event: Some(ClientEvent::Finished(rec)) })) => {
                if rec.rejected {
                    break rejected(&req);
                }
                let range = tracker.finish();
                let mut chunks = send_tokens(range, &tracker, &mut first);
                chunks.push(chunks::finish_chunk(&meta, req.finish_reason()));
                if req.include_usage {
                    chunks.push(chunks::usage_chunk(&meta, Usage::of(&rec)));
                }
                for c in &chunks {
                    if out.send(data(c)).await.is_err() {
                        return;
                    }
                }
                let _ = out.send(Ok(Event::default().data("[DONE]"))).await;
                return;
            }
            Some(Ok(_)) => Vec::new(),
            Some(Err(status)) => break ApiError::unavailable(status.message().to_string()),
            None => break lost(id),
        };
        for c in &chunks {
            if out.send(data(c)).await.is_err() {
                return;
            }
        }
    };
    // Headers are sent: report the failure in the stream, as OpenAI does.
    let _ = out.send(Ok(Event::default().data(error.body_text()))).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_http_connections_send_small_writes_at_once() {
        use axum::serve::Listener;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = no_delay(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (stream, _) = listener.accept().await;
        assert!(stream.nodelay().unwrap(), "Nagle's algorithm is off on the API's connections");
    }

    #[test]
    fn http_request_ids_have_the_high_bit_and_do_not_repeat() {
        let ids = RequestIds::starting_at(u64::MAX);
        let a = ids.next();
        let b = ids.next();
        assert_ne!(a, b);
        assert!(a & HTTP_REQUEST_ID_BIT != 0 && b & HTTP_REQUEST_ID_BIT != 0);
        assert!(a < 1 << 63 && b < 1 << 63, "bit 63 stays clear (ids remain positive as i64)");
        assert_ne!(RequestIds::random().next(), RequestIds::random().next());
    }

    #[test]
    fn errors_render_as_openai_error_objects() {
        let e = ApiError::unavailable("no leader");
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            e.body(),
            json!({"error": {"message": "no leader", "type": "service_unavailable", "param": null, "code": "service_unavailable"}})
        );
        assert_eq!(
            e.body_text(),
            r#"{"error":{"message":"no leader","type":"service_unavailable","param":null,"code":"service_unavailable"}}"#,
            "OpenAI's field order"
        );
        let e = ApiError::invalid("n", "bad");
        assert_eq!(serde_json::from_str::<Value>(&e.body_text()).unwrap(), e.body());
    }
}
