//! Instance roles for prefill/decode disaggregation: what each instance takes (new prompts, handed
//! off decodes, or both), as the controller assigns them ([`crate::Action::SetRole`]).

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

#[cfg(test)]
mod tests {
    use super::*;

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
