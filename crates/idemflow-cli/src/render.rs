//! Plain-text layout: aligned label/value lists and tables, no colours, and no control characters
//! from the database reaching the terminal.

/// Text from the database (a last error, a workflow name) made safe to print: control characters
/// (newlines, escape sequences) are shown escaped, so one value stays on one line and cannot
/// drive the terminal.
pub fn plain(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Shortens `text` to at most `max` characters, marking the cut with `...`.
pub fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let kept: String = text.chars().take(max.saturating_sub(3)).collect();
        format!("{kept}...")
    }
}

fn width(text: &str) -> usize {
    text.chars().count()
}

/// One `label  value` line per field, the values aligned.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let label_width = pairs
        .iter()
        .map(|(label, _)| width(label))
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (label, value) in pairs {
        let line = format!("{label:<label_width$}  {value}");
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A table: a header line, then one line per row, columns aligned and separated by two spaces.
/// The last column is not padded, so no line ends in spaces.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|header| width(header)).collect();
    for row in rows {
        for (column, cell) in row.iter().enumerate() {
            if let Some(width_so_far) = widths.get_mut(column) {
                *width_so_far = (*width_so_far).max(width(cell));
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (column, cell) in cells.enumerate() {
            if column > 0 {
                text.push_str("  ");
            }
            let pad = widths.get(column).copied().unwrap_or(0);
            text.push_str(&format!("{cell:<pad$}"));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(plain("timeout"), "timeout");
        assert_eq!(plain("two\nlines\t\u{1b}[31m"), "two\\nlines\\t\\u{1b}[31m");
        assert_eq!(plain("café"), "café");
    }

    #[test]
    fn truncation_marks_the_cut() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("exactly 10", 10), "exactly 10");
        assert_eq!(truncate("a bit too long", 10), "a bit t...");
    }

    #[test]
    fn fields_align_their_values() {
        assert_eq!(
            fields(&[
                ("state", "done".to_owned()),
                ("recovery point", String::new())
            ]),
            "state           done\nrecovery point\n"
        );
    }

    #[test]
    fn tables_align_columns_without_trailing_spaces() {
        let rows = vec![
            vec!["acme".to_owned(), "order-10".to_owned(), "x".to_owned()],
            vec!["a".to_owned(), "k".to_owned(), String::new()],
        ];
        assert_eq!(
            table(&["TENANT", "KEY", "NOTE"], &rows),
            "TENANT  KEY       NOTE\nacme    order-10  x\na       k\n"
        );
    }
}
