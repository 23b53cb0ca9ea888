//! Turning the leader's token events into OpenAI response objects: which tokens are new
//! ([`TokenTracker`]), their synthetic text, and the JSON of chunks and whole responses.
//!
//! Pure functions; the HTTP shell in [`super`] sends what they build.

use super::request::{CompletionRequest, Endpoint};
use kvfleet_proto::v1;
use serde_json::{json, Value};
use std::ops::Range;

/// The synthetic vocabulary: output token `i` is `WORDS[i % WORDS.len()]`, each with a leading
/// space, so a text of `n` tokens splits into exactly `n` whitespace-separated words.
const WORDS: [&str; 16] = [
    " the",
    " fleet",
    " of",
    " emulated",
    " GPUs",
    " serves",
    " this",
    " token",
    " with",
    " measured",
    " timing",
    " and",
    " real",
    " KV",
    " cache",
    " bytes",
];

/// The text of output token `index` (0-based over reasoning then answer tokens).
pub fn token_text(index: u32) -> &'static str {
    WORDS[index as usize % WORDS.len()]
}

/// The text of output tokens `range`.
pub fn text_of(range: Range<u32>) -> String {
    range.map(token_text).collect()
}

/// Which output tokens a client has been sent. Token events may repeat (a request re-run after
/// its worker died starts over at index 0) or go missing (the leader drops token notifications
/// for a slow client, never the final record): each index is delivered once, in order, and a
/// gap is filled when a later token or the final record shows it was produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenTracker {
    reasoning: u32,
    total: u32,
    next: u32,
}

impl TokenTracker {
    /// Nothing delivered yet, of `reasoning_tokens` then `answer_tokens` output tokens.
    pub fn new(reasoning_tokens: u32, answer_tokens: u32) -> TokenTracker {
        TokenTracker { reasoning: reasoning_tokens, total: reasoning_tokens.saturating_add(answer_tokens), next: 0 }
    }

    /// Tokens `first_index .. first_index + count` were produced: the indices not yet delivered.
    pub fn advance(&mut self, first_index: u32, count: u32) -> Range<u32> {
        let end = first_index.saturating_add(count).min(self.total);
        let start = self.next;
        self.next = self.next.max(end);
        start..self.next
    }

    /// The request finished: every index not yet delivered.
    pub fn finish(&mut self) -> Range<u32> {
        let start = self.next;
        self.next = self.total;
        start..self.total
    }

    /// Token `index` belongs to the reasoning phase (before `</think>`).
    pub fn is_reasoning(&self, index: u32) -> bool {
        index < self.reasoning
    }
}

/// The identity of one response, repeated in each of its chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseMeta {
    /// `chatcmpl-…` or `cmpl-…` (the cluster request id in hex).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// The endpoint answered (sets the `object` type and chunk shape).
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    /// The identity of the response to cluster request `request_id`, created at `created` (Unix s).
    pub fn new(endpoint: Endpoint, request_id: u64, created: u64, model: &str) -> ResponseMeta {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        ResponseMeta { id: format!("{prefix}-{request_id:016x}"), created, model: model.to_string(), endpoint }
    }

    fn object(&self, streaming: bool) -> &'static str {
        match (self.endpoint, streaming) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// A streamed chunk carrying output token `index`. Chat: `delta.reasoning_content` or
/// `delta.content` (the first chunk also carries `role`). Completions: answer tokens in `text`;
/// reasoning tokens arrive with an empty `text` and the token in `reasoning_content`.
pub fn token_chunk(meta: &ResponseMeta, index: u32, reasoning: bool, first: bool) -> Value {
    let text = token_text(index);
    let choice = match meta.endpoint {
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            delta.insert(if reasoning { "reasoning_content" } else { "content" }.into(), json!(text));
            json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": null })
        }
        Endpoint::Completions if reasoning => {
            json!({ "index": 0, "text": "", "reasoning_content": text, "logprobs": null, "finish_reason": null })
        }
        Endpoint::Completions => json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": null }),
    };
    meta.chunk(json!([choice]))
}

/// The last chunk of a choice: no new text, its `finish_reason`.
pub fn finish_chunk(meta: &ResponseMeta, finish_reason: &str) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat => json!({ "index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason }),
        Endpoint::Completions => json!({ "index": 0, "text": "", "logprobs": null, "finish_reason": finish_reason }),
    };
    meta.chunk(json!([choice]))
}

/// Token counts reported as OpenAI `usage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Reasoning tokens (before `</think>`), reported in `completion_tokens_details`.
    pub reasoning_tokens: u32,
    /// Answer tokens.
    pub answer_tokens: u32,
}

impl Usage {
    /// From the finished record (what the cluster actually ran).
    pub fn of(rec: &v1::RequestRecord) -> Usage {
        Usage {
            prompt_tokens: rec.prompt_tokens,
            reasoning_tokens: rec.reasoning_tokens,
            answer_tokens: rec.answer_tokens,
        }
    }

    /// `completion_tokens` counts reasoning and answer tokens, as OpenAI's reasoning models do.
    pub fn to_json(self) -> Value {
        let completion = u64::from(self.reasoning_tokens) + u64::from(self.answer_tokens);
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": completion + u64::from(self.prompt_tokens),
            "completion_tokens_details": { "reasoning_tokens": self.reasoning_tokens },
        })
    }
}

/// The chunk `stream_options.include_usage` asks for: no choices, only `usage`.
pub fn usage_chunk(meta: &ResponseMeta, usage: Usage) -> Value {
    let mut chunk = meta.chunk(json!([]));
    chunk["usage"] = usage.to_json();
    chunk
}

/// What the emulation measured, as the `kvfleet` field of non-streamed responses. The names mean
/// what they mean in `results.json` and the CSVs: `ttft_s` is PASCAL's TTFT, arrival → first
/// *answer* token; `ttfat_s` is end of reasoning → first answer token; `first_token_s` is
/// arrival → first output token of any kind (what an OpenAI client's own TTFT measures).
pub fn kvfleet_extension(rec: &v1::RequestRecord) -> Value {
    let since_arrival = |t: Option<u64>| t.map(|t| t.saturating_sub(rec.arrival_ns) as f64 / 1e9);
    let ttfat = match (rec.reasoning_end_ns, rec.first_answer_token_ns) {
        (Some(end), Some(first)) => Some(first.saturating_sub(end) as f64 / 1e9),
        _ => None,
    };
    json!({
        "request_id": rec.id,
        "placed_on": rec.placed_on,
        "finished_on": rec.finished_on,
        "first_token_s": since_arrival(rec.first_token_ns),
        "ttft_s": since_arrival(rec.first_answer_token_ns),
        "ttfat_s": ttfat,
        "e2e_s": since_arrival(rec.finish_ns),
        "qoe": rec.qoe,
        "preemptions": rec.preemptions,
        "migrations": rec.migrations,
    })
}

/// A whole non-streamed response for `req` once its record `rec` arrived.
pub fn full_response(meta: &ResponseMeta, req: &CompletionRequest, rec: &v1::RequestRecord) -> Value {
    let usage = Usage::of(rec);
    let reasoning = text_of(0..usage.reasoning_tokens);
    let answer = text_of(usage.reasoning_tokens..usage.reasoning_tokens.saturating_add(usage.answer_tokens));
    let choice = match meta.endpoint {
        Endpoint::Chat => json!({
            "index": 0,
            "message": { "role": "assistant", "content": answer, "reasoning_content": reasoning },
            "logprobs": null,
            "finish_reason": req.finish_reason(),
        }),
        Endpoint::Completions => json!({
            "index": 0,
            "text": answer,
            "reasoning_content": reasoning,
            "logprobs": null,
            "finish_reason": req.finish_reason(),
        }),
    };
    json!({
        "id": meta.id,
        "object": meta.object(false),
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage.to_json(),
        "kvfleet": kvfleet_extension(rec),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(endpoint: Endpoint, capped: bool) -> CompletionRequest {
        CompletionRequest {
            endpoint,
            model: "m".into(),
            stream: false,
            include_usage: false,
            prompt_tokens: 10,
            reasoning_tokens: 3,
            answer_tokens: 2,
            capped,
        }
    }

    fn record() -> v1::RequestRecord {
        v1::RequestRecord {
            id: 7,
            arrival_ns: 1_000_000_000,
            prompt_tokens: 10,
            reasoning_tokens: 3,
            answer_tokens: 2,
            first_token_ns: Some(1_500_000_000),
            reasoning_end_ns: Some(1_700_000_000),
            first_answer_token_ns: Some(1_800_000_000),
            ..Default::default()
        }
    }

    #[test]
    fn tracker_delivers_each_index_once_in_order_and_fills_gaps() {
        let mut t = TokenTracker::new(3, 2);
        assert_eq!(t.advance(0, 1), 0..1);
        assert_eq!(t.advance(0, 1), 1..1, "a repeat delivers nothing");
        assert_eq!(t.advance(2, 1), 1..3, "a gap is filled");
        assert!(t.is_reasoning(2) && !t.is_reasoning(3));
        assert_eq!(t.advance(9, 5), 3..5, "clamped to the request's length");
        assert_eq!(t.finish(), 5..5);
        let mut t = TokenTracker::new(3, 2);
        t.advance(0, 2);
        assert_eq!(t.finish(), 2..5, "the final record fills what notifications missed");
    }

    #[test]
    fn token_text_has_one_word_per_token() {
        let text = text_of(0..100);
        assert_eq!(text.split_whitespace().count(), 100);
        assert!(text.starts_with(' '));
    }

    #[test]
    fn chat_chunks_put_reasoning_and_answer_in_their_fields() {
        let meta = ResponseMeta::new(Endpoint::Chat, 0x4000_0000_0000_0001, 5, "m");
        assert_eq!(meta.id, "chatcmpl-4000000000000001");
        let first = token_chunk(&meta, 0, true, true);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["delta"]["reasoning_content"], token_text(0));
        assert!(first["choices"][0]["delta"].get("content").is_none());
        let answer = token_chunk(&meta, 3, false, false);
        assert_eq!(answer["choices"][0]["delta"]["content"], token_text(3));
        assert!(answer["choices"][0]["delta"].get("role").is_none());
        assert!(answer["choices"][0]["finish_reason"].is_null());
        assert_eq!(finish_chunk(&meta, "length")["choices"][0]["finish_reason"], "length");
        let usage = usage_chunk(&meta, Usage { prompt_tokens: 10, reasoning_tokens: 3, answer_tokens: 2 });
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 5);
        assert_eq!(usage["usage"]["total_tokens"], 15);
        assert_eq!(usage["usage"]["completion_tokens_details"]["reasoning_tokens"], 3);
    }

    #[test]
    fn completion_chunks_keep_reasoning_out_of_text() {
        let meta = ResponseMeta::new(Endpoint::Completions, 1, 5, "m");
        assert_eq!(meta.id, "cmpl-0000000000000001");
        let r = token_chunk(&meta, 0, true, true);
        assert_eq!(r["object"], "text_completion");
        assert_eq!(r["choices"][0]["text"], "");
        assert_eq!(r["choices"][0]["reasoning_content"], token_text(0));
        let a = token_chunk(&meta, 4, false, false);
        assert_eq!(a["choices"][0]["text"], token_text(4));
        assert_eq!(finish_chunk(&meta, "stop")["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn full_responses_carry_texts_usage_and_measurements() {
        let chat = full_response(&ResponseMeta::new(Endpoint::Chat, 7, 5, "m"), &req(Endpoint::Chat, false), &record());
        assert_eq!(chat["object"], "chat.completion");
        let msg = &chat["choices"][0]["message"];
        assert_eq!(msg["role"], "assistant");
        assert_eq!(msg["reasoning_content"].as_str().unwrap().split_whitespace().count(), 3);
        assert_eq!(msg["content"].as_str().unwrap().split_whitespace().count(), 2);
        assert_eq!(chat["choices"][0]["finish_reason"], "stop");
        assert_eq!(chat["usage"]["completion_tokens"], 5);
        // One meaning per name, as in results.json: TTFT to the first answer token, TTFAT from
        // the end of reasoning, and the first token of any kind apart.
        assert_eq!(chat["kvfleet"]["first_token_s"], 0.5);
        assert_eq!(chat["kvfleet"]["ttft_s"], 0.8);
        assert!((chat["kvfleet"]["ttfat_s"].as_f64().unwrap() - 0.1).abs() < 1e-9);
        let c = full_response(
            &ResponseMeta::new(Endpoint::Completions, 7, 5, "m"),
            &req(Endpoint::Completions, true),
            &record(),
        );
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["text"], text_of(3..5));
        assert_eq!(c["choices"][0]["finish_reason"], "length");
    }
}
