//! Optional bearer-token authentication of the API's `/v1/*` routes (`--api-key KEY`, or the
//! `KVFLEET_API_KEY` environment variable), answered as OpenAI answers.
//!
//! With a key configured, a request to `/v1` or below must carry `Authorization: Bearer KEY`
//! (the scheme is case-insensitive, as RFC 7235 says). Otherwise it gets 401 with OpenAI's own
//! error bodies: for no key (no `Authorization` header, another scheme, or an empty token)
//! `"You didn't provide an API key. …"` with `code: null`; for a wrong one
//! `"Incorrect API key provided: <masked>. …"` with `code: "invalid_api_key"` (the key the
//! client sent, mostly masked by [`mask_key`]). The 401 also carries `WWW-Authenticate: Bearer`.
//! Keys are compared in constant time for a given length ([`ApiKey::matches`]).
//!
//! `/health` and `/metrics` stay open: load balancers' health probes and Prometheus scrapers
//! (`kvfleet up` and `kvfleet serve` scrape `/metrics` themselves) carry no OpenAI key, and
//! neither page reveals request contents or accepts work — only liveness, leadership and counters.

use super::request::ApiError;
use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use std::sync::Arc;

/// OpenAI's message for a request without an API key (sent verbatim).
pub const MISSING_KEY_MESSAGE: &str = "You didn't provide an API key. You need to provide your API key in an \
     Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password field \
     (with blank username) if you're accessing the API from your browser and are prompted for a username. You \
     can obtain an API key from https://platform.openai.com/account/api-keys.";

/// The API key clients must present. Its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(Box<str>);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKey({} chars, redacted)", self.0.len())
    }
}

impl std::str::FromStr for ApiKey {
    type Err = String;

    /// A key of visible ASCII characters (what an HTTP header carries unchanged), at least one.
    fn from_str(key: &str) -> Result<ApiKey, String> {
        if key.is_empty() {
            return Err("the API key is empty (unset it to serve without authentication)".into());
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("an API key must be visible ASCII characters (no spaces or control characters)".into());
        }
        Ok(ApiKey(key.into()))
    }
}

impl ApiKey {
    /// The key's text (to hand to a client or a child process).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this key. Its length is compared first (a key's length is not a
    /// secret worth hiding); equal-length keys are compared in constant time (an xor-fold over
    /// every byte, no early exit), so timing does not reveal how many leading bytes matched.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        if expected.len() != presented.len() {
            return false;
        }
        let diff = expected.iter().zip(presented).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

/// A key as OpenAI's "Incorrect API key provided" message shows it: most characters masked.
/// At most a fifth of the characters, and at most 4, stay visible at each end (`unused` →
/// `u****d`, a 51-character `sk-…` key → its first 4, 43 `*`, its last 4); keys under 5
/// characters are masked whole.
pub fn mask_key(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    let shown = (chars.len() / 5).min(4);
    let mut out: String = chars[..shown].iter().collect();
    out.extend(std::iter::repeat_n('*', chars.len() - 2 * shown));
    out.extend(&chars[chars.len() - shown..]);
    out
}

/// 401 for a request without an API key: OpenAI's body, `code: null`.
pub fn missing_key() -> ApiError {
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: MISSING_KEY_MESSAGE.to_string(),
        kind: "invalid_request_error",
        param: None,
        code: None,
    }
}

/// 401 for a wrong key `presented`: OpenAI's body (the key masked), `code: "invalid_api_key"`.
pub fn incorrect_key(presented: &str) -> ApiError {
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: format!(
            "Incorrect API key provided: {}. You can find your API key at https://platform.openai.com/account/api-keys.",
            mask_key(presented)
        ),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
    }
}

/// The bearer token of `headers` (`Authorization: Bearer TOKEN`, scheme case-insensitive), if
/// there is a non-empty one.
fn bearer_token(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(AUTHORIZATION)?.as_bytes().trim_ascii();
    let split = value.iter().position(|b| *b == b' ' || *b == b'\t')?;
    let (scheme, token) = value.split_at(split);
    let token = token.trim_ascii();
    (scheme.eq_ignore_ascii_case(b"bearer") && !token.is_empty()).then_some(token)
}

/// Whether a request with `headers` may use the API guarded by `key`.
pub fn check(key: &ApiKey, headers: &HeaderMap) -> Result<(), ApiError> {
    match bearer_token(headers) {
        None => Err(missing_key()),
        Some(token) if key.matches(token) => Ok(()),
        Some(token) => Err(incorrect_key(&String::from_utf8_lossy(token))),
    }
}

/// Whether `path` needs the key: `/v1` and everything below it (unknown `/v1/…` routes too, so
/// that their 404 does not tell an unauthenticated client which routes exist).
pub fn protects(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/")
}

/// The middleware: 401 unless the request may pass.
async fn require_key(State(key): State<Arc<ApiKey>>, req: Request, next: Next) -> Response {
    if protects(req.uri().path()) {
        if let Err(e) = check(&key, req.headers()) {
            tracing::debug!(path = req.uri().path(), code = ?e.code, "refused a request without the right API key");
            let mut response = e.into_response();
            response.headers_mut().insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    next.run(req).await
}

/// `router` guarded by `key` (unchanged without one).
pub fn guard(router: Router, key: Option<ApiKey>) -> Router {
    match key {
        Some(key) => router.layer(axum::middleware::from_fn_with_state(Arc::new(key), require_key)),
        None => router,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use serde_json::{json, Value};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn key(k: &str) -> ApiKey {
        k.parse().unwrap()
    }

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn keys_must_be_visible_ascii_and_do_not_print() {
        assert!("".parse::<ApiKey>().is_err());
        assert!("has space".parse::<ApiKey>().is_err());
        assert!("tab\there".parse::<ApiKey>().is_err());
        assert!("ключ".parse::<ApiKey>().is_err());
        let k = key("sk-secret-123");
        assert_eq!(k.expose(), "sk-secret-123");
        assert!(!format!("{k:?}").contains("secret"), "{k:?}");
    }

    #[test]
    fn matching_is_exact() {
        let k = key("sk-secret-123");
        assert!(k.matches(b"sk-secret-123"));
        for wrong in [&b"sk-secret-124"[..], b"sk-secret-12", b"sk-secret-1234", b"", b"SK-SECRET-123"] {
            assert!(!k.matches(wrong), "{}", String::from_utf8_lossy(wrong));
        }
    }

    #[test]
    fn masks_hide_most_characters() {
        assert_eq!(mask_key("unused"), "u****d");
        assert_eq!(mask_key("abcd"), "****");
        assert_eq!(mask_key(""), "");
        let long = format!("sk-{}", "x".repeat(44) + "WXYZ");
        let m = mask_key(&long);
        assert_eq!(m, format!("sk-x{}WXYZ", "*".repeat(43)));
        for k in ["a", "ab", "abcdefghij", &long, "ééééééé"] {
            let m = mask_key(k);
            assert_eq!(m.chars().count(), k.chars().count());
            let stars = m.chars().filter(|c| *c == '*').count();
            assert!(stars * 5 >= k.chars().count() * 3, "{k} -> {m}: most characters masked");
        }
    }

    #[test]
    fn the_bearer_header_is_checked_with_openai_errors() {
        let k = key("right-key-0123");
        assert_eq!(check(&k, &headers(Some("Bearer right-key-0123"))), Ok(()));
        assert_eq!(check(&k, &headers(Some("bearer  right-key-0123 "))), Ok(()), "scheme case, spaces");
        for no_key in [None, Some("Bearer"), Some("Bearer   "), Some("Basic right-key-0123"), Some("right-key-0123")] {
            let e = check(&k, &headers(no_key)).unwrap_err();
            assert_eq!(e, missing_key(), "{no_key:?}");
        }
        assert_eq!(
            missing_key().body(),
            json!({"error": {"message": MISSING_KEY_MESSAGE, "type": "invalid_request_error", "param": null, "code": null}})
        );
        assert_eq!(
            missing_key().body_text(),
            format!(
                r#"{{"error":{{"message":"{MISSING_KEY_MESSAGE}","type":"invalid_request_error","param":null,"code":null}}}}"#
            ),
            "byte for byte OpenAI's body"
        );
        let e = check(&k, &headers(Some("Bearer wrong-key-0123"))).unwrap_err();
        assert_eq!(
            e.body_text(),
            r#"{"error":{"message":"Incorrect API key provided: wr**********23. You can find your API key at https://platform.openai.com/account/api-keys.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#
        );
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        assert_eq!(
            e.body(),
            json!({"error": {
                "message": "Incorrect API key provided: wr**********23. You can find your API key at https://platform.openai.com/account/api-keys.",
                "type": "invalid_request_error",
                "param": null,
                "code": "invalid_api_key",
            }})
        );
    }

    #[test]
    fn only_v1_routes_are_protected() {
        assert!(protects("/v1/chat/completions") && protects("/v1/models") && protects("/v1") && protects("/v1/x"));
        assert!(!protects("/health") && !protects("/metrics") && !protects("/v10") && !protects("/"));
    }

    /// One raw HTTP/1.1 GET: (status, WWW-Authenticate present, body).
    async fn get_raw(addr: std::net::SocketAddr, path: &str, auth: Option<&str>) -> (u16, bool, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let auth = auth.map(|a| format!("Authorization: {a}\r\n")).unwrap_or_default();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, head.to_ascii_lowercase().contains("www-authenticate: bearer"), body.to_string())
    }

    #[tokio::test]
    async fn the_guard_answers_401_on_v1_routes_only() {
        let routes =
            || Router::new().route("/health", get(|| async { "ok" })).route("/v1/models", get(|| async { "m" }));
        let serve = |router: Router| async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(l, router).await.unwrap() });
            addr
        };
        let guarded = serve(guard(routes(), Some(key("k-0123456789")))).await;
        assert_eq!(get_raw(guarded, "/v1/models", Some("Bearer k-0123456789")).await, (200, false, "m".into()));
        let (status, challenge, body) = get_raw(guarded, "/v1/models", Some("Bearer k-0123456780")).await;
        assert_eq!((status, challenge), (401, true));
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body, incorrect_key("k-0123456780").body());
        assert_eq!(body["error"]["code"], "invalid_api_key");
        let (status, _, body) = get_raw(guarded, "/v1/models", None).await;
        assert_eq!(status, 401);
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), missing_key().body());
        let (status, _, _) = get_raw(guarded, "/v1/no-such-route", None).await;
        assert_eq!(status, 401, "unknown /v1 routes are guarded too");
        assert_eq!(get_raw(guarded, "/health", None).await, (200, false, "ok".into()), "/health stays open");
        let open = serve(guard(routes(), None)).await;
        assert_eq!(get_raw(open, "/v1/models", None).await, (200, false, "m".into()), "no key configured");
        assert_eq!(get_raw(open, "/v1/models", Some("Bearer anything")).await.0, 200);
    }
}
