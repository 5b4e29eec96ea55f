//! The migrations are embedded at compile time (`sqlx::migrate!`): a migration added or changed
//! must rebuild the crate.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
