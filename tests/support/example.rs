//! Running the checkout example's binary from a test.

use std::path::PathBuf;
use std::process::Command;

use sqlx::postgres::PgConnectOptions;

/// Builds the example (examples get no `CARGO_BIN_EXE_*`) and returns its path, next to this
/// test binary's target directory (`<target>/<profile>/deps/<this test>`), so `CARGO_TARGET_DIR`
/// and the profile are respected.
pub fn example_binary() -> PathBuf {
    let test_binary = std::env::current_exe().unwrap();
    let profile_dir = test_binary
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(name) => name.to_owned(),
    };
    let target_dir = profile_dir.parent().unwrap();
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--example", "checkout", "--profile"])
        .arg(&profile)
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "building the checkout example failed");
    profile_dir
        .join("examples")
        .join(format!("checkout{}", std::env::consts::EXE_SUFFIX))
}

/// The URL of the test's own database; the password, if any, comes from `DATABASE_URL` (the
/// connect options do not give it back).
pub fn database_url(connect: &PgConnectOptions) -> String {
    let password = std::env::var("DATABASE_URL").ok().and_then(|url| {
        let (_, rest) = url.split_once("://")?;
        let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
        let (user_info, _) = authority.rsplit_once('@')?;
        let (_, password) = user_info.split_once(':')?;
        Some(password.to_owned())
    });
    let user = match password {
        Some(password) => format!("{}:{password}", connect.get_username()),
        None => connect.get_username().to_owned(),
    };
    format!(
        "postgres://{user}@{}:{}/{}",
        connect.get_host(),
        connect.get_port(),
        connect.get_database().unwrap()
    )
}
