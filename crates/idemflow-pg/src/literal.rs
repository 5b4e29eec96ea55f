//! Values written into SQL text, for the messages that must travel in PostgreSQL's simple query
//! protocol (several statements in one message, so no bind parameters): the claim with its
//! `BEGIN`, a fenced write with its `COMMIT`. Only hex digits and integers formatted here ever
//! enter the text, whatever the value holds.

/// `convert_from(decode('<hex>', 'hex'), 'UTF8')`: text whose bytes never reach the SQL parser.
pub(crate) fn text(sql: &mut String, text: &str) {
    sql.push_str("convert_from(");
    bytes(sql, text.as_bytes());
    sql.push_str(", 'UTF8')");
}

/// `decode('<hex>', 'hex')`.
pub(crate) fn bytes(sql: &mut String, bytes: &[u8]) {
    sql.push_str("decode('");
    idemflow_core::hex::encode_into(sql, bytes);
    sql.push_str("', 'hex')");
}

/// [`text`] as an expression of its own.
pub(crate) fn text_expression(value: &str) -> String {
    let mut sql = String::with_capacity(32 + 2 * value.len());
    text(&mut sql, value);
    sql
}

/// [`bytes`] as an expression of its own.
pub(crate) fn bytes_expression(value: &[u8]) -> String {
    let mut sql = String::with_capacity(24 + 2 * value.len());
    bytes(&mut sql, value);
    sql
}
