//! What PostgreSQL's `jsonb` cannot store: a string holding U+0000. Requests are refused before
//! their claim for it; phase outputs fail their attempt before anything is written.

use serde_json::Value;

pub(crate) fn holds_nul(value: &Value) -> bool {
    match value {
        Value::String(text) => text.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(members) => members
            .iter()
            .any(|(name, member)| name.contains('\0') || holds_nul(member)),
        _ => false,
    }
}
