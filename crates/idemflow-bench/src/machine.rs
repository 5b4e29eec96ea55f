//! The machine a run measured on: CPUs, memory, kernel, the server's settings, and the load
//! average (other work on the machine), read as each workload begins.

use crate::Error;
use crate::db::{Scratch, server_facts};
use crate::report::Machine;

/// The 1, 5 and 15 minute load averages, where /proc says them.
pub fn load_average() -> Option<String> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(
        text.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
    )
}

/// This machine and the server behind `scratch`; pgbench's version is filled in by the pgbench
/// workload, the load averages at the start and end by the caller.
pub async fn describe(scratch: &Scratch) -> Result<Machine, Error> {
    Ok(Machine {
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model: proc_field("/proc/cpuinfo", "model name")
            .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned()),
        memory_gib: proc_field("/proc/meminfo", "MemTotal:")
            .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
            .map(|kib| kib / 1024.0 / 1024.0),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|text| text.trim().to_owned()),
        load_average_start: None,
        load_average_end: None,
        postgres: server_facts(scratch).await?,
        pg_stat_statements: scratch
            .statements_unavailable
            .clone()
            .map_or("available".to_owned(), |why| format!("unavailable: {why}")),
        pgbench: None,
    })
}

/// The rest of the first line of `file` that starts with `prefix`.
fn proc_field(file: &str, prefix: &str) -> Option<String> {
    std::fs::read_to_string(file)
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .map(str::to_owned)
}
