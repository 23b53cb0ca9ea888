//! Arrow's profile of this instance, measured by the worker on its own timing model at start-up
//! (`--arrow-slo-tpot-s`) and registered with it, so the leader weighs the instance with what it
//! measures (live GPU kernels under `--timing cuda`) rather than with an estimate of its own.
//!
//! Measured once per (model, GPU, tensor parallelism, timing model, SLO_TPOT) and cached on disk
//! (`--profile-cache`): under live timing every measurement runs kernels, so a restarted worker
//! reads its profile back. A cache file that does not parse, names another key or holds no
//! profile is measured again and rewritten (logged); one that cannot be written is logged and the
//! worker goes on.

use kvfleet_control::arrow::Quadratic;
use kvfleet_control::ArrowProfile;
use kvfleet_core::timing::TimingModel;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// What a profile was measured for: its cache key.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileKey {
    /// Model name.
    pub model: String,
    /// GPU name.
    pub gpu: String,
    /// GPUs the instance spans.
    pub tensor_parallel_size: u32,
    /// The timing model's kind (`--timing`) and, for a measured profile, its directory.
    pub timing: String,
    /// SLO_TPOT, seconds (MT depends on it).
    pub slo_tpot_s: f64,
}

impl ProfileKey {
    /// The cache file's name: the key's fields, every character outside `[A-Za-z0-9._-]` as `_`
    /// (the file holds the key itself, compared on reading).
    fn file_name(&self) -> String {
        let raw = format!(
            "{}-{}-tp{}-{}-tpot{}.json",
            self.model, self.gpu, self.tensor_parallel_size, self.timing, self.slo_tpot_s
        );
        raw.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect()
    }

    /// The file's content. The numbers are strings in Rust's shortest round-trip form (JSON
    /// number parsing need not give back the same `f64`, and a cached profile must be the one
    /// measured, bit for bit).
    fn to_json(&self, p: &ArrowProfile) -> Value {
        let mut v = self.key_fields();
        v.insert("prefill_a".into(), p.prefill.a.to_string().into());
        v.insert("prefill_b".into(), p.prefill.b.to_string().into());
        v.insert("prefill_c".into(), p.prefill.c.to_string().into());
        v.insert("decode_max_tokens".into(), p.decode_max_tokens.into());
        Value::Object(v)
    }

    /// The key's own fields in the file.
    fn key_fields(&self) -> Map<String, Value> {
        let key = json!({
            "model": self.model,
            "gpu": self.gpu,
            "tensor_parallel_size": self.tensor_parallel_size,
            "timing": self.timing,
            "slo_tpot_s": self.slo_tpot_s.to_string(),
        });
        match key {
            Value::Object(m) => m,
            _ => unreachable!("a JSON object literal"),
        }
    }

    /// The profile `v` holds for this key; why not otherwise.
    fn read(&self, v: &Value) -> Result<ArrowProfile, String> {
        if self.key_fields().iter().any(|(f, x)| v.get(f) != Some(x)) {
            return Err("it was measured for another model, GPU, TP, timing or SLO".into());
        }
        let num = |f: &str| {
            let x = v.get(f).and_then(Value::as_str).and_then(|t| t.parse::<f64>().ok());
            x.filter(|x| x.is_finite()).ok_or(format!("no `{f}`"))
        };
        let prefill = Quadratic { a: num("prefill_a")?, b: num("prefill_b")?, c: num("prefill_c")? };
        let decode_max_tokens = v.get("decode_max_tokens").and_then(Value::as_u64).ok_or("no `decode_max_tokens`")?;
        Ok(ArrowProfile { prefill, decode_max_tokens })
    }
}

/// Where a profile came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Measured now (and cached, where a cache directory was given and could be written).
    Measured,
    /// Read from the cache.
    Cached,
}

/// The default cache directory: `$XDG_CACHE_HOME/kvfleet/arrow-profiles`, else
/// `$HOME/.cache/kvfleet/arrow-profiles`; `None` without either.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kvfleet").join("arrow-profiles"))
}

/// Arrow's profile for `key`: from `cache` when it holds one, else measured on `timing` (and
/// written there).
pub fn profile(
    timing: &dyn TimingModel,
    key: &ProfileKey,
    cache: Option<&Path>,
) -> Result<(ArrowProfile, Source), String> {
    let file = cache.map(|dir| dir.join(key.file_name()));
    if let Some(file) = file.as_deref().filter(|f| f.exists()) {
        let read = std::fs::read(file)
            .map_err(|e| e.to_string())
            .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).map_err(|e| e.to_string()))
            .and_then(|v| key.read(&v));
        match read {
            Ok(p) => return Ok((p, Source::Cached)),
            Err(why) => tracing::warn!(file = %file.display(), "Arrow profile cache not used ({why}); measuring again"),
        }
    }
    let measured =
        ArrowProfile::measure(timing, key.slo_tpot_s).map_err(|e| format!("measuring Arrow's profile: {e}"))?;
    if let Some(file) = &file {
        if let Err(e) = write_atomically(file, &key.to_json(&measured)) {
            tracing::warn!(file = %file.display(), error = %e, "Arrow profile not cached");
        }
    }
    Ok((measured, Source::Measured))
}

fn write_atomically(file: &Path, v: &Value) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec_pretty(v).expect("plain data"))?;
    std::fs::rename(&tmp, file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::spec::{GpuSpec, ModelSpec};
    use kvfleet_core::timing::{AnalyticParams, AnalyticTiming};

    fn key(slo: f64) -> ProfileKey {
        ProfileKey {
            model: "qwen3-8b".into(),
            gpu: "h20-141gb".into(),
            tensor_parallel_size: 1,
            timing: "analytic".into(),
            slo_tpot_s: slo,
        }
    }

    fn timing() -> AnalyticTiming {
        let model = ModelSpec::load("qwen3-8b").unwrap();
        let gpu = GpuSpec::load("h20-141gb").unwrap();
        AnalyticTiming::with_tp(&model, &gpu, AnalyticParams::default(), 1).unwrap()
    }

    /// Measured once and written; read back (not measured) next time, even when the file says
    /// something the timing model would not (so the read is what answered); a file for another
    /// SLO, or a corrupt one, is measured again and rewritten.
    #[test]
    fn a_profile_is_measured_once_per_key_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let t = timing();
        let (first, source) = profile(&t, &key(0.15), Some(dir.path())).unwrap();
        assert_eq!(source, Source::Measured);
        assert!(first.prefill.c > 0.0 && first.decode_max_tokens > 0, "{first:?}");
        let file = dir.path().join(key(0.15).file_name());
        assert!(file.exists());
        // Planted: the cache answers.
        let planted = ArrowProfile { prefill: Quadratic { a: 0.0, b: 1e-4, c: 0.5 }, decode_max_tokens: 1234 };
        std::fs::write(&file, serde_json::to_vec(&key(0.15).to_json(&planted)).unwrap()).unwrap();
        assert_eq!(profile(&t, &key(0.15), Some(dir.path())).unwrap(), (planted, Source::Cached));
        // Another SLO: its own file, measured.
        let (other, source) = profile(&t, &key(0.05), Some(dir.path())).unwrap();
        assert_eq!(source, Source::Measured);
        assert!(other.decode_max_tokens < first.decode_max_tokens, "a tighter SLO fits fewer tokens");
        // A file for another key under this key's name, and a corrupt one: measured again.
        std::fs::write(&file, serde_json::to_vec(&key(0.05).to_json(&planted)).unwrap()).unwrap();
        assert_eq!(profile(&t, &key(0.15), Some(dir.path())).unwrap(), (first, Source::Measured));
        std::fs::write(&file, b"{\"model\": ").unwrap();
        assert_eq!(profile(&t, &key(0.15), Some(dir.path())).unwrap(), (first, Source::Measured));
        assert_eq!(profile(&t, &key(0.15), Some(dir.path())).unwrap(), (first, Source::Cached), "rewritten");
        // No cache: measured every time.
        assert_eq!(profile(&t, &key(0.15), None).unwrap(), (first, Source::Measured));
    }

    #[test]
    fn file_names_keep_to_plain_characters() {
        let mut k = key(0.15);
        k.timing = "profile:/data/my profiles".into();
        assert_eq!(k.file_name(), "qwen3-8b-h20-141gb-tp1-profile__data_my_profiles-tpot0.15.json");
    }
}
