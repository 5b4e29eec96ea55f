//! Where a key lives: its bucket, and the bucket's hash tag.
//!
//! Every key falls in one of [`BUCKETS`] buckets, by a hash of its tenant and key
//! ([`bucket_of`]), and every Redis key of a bucket carries the bucket's hash tag (`{…}` in its
//! name), so Redis Cluster puts all of them in one hash slot: the row, its body apart and the
//! bucket's fence, sets of lease ends, set of finishes, set of workflows, index and hash of leased
//! rows. Each script touches one bucket, so it runs on a cluster as on one Redis, where the tags
//! are part of the names and nothing more.
//!
//! The tags are chosen once for all (a function of [`BUCKETS`] alone, never of the data or the
//! prefix): bucket `b`'s tag is the first `b.n` (`n` = 0, 1, …) whose hash slot lies in the `b`th
//! sixteenth of the slots, so the buckets spread evenly over the slots, and so over the primaries
//! of a cluster that splits its slots evenly (as `redis-cli --cluster create` does).

use std::sync::OnceLock;

/// How many buckets the keys are spread over: the most primaries a cluster can share the keys
/// among, and how many scripts a scan of every bucket runs (the resumer's, retention's, the
/// console's). Part of the layout: changing it moves every key.
pub const BUCKETS: u16 = 16;

/// Redis Cluster's hash slots.
const SLOTS: u16 = 16384;

/// CRC16 (XMODEM: polynomial 0x1021, no reflection, initial value 0), which Redis Cluster maps
/// a key's hash tag to a slot with.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash slot of a hash tag's text (what is between the braces).
pub fn slot(tag: &str) -> u16 {
    crc16(tag.as_bytes()) % SLOTS
}

/// Bucket `bucket`'s hash tag, braces included: `{b.n}`.
pub fn tag(bucket: u16) -> &'static str {
    static TAGS: OnceLock<Vec<String>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let width = SLOTS / BUCKETS;
        (0..BUCKETS)
            .map(|bucket| {
                let wanted = bucket * width..(bucket + 1) * width;
                (0u32..)
                    .map(|n| format!("{bucket}.{n}"))
                    .find(|text| wanted.contains(&slot(text)))
                    .map(|text| format!("{{{text}}}"))
                    .unwrap_or_default()
            })
            .collect()
    });
    &tags[usize::from(bucket % BUCKETS)]
}

/// The hash slot of bucket `bucket`'s keys.
pub fn bucket_slot(bucket: u16) -> u16 {
    let tag = tag(bucket);
    slot(&tag[1..tag.len() - 1])
}

/// The bucket of a tenant's key: FNV-1a (64 bits) of the tenant and the key in hex, joined by
/// `:`, modulo [`BUCKETS`].
pub fn bucket_of(tenant: &str, key: &str) -> u16 {
    let text = format!(
        "{}:{}",
        idemflow_core::hex::encode(tenant.as_bytes()),
        idemflow_core::hex::encode(key.as_bytes())
    );
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in text.as_bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    u16::try_from(hash % u64::from(BUCKETS)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_clusters_slots_are_computed_as_redis_does() {
        // CLUSTER KEYSLOT's answers on Redis 7.0.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("123456789"), 12739);
        assert_eq!(slot(""), 0);
    }

    #[test]
    fn each_buckets_tag_lies_in_its_own_sixteenth_of_the_slots() {
        for bucket in 0..BUCKETS {
            let tag = tag(bucket);
            let inner = &tag[1..tag.len() - 1];
            assert_eq!(slot(inner) / (SLOTS / BUCKETS), bucket, "{tag}");
        }
    }

    #[test]
    fn keys_spread_over_every_bucket() {
        let mut counts = [0u32; BUCKETS as usize];
        for key in 0..1600 {
            counts[usize::from(bucket_of("tenant", &format!("key-{key}")))] += 1;
        }
        assert!(
            counts.iter().all(|count| (60..=140).contains(count)),
            "{counts:?}"
        );
    }
}
