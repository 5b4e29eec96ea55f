//! Chained setters for the configuration structs of the idemflow crates.
//!
//! Those structs are `#[non_exhaustive]`, so that a setting added later breaks no caller: outside
//! their crate they cannot be built with a struct literal. They are built from `default()` (or a
//! named constructor) and adjusted with `with_<field>(value)`, one method per public field, or by
//! assigning the public field of a `let mut` binding.

/// Implements `with_<field>(value) -> Self` for each listed public field of a struct. Internal to
/// the idemflow crates; not part of this crate's API.
#[doc(hidden)]
#[macro_export]
macro_rules! with_setters {
    ($type:ident { $($setter:ident => $field:ident: $value:ty),* $(,)? }) => {
        impl $type {
            $(
                #[doc = concat!("Sets [`", stringify!($field), "`](Self::", stringify!($field), ").")]
                #[must_use]
                pub fn $setter(mut self, $field: $value) -> Self {
                    self.$field = $field;
                    self
                }
            )*
        }
    };
}
