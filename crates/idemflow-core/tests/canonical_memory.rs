//! Peak memory of canonicalizing a 1 MiB body, counted by a global allocator (bytes requested
//! from the allocator, not pages): what one body costs above what the process held before it,
//! canonical output included. A body of many small values is the hard case: a tree of parsed
//! values costs tens of bytes a value, whatever the value's size in the text (a `0,` is two
//! bytes). Its own binary, and one test: the counter is the process's.
#![allow(clippy::unwrap_used)]

use idemflow_core::{canonicalize, canonicalize_exact, canonicalize_request};
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOCATOR: PeakAlloc = PeakAlloc;

const MIB: usize = 1024 * 1024;

/// `[item,item,…]` of about `size` bytes.
fn array_of(item: &str, size: usize) -> Vec<u8> {
    let count = (size - 2) / (item.len() + 1);
    let mut body = String::with_capacity(size);
    body.push('[');
    for index in 0..count {
        if index > 0 {
            body.push(',');
        }
        body.push_str(item);
    }
    body.push(']');
    body.into_bytes()
}

/// One object of about `size` bytes with short keys, written in reverse canonical order.
fn object_of_small_members(size: usize) -> Vec<u8> {
    let mut members = Vec::new();
    let mut length = 2;
    let mut index = 0u32;
    while length < size - 16 {
        let member = format!("\"{index:x}\":{}", index % 10);
        length += member.len() + 1;
        members.push(member);
        index += 1;
    }
    members.sort();
    members.reverse();
    format!("{{{}}}", members.join(",")).into_bytes()
}

/// Peak bytes held above the level before `run`, while it ran.
fn peak_of(run: impl FnOnce()) -> usize {
    ALLOCATOR.reset_peak_usage();
    let before = ALLOCATOR.current_usage();
    run();
    ALLOCATOR.peak_usage().saturating_sub(before)
}

#[test]
fn a_body_of_small_values_costs_a_few_times_its_size() {
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("[0,0,…]", array_of("0", MIB)),
        (
            "[{},[],\"\",true,null,…]",
            array_of("{},[],\"\",true,null", MIB),
        ),
        (
            "[{\"a\":1,\"b\":[true]},…]",
            array_of("{\"b\":[true],\"a\":1}", MIB),
        ),
        ("{\"ffff\":5,…,\"0\":0}", object_of_small_members(MIB)),
        ("[\"\\u00e9\",…]", array_of("\"\\u00e9\"", MIB)),
        // The output is longer than the text here (1e20 is written out in 21 digits).
        ("[1e20,…]", array_of("1e20", MIB)),
    ];
    let mut worst = 0.0f64;
    for (shape, body) in &bodies {
        let size = body.len();
        let ratio = |peak: usize| peak as f64 / size as f64;
        let exact = peak_of(|| drop(canonicalize_exact(body).unwrap()));
        let rounded = peak_of(|| drop(canonicalize(body).unwrap()));
        let request = peak_of(|| drop(canonicalize_request(body).unwrap()));
        println!(
            "{shape:<28} {:>5.2} MiB: canonicalize_exact {:>5.2}x, canonicalize {:>5.2}x, \
             canonicalize_request (with its serde_json value) {:>5.2}x",
            size as f64 / MIB as f64,
            ratio(exact),
            ratio(rounded),
            ratio(request),
        );
        worst = worst.max(ratio(exact)).max(ratio(rounded));
    }
    // What the HTTP layer and the fingerprint pay: the canonical bytes and little else.
    assert!(worst < 8.0, "canonicalizing cost {worst:.2}x a body's size");
}
