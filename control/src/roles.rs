//! Instance roles for prefill/decode disaggregation: what each instance takes (new prompts, handed
//! off decodes, or both), as the controller assigns them ([`crate::Action::SetRole`]).

use crate::arrow::ArrowParams;
use serde::{Deserialize, Serialize};

/// What an instance serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefills new requests, then hands each off to a decode instance after its first token.
    Prefill,
    /// Decodes requests handed off by prefill instances; takes no new request.
    Decode,
    /// Both, as an aggregated instance does (the default: no disaggregation).
    #[default]
    Mixed,
    /// A decode instance that also takes at most one prefill at a time.
    Convertible,
    /// Idle, in reserve: takes nothing.
    Standby,
}

impl Role {
    /// Whether new requests may be placed here.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Mixed | Role::Convertible)
    }

    /// Whether handed-off requests may decode here.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Mixed | Role::Convertible)
    }

    /// Whether requests stop after their prefill here, held for a handoff.
    pub fn hands_off(self) -> bool {
        self == Role::Prefill
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Mixed => "mixed",
            Role::Convertible => "convertible",
            Role::Standby => "standby",
        })
    }
}

/// Prefill/decode disaggregation: the first `prefill_instances` instances prefill new requests
/// and hand each off, after its first token, to one of the others, which decode (the handoff is a
/// live migration of the request's KV over the fabric). With `policy = "arrow"` that
/// split is where Arrow starts: it places prefills and handoffs by its SLO-aware rule and flips
/// instances between the pools as their loads change (`[pd.arrow]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PdConfig {
    /// Prefill instances (0: no disaggregation).
    pub prefill_instances: u32,
    /// How prefills and handoffs are placed and whether roles change.
    pub policy: PdPolicy,
    /// Arrow's knobs (`policy = "arrow"`).
    #[serde(skip_serializing_if = "is_default_arrow")]
    pub arrow: ArrowParams,
    /// When a handoff starts: after the prefill (`none`), as soon as a chunked prefill's first
    /// chunk is written (`chunk`), so each chunk's KV crosses while the next computes, or when the
    /// prefill starts (`layer`), so each layer group's KV crosses while the next computes.
    pub overlap: Overlap,
    /// Which requests are split into a prefill and a decode placed apart (absent: `always`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disaggregate: Option<Disaggregate>,
    /// `disaggregate = "prefix-threshold"`: the shortest prompt handed off (tokens; absent: 512).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_prompt_tokens: Option<u32>,
    /// Who waits when every decode instance is full: the held request, for one with room
    /// (`pull`), or the decoder's PREPARE refusals, retried (`push`).
    #[serde(skip_serializing_if = "HandoffMode::is_pull")]
    pub handoff: HandoffMode,
}

/// How a handoff finds a decode instance with room ([`PdConfig::handoff`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HandoffMode {
    /// Arrow's: the held request waits (q2) until a decode instance reports room for it, and
    /// only then is its KV copied (the decoder reserves its blocks first).
    #[default]
    Pull,
    /// Ours: the handoff goes to the decoder the policy picks, full or not; a full one refuses
    /// the PREPARE, the prefill instance keeps the KV, and the handoff is tried on the next
    /// decoder after [`PUSH_RETRY`] (round the pool, over and over: never dropped).
    Push,
}

impl HandoffMode {
    /// Whether this is the default, `pull`.
    pub fn is_pull(&self) -> bool {
        *self == HandoffMode::Pull
    }

    /// Its name in a config.
    pub fn name(self) -> &'static str {
        match self {
            HandoffMode::Pull => "pull",
            HandoffMode::Push => "push",
        }
    }
}

/// How long a pushed handoff a decoder refused waits before it is tried on the next (ours).
pub const PUSH_RETRY: kvfleet_core::TimeSpan = kvfleet_core::TimeSpan(50_000_000);

/// Which requests are disaggregated: their decode placed apart from their prefill
/// ([`PdConfig::disaggregate`]). A request not disaggregated decodes where it was prefilled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disaggregate {
    /// Every request (under Arrow, a request still decodes where it was prefilled when that
    /// instance decodes now: Arrow's own rule).
    #[default]
    Always,
    /// None: every request decodes on the instance that prefilled it.
    Never,
    /// Requests whose prompt has at least `min_prompt_tokens` tokens (512 unless set; ours):
    /// a short prompt's KV is not worth a copy.
    PrefixThreshold,
}

impl Disaggregate {
    /// Its name in a config.
    pub fn name(self) -> &'static str {
        match self {
            Disaggregate::Always => "always",
            Disaggregate::Never => "never",
            Disaggregate::PrefixThreshold => "prefix-threshold",
        }
    }
}

/// `min_prompt_tokens` when not set.
pub const DEFAULT_MIN_PROMPT_TOKENS: u32 = 512;

/// When a prefill/decode handoff starts ([`PdConfig::overlap`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlap {
    /// One-shot: the decode instance is chosen, and the KV copied, once the prefill produced its
    /// first token.
    #[default]
    None,
    /// The decode instance is chosen when the first chunk of a chunked prefill is written, and
    /// the migration follows the prefill: every full block leaves as soon as a chunk writes it;
    /// what is exposed after the first token is the last chunk's KV. A prefill of one chunk is
    /// handed off one-shot.
    Chunk,
    /// The decode instance is chosen when the prefill's first iteration starts, and the
    /// migration follows the prefill layer by layer: as each iteration computes a quarter of the
    /// model's layers, that layer group of the blocks it fills leaves; what is exposed after the
    /// first token is the last layer group of the last iteration's blocks (and its partial
    /// block). Works with and without chunked prefill.
    Layer,
}

impl Overlap {
    /// Whether handoffs start before the prefill ends.
    pub fn overlaps(self) -> bool {
        self != Overlap::None
    }
}

/// Who places prefills and handoffs under disaggregation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PdPolicy {
    /// Roles never change: prefills by `[scheduler] policy` among the prefill instances, each
    /// handoff to the decode instance with the least KV and room for it.
    #[default]
    Static,
    /// Arrow: SLO-aware placement of prefills and handoffs, and role flips.
    Arrow,
}

fn is_default_arrow(p: &ArrowParams) -> bool {
    *p == ArrowParams::default()
}

impl PdConfig {
    /// No disaggregation.
    pub fn is_off(&self) -> bool {
        self.prefill_instances == 0
    }

    /// Checks what can be checked for a cluster of `instances`; the error names the field.
    pub fn validate(&self, instances: u32) -> Result<(), String> {
        if self.prefill_instances >= instances && !self.is_off() {
            return Err(format!(
                "`pd.prefill_instances` must leave at least one decode instance: {} of {} instances",
                self.prefill_instances, instances
            ));
        }
        if self.overlap != Overlap::None && self.is_off() {
            return Err(
                "`pd.overlap` overlaps handoffs with prefills: it needs `pd.prefill_instances` of at least 1".into()
            );
        }
        if self.disaggregate.is_some() && self.is_off() {
            return Err(format!(
                "`pd.disaggregate = \"{}\"` needs a prefill instance to hand requests off from: set `pd.prefill_instances` of at least 1",
                self.disaggregation().name()
            ));
        }
        if self.handoff != HandoffMode::Pull && self.is_off() {
            return Err(format!(
                "`pd.handoff = \"{}\"` needs a prefill instance to hand requests off from: set `pd.prefill_instances` of at least 1",
                self.handoff.name()
            ));
        }
        if self.min_prompt_tokens.is_some() && self.disaggregation() != Disaggregate::PrefixThreshold {
            return Err("`pd.min_prompt_tokens` is used only with `pd.disaggregate = \"prefix-threshold\"`".into());
        }
        if self.policy == PdPolicy::Arrow {
            if self.is_off() {
                return Err(
                    "`pd.policy = \"arrow\"` needs `pd.prefill_instances` (its initial prefill pool) of at least 1"
                        .into(),
                );
            }
            self.arrow.validate().map_err(|e| format!("[pd.arrow] {e}"))?;
        }
        Ok(())
    }

    /// Which requests are disaggregated (`always` unless set).
    pub fn disaggregation(&self) -> Disaggregate {
        self.disaggregate.unwrap_or_default()
    }

    /// Whether a request with a prompt of `prompt_tokens` is handed off after its prefill (else it
    /// decodes where it was prefilled).
    pub fn hands_off(&self, prompt_tokens: u32) -> bool {
        match self.disaggregation() {
            Disaggregate::Always => true,
            Disaggregate::Never => false,
            Disaggregate::PrefixThreshold => {
                prompt_tokens >= self.min_prompt_tokens.unwrap_or(DEFAULT_MIN_PROMPT_TOKENS)
            }
        }
    }

    /// The role of instance `instance` in the initial split: the first `prefill_instances`
    /// prefill, every other decodes (every one is [`Role::Mixed`] when off).
    pub fn initial_role(&self, instance: u32) -> Role {
        if self.is_off() {
            Role::Mixed
        } else if instance < self.prefill_instances {
            Role::Prefill
        } else {
            Role::Decode
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which prompts each rule hands off, and the configs that cannot work named by field.
    #[test]
    fn the_disaggregation_rule_decides_by_prompt_length() {
        let pd = |d: Option<Disaggregate>, min: Option<u32>| PdConfig {
            prefill_instances: 1,
            disaggregate: d,
            min_prompt_tokens: min,
            ..PdConfig::default()
        };
        // (rule, threshold, prompt, handed off)
        let table = [
            (None, None, 1, true),
            (Some(Disaggregate::Always), None, 1, true),
            (Some(Disaggregate::Never), None, 100_000, false),
            (Some(Disaggregate::PrefixThreshold), None, 511, false),
            (Some(Disaggregate::PrefixThreshold), None, 512, true),
            (Some(Disaggregate::PrefixThreshold), Some(2048), 2047, false),
            (Some(Disaggregate::PrefixThreshold), Some(2048), 2048, true),
        ];
        for (d, min, prompt, want) in table {
            let c = pd(d, min);
            assert_eq!(c.validate(4), Ok(()));
            assert_eq!(c.hands_off(prompt), want, "{d:?} {min:?} {prompt}");
        }
        let off = PdConfig { prefill_instances: 0, ..pd(Some(Disaggregate::Always), None) };
        assert!(off.validate(4).unwrap_err().starts_with("`pd.disaggregate = \"always\"` needs a prefill instance"));
        let pushed_off = PdConfig { prefill_instances: 0, handoff: HandoffMode::Push, ..PdConfig::default() };
        assert!(pushed_off.validate(4).unwrap_err().starts_with("`pd.handoff = \"push\"` needs a prefill instance"));
        let parsed: PdConfig = serde_json::from_str(r#"{"prefill_instances": 1, "handoff": "push"}"#).unwrap();
        assert_eq!((parsed.handoff, parsed.validate(2)), (HandoffMode::Push, Ok(())));
        assert!(serde_json::from_str::<PdConfig>(r#"{"handoff": "shove"}"#).is_err());
        let stray = pd(None, Some(100));
        assert!(stray.validate(4).unwrap_err().starts_with("`pd.min_prompt_tokens` is used only with"));
        let parsed: PdConfig = serde_json::from_str(
            r#"{"prefill_instances": 2, "disaggregate": "prefix-threshold", "min_prompt_tokens": 1024}"#,
        )
        .unwrap();
        assert_eq!(
            (parsed.disaggregation(), parsed.hands_off(1023), parsed.hands_off(1024)),
            (Disaggregate::PrefixThreshold, false, true)
        );
        assert!(serde_json::from_str::<PdConfig>(r#"{"disaggregate": "sometimes"}"#).is_err());
    }

    #[test]
    fn roles_name_what_they_take() {
        // (role, prefills, decodes, hands off, name)
        let table = [
            (Role::Prefill, true, false, true, "prefill"),
            (Role::Decode, false, true, false, "decode"),
            (Role::Mixed, true, true, false, "mixed"),
            (Role::Convertible, true, true, false, "convertible"),
            (Role::Standby, false, false, false, "standby"),
        ];
        for (role, prefills, decodes, hands_off, name) in table {
            assert_eq!((role.prefills(), role.decodes(), role.hands_off()), (prefills, decodes, hands_off), "{role}");
            assert_eq!(role.to_string(), name);
            assert_eq!(serde_json::to_string(&role).unwrap(), format!("\"{name}\""));
        }
    }
}
