//! Writing HTML by hand, safely: every value from the database or the request goes through
//! [`escape`] (or [`attr`] in an attribute, [`url`] in a link's query), and the page frame is one
//! function, so a view is a string of its own parts only.

use std::fmt::Write as _;

/// `text` safe between tags and inside double-quoted attributes.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for character in text.chars() {
        match character {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Control characters are shown, not passed to the page (a key is printable ASCII,
            // but an error text or a stored body may hold anything).
            c if c.is_control() && c != '\n' && c != '\t' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// `text` percent-encoded for a query string value (RFC 3986 unreserved characters kept).
pub fn url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// A link to `path` (relative to the console's root) with `query` pairs, encoded.
pub fn link(base: &str, path: &str, query: &[(&str, &str)]) -> String {
    let mut out = format!("{base}/{path}");
    for (index, (name, value)) in query.iter().enumerate() {
        out.push(if index == 0 { '?' } else { '&' });
        out.push_str(name);
        out.push('=');
        out.push_str(&url(value));
    }
    out
}

/// The same as [`escape`]: named for where it is used.
pub fn attr(text: &str) -> String {
    escape(text)
}

/// A whole page: the frame (title, navigation, engine, read-only badge) around `body`.
pub fn page(frame: &Frame<'_>, title: &str, body: &str) -> String {
    // The mount prefix is the request's path (or what the application's layers made of it), so
    // it is escaped like any other value.
    let base = attr(frame.base);
    // The overview is the mount point itself: `/ops` when nested there (axum matches a nested
    // root without the trailing slash), `/` at the root.
    let home = if base.is_empty() { "/" } else { base.as_str() };
    let mode = if frame.read_only {
        r#"<span class="badge read-only" id="read-only">read-only</span>"#
    } else {
        ""
    };
    let who = frame
        .principal
        .map(|name| format!(r#"<span class="who">{}</span>"#, escape(name)))
        .unwrap_or_default();
    format!(
        r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · idemflow</title>
<link rel="stylesheet" href="{base}/assets/console.css">
<script src="{base}/assets/console.js" defer></script>
</head>
<body>
<header>
<a class="brand" href="{home}">idemflow</a>
<nav><a href="{home}">Overview</a><a href="{base}/keys">Search</a><a href="{base}/stuck">Stuck</a></nav>
<span class="engine">{engine}</span>{mode}{who}
</header>
<main>
<h1>{title}</h1>
{body}
</main>
</body>
</html>
"#,
        title = escape(title),
        engine = escape(frame.engine),
    )
}

/// What every page's frame shows.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// The path the console is mounted under (`""` at the root), for links.
    pub base: &'a str,
    /// The engine's name.
    pub engine: &'a str,
    /// Whether the console refuses actions.
    pub read_only: bool,
    /// Who is signed in, when the application's layers said.
    pub principal: Option<&'a str>,
}

/// Milliseconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS.mmm UTC`.
pub fn timestamp(ms: i64) -> String {
    let seconds = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = seconds.div_euclid(86_400);
    let of_day = seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{millis:03} UTC",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

/// The proleptic Gregorian date of a day count from 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A duration in milliseconds as a short human figure: `850 ms`, `12 s`, `3 min 4 s`, `2 h 5 min`.
pub fn duration_ms(ms: i64) -> String {
    let ms = ms.abs();
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{} s", ms / 1000),
        60_000..3_600_000 => format!("{} min {} s", ms / 60_000, ms % 60_000 / 1000),
        86_400_000.. => format!("{} d {} h", ms / 86_400_000, ms % 86_400_000 / 3_600_000),
        _ => format!("{} h {} min", ms / 3_600_000, ms % 3_600_000 / 60_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_and_controls_are_escaped() {
        assert_eq!(
            escape("<script>\"x\"&'y'\u{1b}[2J"),
            "&lt;script&gt;&quot;x&quot;&amp;&#39;y&#39;\\u{1b}[2J"
        );
    }

    #[test]
    fn a_mount_prefix_cannot_write_markup() {
        let frame = Frame {
            base: "/ops\"><script>alert(1)</script><a b=\"",
            engine: "PostgreSQL",
            read_only: false,
            principal: None,
        };
        let html = page(&frame, "Overview", "");
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(
            html.contains(
                r#"href="/ops&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;&lt;a b=&quot;/keys""#
            ),
            "{html}"
        );
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(url("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
        assert_eq!(
            link("/ops", "key", &[("tenant", "t 1"), ("key", "k&")]),
            "/ops/key?tenant=t%201&key=k%26"
        );
    }

    #[test]
    fn timestamps_are_utc_dates() {
        assert_eq!(timestamp(0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(timestamp(1_796_300_000_123), "2026-12-03 12:13:20.123 UTC");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29 00:00:00.000 UTC");
    }

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(duration_ms(850), "850 ms");
        assert_eq!(duration_ms(12_400), "12 s");
        assert_eq!(duration_ms(184_000), "3 min 4 s");
        assert_eq!(duration_ms(7_500_000), "2 h 5 min");
        assert_eq!(duration_ms(-90_000), "1 min 30 s");
    }
}
