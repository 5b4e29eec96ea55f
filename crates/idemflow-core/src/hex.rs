//! Lowercase hex: fingerprints, derived keys past 255 bytes, bytes written into SQL text as
//! `decode('…', 'hex')`, file names. One encoder for all of them.

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// `bytes` as lowercase hex, appended to `out`.
pub fn encode_into(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
}

/// `bytes` as lowercase hex.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    encode_into(&mut out, bytes);
    out
}

/// The bytes of lowercase (or uppercase) hex; `None` for an odd length or a non-hex digit.
pub fn decode(hex: &str) -> Option<Vec<u8>> {
    fn digit(byte: u8) -> Option<u8> {
        char::from(byte)
            .to_digit(16)
            .and_then(|value| u8::try_from(value).ok())
    }
    let bytes = hex.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_lowercase_digits_per_byte() {
        assert_eq!(super::encode(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(super::encode(&[]), "");
    }

    #[test]
    fn decoding_reverses_encoding_and_refuses_what_is_not_hex() {
        let bytes = [0x00, 0x0f, 0xa5, 0xff];
        assert_eq!(
            super::decode(&super::encode(&bytes)).as_deref(),
            Some(&bytes[..])
        );
        assert_eq!(super::decode("0F"), Some(vec![0x0f]));
        assert_eq!(super::decode("abc"), None);
        assert_eq!(super::decode("zz"), None);
    }
}
