//! `idemflow`, the operator CLI (the `cli` feature): the engines this build's features name, handed
//! to the engine-blind command line (`idemflow-cli`). See docs/cli.md.

use std::process::ExitCode;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    idemflow_cli::main(&idemflow::operator::engines()).await
}
