//! Parsing and validating OpenAI request bodies into the emulated workload of one request.
//!
//! Pure functions: bytes in, a [`CompletionRequest`] or an [`ApiError`] naming the bad field out.

use axum::http::StatusCode;
use serde_json::{Map, Value};

/// Reasoning tokens of a request that names none (`kvfleet_reasoning_tokens`).
pub const DEFAULT_REASONING_TOKENS: u32 = 256;
/// Answer tokens of a request that names neither `kvfleet_answer_tokens` nor a token limit.
pub const DEFAULT_ANSWER_TOKENS: u32 = 128;
/// Largest accepted value of any length (prompt, reasoning, answer, `max_tokens`): longer
/// requests could never fit an emulated GPU and would only tie up the cluster.
pub const MAX_TOKENS_PER_FIELD: u32 = 1 << 20;

/// Which OpenAI endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
}

/// One validated request: what to emulate and how to answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletionRequest {
    /// The endpoint it came to (shapes the response).
    pub endpoint: Endpoint,
    /// The model the client named (always the served one: others are refused).
    pub model: String,
    /// `stream: true`: answer with server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: a final chunk with `usage`.
    pub include_usage: bool,
    /// Prompt length in tokens: `kvfleet_prompt_tokens`, else estimated from the text.
    pub prompt_tokens: u32,
    /// Reasoning tokens to emulate before `</think>` (`kvfleet_reasoning_tokens`, default 256),
    /// after the token limit ([`apply_limit`]).
    pub reasoning_tokens: u32,
    /// Answer tokens to emulate (`kvfleet_answer_tokens`, default: what the token limit leaves,
    /// else 128), after the token limit ([`apply_limit`]).
    pub answer_tokens: u32,
    /// `max_completion_tokens`/`max_tokens` cut the output (reasoning + answer): `finish_reason`
    /// is `length`.
    pub capped: bool,
}

impl CompletionRequest {
    /// `"length"` when a token limit cut the output, else `"stop"`.
    pub fn finish_reason(&self) -> &'static str {
        if self.capped {
            "length"
        } else {
            "stop"
        }
    }
}

/// An OpenAI-style error: HTTP status plus `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status of the response.
    pub status: StatusCode,
    /// Human-readable explanation (`error.message`).
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `service_unavailable`, `server_error`, …
    pub kind: &'static str,
    /// The offending request field, if one is to blame.
    pub param: Option<String>,
    /// OpenAI's machine-readable `code` (e.g. `invalid_value`, `model_not_found`).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: `param` is wrong.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: Some("invalid_value"),
        }
    }

    /// 503: the cluster cannot serve now (standby coordinator, no workers, lost leadership).
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
            code: Some("service_unavailable"),
        }
    }

    /// 500: a fault of this server.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("internal_error"),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// The JSON body as sent: [`ApiError::body`] with its fields in OpenAI's order (`message`,
    /// `type`, `param`, `code`), byte for byte what OpenAI sends.
    pub fn body_text(&self) -> String {
        #[derive(serde::Serialize)]
        struct Body<'a> {
            error: Fields<'a>,
        }
        #[derive(serde::Serialize)]
        struct Fields<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        let error = Fields { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code };
        serde_json::to_string(&Body { error }).expect("strings and nulls always serialize")
    }
}

/// Parse and validate a request body for `endpoint`; `served_model` is the only model accepted.
pub fn parse_request(endpoint: Endpoint, body: &[u8], served_model: &str) -> Result<CompletionRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| ApiError {
        code: Some("invalid_json"),
        param: None,
        ..ApiError::invalid("", format!("the request body is not valid JSON: {e}"))
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError { param: None, ..ApiError::invalid("", "the request body must be a JSON object") });
    };
    let model = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        None | Some(Value::Null) => return Err(missing("model")),
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string")),
    };
    if model != served_model {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("the model `{model}` does not exist; this cluster serves `{served_model}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        });
    }
    let stream = opt_bool(&obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::invalid("stream_options.include_usage", "must be a boolean")),
        },
        Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` must be an object")),
    };
    if let Some(n) = length(&obj, "n", 1)? {
        if n != 1 {
            return Err(ApiError::invalid("n", "only `n: 1` is supported"));
        }
    }
    let estimated = match endpoint {
        Endpoint::Chat => chat_prompt_tokens(obj.get("messages"))?,
        Endpoint::Completions => completion_prompt_tokens(obj.get("prompt"))?,
    };
    let prompt_tokens = length(&obj, "kvfleet_prompt_tokens", 1)?.unwrap_or(estimated);
    let reasoning_tokens = length(&obj, "kvfleet_reasoning_tokens", 0)?.unwrap_or(DEFAULT_REASONING_TOKENS);
    let requested_answer = length(&obj, "kvfleet_answer_tokens", 1)?;
    // `max_completion_tokens` is the chat API's newer name; it wins when both are given.
    let limit = match length(&obj, "max_completion_tokens", 1)? {
        Some(l) => Some(l),
        None => length(&obj, "max_tokens", 1)?,
    };
    let Lengths { reasoning_tokens, answer_tokens, capped } = apply_limit(reasoning_tokens, requested_answer, limit);
    Ok(CompletionRequest {
        endpoint,
        model,
        stream,
        include_usage,
        prompt_tokens,
        reasoning_tokens,
        answer_tokens,
        capped,
    })
}

/// Output lengths of one request after its token limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lengths {
    /// Reasoning tokens to emulate.
    pub reasoning_tokens: u32,
    /// Answer tokens to emulate (always ≥ 1).
    pub answer_tokens: u32,
    /// The limit cut reasoning or answer below the emulation's lengths: `finish_reason: "length"`.
    pub capped: bool,
}

/// OpenAI's token limit (`max_completion_tokens`, or its legacy alias `max_tokens`) bounds
/// reasoning **plus** answer tokens: generation stops when their sum reaches `limit`. The
/// emulation's lengths are `reasoning` and `answer` (`None`: no answer length asked for); a
/// limit of 0 (refused by [`parse_request`]) counts as 1.
///
/// - No limit: `reasoning` and `answer` (default [`DEFAULT_ANSWER_TOKENS`]) as they are.
/// - A limit and an answer length: when `reasoning + answer > limit` generation is cut at the
///   limit: reasoning keeps `min(reasoning, limit − 1)` tokens, the answer gets the rest
///   (`limit − reasoning`), and `capped` is set. OpenAI would return an empty answer when the
///   limit falls inside reasoning; the emulated engine needs ≥ 1 answer token, so the limit's
///   last token is always an answer token.
/// - A limit and no answer length: the answer fills the limit (`limit − reasoning`, the output
///   is exactly `limit` tokens, as benchmark clients that set `max_tokens` to the output length
///   they want expect); `capped` only when reasoning alone reaches the limit (then cut as above).
pub fn apply_limit(reasoning: u32, answer: Option<u32>, limit: Option<u32>) -> Lengths {
    let Some(limit) = limit.map(|l| l.max(1)) else {
        return Lengths {
            reasoning_tokens: reasoning,
            answer_tokens: answer.unwrap_or(DEFAULT_ANSWER_TOKENS).max(1),
            capped: false,
        };
    };
    let reasoning_tokens = reasoning.min(limit - 1);
    let room = limit - reasoning_tokens;
    let answer_tokens = answer.map_or(room, |a| a.clamp(1, room));
    let capped = reasoning_tokens < reasoning || answer.is_some_and(|a| a > answer_tokens);
    Lengths { reasoning_tokens, answer_tokens, capped }
}

fn missing(param: &str) -> ApiError {
    ApiError { code: Some("missing_required_parameter"), ..ApiError::invalid(param, format!("`{param}` is required")) }
}

fn opt_bool(obj: &Map<String, Value>, field: &str) -> Result<Option<bool>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(field, format!("`{field}` must be a boolean"))),
    }
}

/// An optional whole number in `min..=MAX_TOKENS_PER_FIELD`.
fn length(obj: &Map<String, Value>, field: &str, min: u32) -> Result<Option<u32>, ApiError> {
    let v = match obj.get(field) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let Some(n) = v.as_i64().or_else(|| v.as_u64().map(|_| i64::MAX)) else {
        return Err(ApiError::invalid(field, format!("`{field}` must be a whole number, got {v}")));
    };
    if n < i64::from(min) {
        return Err(ApiError::invalid(field, format!("`{field}` must be at least {min}, got {n}")));
    }
    if n > i64::from(MAX_TOKENS_PER_FIELD) {
        return Err(ApiError::invalid(field, format!("`{field}` must be at most {MAX_TOKENS_PER_FIELD}, got {n}")));
    }
    Ok(Some(n as u32))
}

/// A rough token count of `words` whitespace-separated words: 1.3 tokens a word, at least 1.
pub fn estimate_tokens(words: usize) -> u64 {
    ((words as u64).saturating_mul(13).div_ceil(10)).max(1)
}

fn checked_prompt(param: &str, tokens: u64) -> Result<u32, ApiError> {
    if tokens > u64::from(MAX_TOKENS_PER_FIELD) {
        return Err(ApiError::invalid(
            param,
            format!("the prompt is about {tokens} tokens, more than the {MAX_TOKENS_PER_FIELD} accepted"),
        ));
    }
    Ok(tokens as u32)
}

fn chat_prompt_tokens(messages: Option<&Value>) -> Result<u32, ApiError> {
    let messages = match messages {
        None | Some(Value::Null) => return Err(missing("messages")),
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(ApiError::invalid("messages", "`messages` must hold at least one message"))
        }
        Some(Value::Array(m)) => m,
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be an array")),
    };
    let mut words = 0usize;
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid(&format!("messages[{i}]"), "each message must be an object"));
        };
        if !matches!(m.get("role"), Some(Value::String(_))) {
            return Err(ApiError::invalid(&format!("messages[{i}].role"), "each message needs a string `role`"));
        }
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => words += s.split_whitespace().count(),
            Some(Value::Array(parts)) => {
                for part in parts {
                    if let Some(Value::String(s)) = part.get("text") {
                        words += s.split_whitespace().count();
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].content"),
                    "`content` must be a string or an array of content parts",
                ))
            }
        }
    }
    checked_prompt("messages", estimate_tokens(words))
}

fn completion_prompt_tokens(prompt: Option<&Value>) -> Result<u32, ApiError> {
    let bad = || ApiError::invalid("prompt", "`prompt` must be a string, one string in an array, or token ids");
    match prompt {
        None | Some(Value::Null) => Err(missing("prompt")),
        Some(Value::String(s)) => checked_prompt("prompt", estimate_tokens(s.split_whitespace().count())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
            [Value::String(s)] => checked_prompt("prompt", estimate_tokens(s.split_whitespace().count())),
            [Value::String(_), ..] => Err(ApiError::invalid("prompt", "only one prompt per request is supported")),
            [Value::Array(ids)] if ids.iter().all(Value::is_u64) => checked_prompt("prompt", ids.len().max(1) as u64),
            [Value::Array(_), Value::Array(_), ..] => {
                Err(ApiError::invalid("prompt", "only one prompt per request is supported"))
            }
            ids if ids.iter().all(Value::is_u64) => checked_prompt("prompt", ids.len() as u64),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: &str = "r1-distill-qwen-32b";

    fn chat(body: &str) -> Result<CompletionRequest, ApiError> {
        parse_request(Endpoint::Chat, body.as_bytes(), M)
    }

    fn completion(body: &str) -> Result<CompletionRequest, ApiError> {
        parse_request(Endpoint::Completions, body.as_bytes(), M)
    }

    #[test]
    fn chat_defaults_estimate_the_prompt_and_use_default_lengths() {
        let r = chat(r#"{"model":"r1-distill-qwen-32b","messages":[{"role":"user","content":"one two three four five six seven eight nine ten"}]}"#).unwrap();
        assert_eq!(r.prompt_tokens, 13, "10 words × 1.3");
        assert_eq!(r.reasoning_tokens, DEFAULT_REASONING_TOKENS);
        assert_eq!(r.answer_tokens, DEFAULT_ANSWER_TOKENS);
        assert!(!r.stream && !r.include_usage && !r.capped);
        assert_eq!(r.finish_reason(), "stop");
    }

    #[test]
    fn extra_fields_override_and_max_tokens_caps_the_answer() {
        let r = chat(
            r#"{"model":"r1-distill-qwen-32b","messages":[{"role":"user","content":[{"type":"text","text":"hi there"}]}],
                "stream":true,"stream_options":{"include_usage":true},
                "kvfleet_prompt_tokens":500,"kvfleet_reasoning_tokens":0,"kvfleet_answer_tokens":40,"max_tokens":30}"#,
        )
        .unwrap();
        assert_eq!((r.prompt_tokens, r.reasoning_tokens, r.answer_tokens), (500, 0, 30));
        assert!(r.stream && r.include_usage && r.capped);
        assert_eq!(r.finish_reason(), "length");
        // max_completion_tokens wins over max_tokens and, alone, fills the limit after the
        // (default) reasoning: here reasoning alone reaches it, so it is cut.
        let r = chat(r#"{"model":"r1-distill-qwen-32b","messages":[{"role":"user","content":"x"}],"max_tokens":9,"max_completion_tokens":7}"#).unwrap();
        assert_eq!((r.reasoning_tokens, r.answer_tokens, r.capped), (6, 1, true));
        let r = chat(r#"{"model":"r1-distill-qwen-32b","messages":[{"role":"user","content":"x"}],"kvfleet_reasoning_tokens":5,"max_tokens":9}"#).unwrap();
        assert_eq!((r.reasoning_tokens, r.answer_tokens, r.capped), (5, 4, false));
    }

    #[test]
    fn the_token_limit_bounds_reasoning_plus_answer() {
        let l = |reasoning, answer, limit| {
            let x = apply_limit(reasoning, answer, limit);
            (x.reasoning_tokens, x.answer_tokens, x.capped)
        };
        // No limit: the emulation's lengths.
        assert_eq!(l(10, Some(5), None), (10, 5, false));
        assert_eq!(l(10, None, None), (10, DEFAULT_ANSWER_TOKENS, false));
        // Within the limit: untouched, not cut (also exactly at it).
        assert_eq!(l(10, Some(5), Some(15)), (10, 5, false));
        assert_eq!(l(10, Some(5), Some(100)), (10, 5, false));
        // Over it: the answer is cut first (reasoning comes first in time) ...
        assert_eq!(l(10, Some(5), Some(12)), (10, 2, true));
        // ... and reasoning too when it alone reaches the limit; one answer token always remains.
        assert_eq!(l(10, Some(5), Some(10)), (9, 1, true));
        assert_eq!(l(10, Some(5), Some(3)), (2, 1, true));
        assert_eq!(l(10, Some(5), Some(1)), (0, 1, true));
        assert_eq!(l(0, Some(5), Some(1)), (0, 1, true));
        // No answer length: the answer fills the limit; cut only when reasoning reaches it.
        assert_eq!(l(10, None, Some(16)), (10, 6, false));
        assert_eq!(l(10, None, Some(11)), (10, 1, false));
        assert_eq!(l(10, None, Some(10)), (9, 1, true));
        // The output never exceeds the limit, and equals it whenever anything was cut.
        for reasoning in 0..12 {
            for answer in [None, Some(1), Some(4), Some(9)] {
                for limit in 1..25 {
                    let x = apply_limit(reasoning, answer, Some(limit));
                    let total = x.reasoning_tokens + x.answer_tokens;
                    assert!(total <= limit && x.answer_tokens >= 1, "{reasoning} {answer:?} {limit}: {x:?}");
                    if x.capped || answer.is_none() {
                        assert_eq!(total, limit, "{reasoning} {answer:?} {limit}: {x:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn completion_prompts_in_every_accepted_shape() {
        for (prompt, tokens) in
            [(r#""a b c d""#, 6), (r#"["a b"]"#, 3), ("[1,2,3,4,5]", 5), ("[[1,2]]", 2), (r#""""#, 1)]
        {
            let r = completion(&format!(r#"{{"model":"{M}","prompt":{prompt}}}"#)).unwrap();
            assert_eq!(r.prompt_tokens, tokens, "prompt {prompt}");
            assert_eq!(r.endpoint, Endpoint::Completions);
        }
    }

    #[test]
    fn bad_input_names_the_field() {
        let cases: &[(Endpoint, &str, StatusCode, Option<&str>)] = &[
            (Endpoint::Chat, "{not json", StatusCode::BAD_REQUEST, None),
            (Endpoint::Chat, "[1]", StatusCode::BAD_REQUEST, None),
            (Endpoint::Chat, r#"{"messages":[{"role":"user","content":"x"}]}"#, StatusCode::BAD_REQUEST, Some("model")),
            (
                Endpoint::Chat,
                r#"{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}"#,
                StatusCode::NOT_FOUND,
                Some("model"),
            ),
            (Endpoint::Chat, r#"{"model":"M"}"#, StatusCode::BAD_REQUEST, Some("messages")),
            (Endpoint::Chat, r#"{"model":"M","messages":[]}"#, StatusCode::BAD_REQUEST, Some("messages")),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"content":"x"}]}"#,
                StatusCode::BAD_REQUEST,
                Some("messages[0].role"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":5}]}"#,
                StatusCode::BAD_REQUEST,
                Some("messages[0].content"),
            ),
            (Endpoint::Completions, r#"{"model":"M"}"#, StatusCode::BAD_REQUEST, Some("prompt")),
            (Endpoint::Completions, r#"{"model":"M","prompt":["a","b"]}"#, StatusCode::BAD_REQUEST, Some("prompt")),
            (Endpoint::Completions, r#"{"model":"M","prompt":{}}"#, StatusCode::BAD_REQUEST, Some("prompt")),
            (
                Endpoint::Completions,
                r#"{"model":"M","prompt":"x","max_tokens":-1}"#,
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"M","prompt":"x","max_tokens":0}"#,
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"M","prompt":"x","max_tokens":1.5}"#,
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
            ),
            (
                Endpoint::Completions,
                r#"{"model":"M","prompt":"x","max_tokens":18446744073709551615}"#,
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":"x"}],"kvfleet_reasoning_tokens":-3}"#,
                StatusCode::BAD_REQUEST,
                Some("kvfleet_reasoning_tokens"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":"x"}],"kvfleet_answer_tokens":0}"#,
                StatusCode::BAD_REQUEST,
                Some("kvfleet_answer_tokens"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":"x"}],"kvfleet_prompt_tokens":2000000}"#,
                StatusCode::BAD_REQUEST,
                Some("kvfleet_prompt_tokens"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":"x"}],"kvfleet_answer_tokens":"10"}"#,
                StatusCode::BAD_REQUEST,
                Some("kvfleet_answer_tokens"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
                StatusCode::BAD_REQUEST,
                Some("stream"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":1}}"#,
                StatusCode::BAD_REQUEST,
                Some("stream_options.include_usage"),
            ),
            (
                Endpoint::Chat,
                r#"{"model":"M","messages":[{"role":"user","content":"x"}],"n":2}"#,
                StatusCode::BAD_REQUEST,
                Some("n"),
            ),
        ];
        for (endpoint, body, status, param) in cases {
            let body = body.replace(r#""model":"M""#, &format!(r#""model":"{M}""#));
            let e = parse_request(*endpoint, body.as_bytes(), M).expect_err(&body);
            assert_eq!(e.status, *status, "{body}: {e}");
            assert_eq!(e.param.as_deref(), *param, "{body}: {e}");
            let json = e.body();
            assert_eq!(json["error"]["message"], Value::String(e.message.clone()));
            assert!(json["error"]["type"].is_string(), "{json}");
        }
    }

    #[test]
    fn huge_prompts_are_refused_by_the_estimate() {
        let words = "w ".repeat(900_000);
        let e = completion(&format!(r#"{{"model":"{M}","prompt":"{words}"}}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"), "{e}");
        assert_eq!(estimate_tokens(0), 1);
        assert_eq!(estimate_tokens(3), 4);
    }
}
