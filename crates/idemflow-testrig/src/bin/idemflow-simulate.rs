//! `idemflow-simulate`: runs seeded schedules of the schedule explorer
//! (`idemflow_testrig::simulation`) against a scratch database, and reports the ones that broke an
//! invariant with the command that replays each.
//!
//! ```text
//! idemflow-simulate [--engine postgres|sqlite|mysql|postgres-foreign|redis] [--schedules N] [--seed S] [--verbose]
//! ```
//!
//! On PostgreSQL (the default) it needs `DATABASE_URL` (a server it may create a database on);
//! `scripts/simulate` finds one the way the test suite does. On SQLite it needs nothing: a scratch
//! file in the temporary directory, removed at the end. On MySQL/MariaDB it needs `MARIADB_URL`
//! (default `mysql://root@127.0.0.1:3306/test`), and makes a scratch database there.
//! `postgres-foreign` and `redis` run the foreign-only world (`simulation::foreign`): the first on
//! a scratch PostgreSQL database, the second on the Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`; built with the `redis` feature), each schedule under a prefix of its
//! own. Exit 0 when every schedule passed, 1 when one broke, 2 on bad usage or when the database
//! cannot be reached.

use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use idemflow_testrig::simulation::Simulation;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Executor};

const USAGE: &str =
    "usage: idemflow-simulate [--engine E] [--schedules N] [--seed S] [--verbose] [--history]

  --engine E      postgres (default), sqlite, mysql (MySQL/MariaDB): the checkout world;
                  postgres-foreign or redis: the foreign-only world
  --schedules N   how many schedules to run (default 50)
  --seed S        the first seed (default: one drawn from the clock); schedule i runs seed S+i
  --verbose       print each schedule's line as it ends, and a failing one's whole history
  --history       print every schedule's whole history, passed or not

On postgres, needs DATABASE_URL; creates a scratch database there and drops it at the end.
On sqlite, runs on a scratch file in the temporary directory, removed at the end.
On mysql, needs MARIADB_URL (default mysql://root@127.0.0.1:3306/test); creates a scratch
database there and drops it at the end.
On redis, needs REDIS_URL (default redis://127.0.0.1:6379); each schedule's keys live under
the prefix idemflow-sim:<seed>.";

/// The engine the schedules run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EngineName {
    Postgres,
    Sqlite,
    MySql,
    PostgresForeign,
    Redis,
}

#[derive(Debug)]
struct Args {
    engine: EngineName,
    schedules: u64,
    seed: Option<u64>,
    verbose: bool,
    history: bool,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut parsed = Args {
        engine: EngineName::Postgres,
        schedules: 50,
        seed: None,
        verbose: false,
        history: false,
    };
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<u64, String> {
            let value = args.next().ok_or_else(|| format!("{name} needs a value"))?;
            value
                .parse()
                .map_err(|_| format!("{name} {value}: not a whole number"))
        };
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--schedules" => parsed.schedules = number("--schedules")?,
            "--engine" => match args.next().as_deref() {
                Some("postgres") => parsed.engine = EngineName::Postgres,
                Some("sqlite") => parsed.engine = EngineName::Sqlite,
                Some("mysql" | "mariadb") => parsed.engine = EngineName::MySql,
                Some("postgres-foreign") => parsed.engine = EngineName::PostgresForeign,
                Some("redis") => parsed.engine = EngineName::Redis,
                other => {
                    return Err(format!(
                        "--engine {other:?}: postgres, sqlite, mysql, postgres-foreign or redis"
                    ));
                }
            },
            "--seed" => parsed.seed = Some(number("--seed")?),
            "--verbose" => parsed.verbose = true,
            "--history" => parsed.history = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Some(parsed))
}

/// The schedules' phases panic on purpose (the engine records each as a failed attempt): those
/// are not worth a backtrace each.
fn quiet_scripted_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied());
        let scripted = message.is_some_and(|message| message.starts_with("scripted panic"));
        if !scripted {
            default(info);
        }
    }));
}

#[tokio::main]
async fn main() -> ExitCode {
    quiet_scripted_panics();
    let args = match parse(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(why) => {
            eprintln!("idemflow-simulate: {why}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(why) => {
            eprintln!("idemflow-simulate: {why}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<bool, String> {
    match args.engine {
        EngineName::Sqlite => return run_on_sqlite(args).await,
        EngineName::MySql => return run_on_mysql(args).await,
        EngineName::Redis => return run_on_redis(args).await,
        EngineName::Postgres | EngineName::PostgresForeign => {}
    }
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set".to_owned())?;
    let server =
        PgConnectOptions::from_str(&url).map_err(|error| format!("DATABASE_URL: {error}"))?;
    let scratch = format!(
        "idemflow_simulate_{}_{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs())
    );
    let mut admin = server
        .connect()
        .await
        .map_err(|error| format!("cannot connect to DATABASE_URL: {error}"))?;
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {scratch}")))
        .await
        .map_err(|error| format!("cannot create a scratch database: {error}"))?;
    let result = explore_postgres(&server.clone().database(&scratch), &args).await;
    let _ = admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {scratch} WITH (FORCE)"
        )))
        .await;
    let _ = admin.close().await;
    result
}

/// Runs the schedules on a scratch SQLite file, removed at the end.
async fn run_on_sqlite(args: Args) -> Result<bool, String> {
    let path = std::env::temp_dir().join(format!(
        "idemflow_simulate_{}_{}.db",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs())
    ));
    let simulation = Simulation::on_sqlite(&path)
        .await
        .map_err(|error| format!("preparing the schedules on {}: {error}", path.display()))?;
    let result = explore(&simulation, &args).await;
    drop(simulation);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    result
}

/// Runs the schedules on a scratch database of the MySQL/MariaDB server, dropped at the end.
async fn run_on_mysql(args: Args) -> Result<bool, String> {
    let url = std::env::var("MARIADB_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let server = sqlx::mysql::MySqlConnectOptions::from_str(&url)
        .map_err(|error| format!("MARIADB_URL: {error}"))?;
    let scratch = format!(
        "idemflow_simulate_{}_{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs())
    );
    let mut admin = server
        .connect()
        .await
        .map_err(|error| format!("cannot connect to {url}: {error}"))?;
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {scratch}")))
        .await
        .map_err(|error| format!("cannot create a scratch database: {error}"))?;
    let result = async {
        let pool = idemflow_mysql::pool_options(&idemflow_mysql::OpenOptions::default())
            .connect_with(server.clone().database(&scratch))
            .await
            .map_err(|error| format!("cannot connect to the scratch database: {error}"))?;
        idemflow_mysql::MIGRATOR
            .run(&pool)
            .await
            .map_err(|error| format!("migrating: {error}"))?;
        let simulation = Simulation::on_mysql(&pool)
            .await
            .map_err(|error| format!("preparing the schedules: {error}"))?;
        explore(&simulation, &args).await
    }
    .await;
    let _ = admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {scratch}"
        )))
        .await;
    let _ = admin.close().await;
    result
}

async fn explore_postgres(options: &PgConnectOptions, args: &Args) -> Result<bool, String> {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.clone())
        .await
        .map_err(|error| format!("cannot connect to the scratch database: {error}"))?;
    idemflow_pg::migrate(&pool)
        .await
        .map_err(|error| format!("migrating: {error}"))?;
    let simulation = if args.engine == EngineName::PostgresForeign {
        Simulation::foreign_on_postgres(&pool).await
    } else {
        Simulation::new(&pool).await
    }
    .map_err(|error| format!("preparing the schedules: {error}"))?;
    explore(&simulation, args).await
}

/// Runs the foreign-only world's schedules on the Redis at `REDIS_URL`.
#[cfg(feature = "redis")]
async fn run_on_redis(args: Args) -> Result<bool, String> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let simulation = Simulation::on_redis(&url)
        .await
        .map_err(|error| format!("preparing the schedules: {error}"))?;
    explore(&simulation, &args).await
}

#[cfg(not(feature = "redis"))]
async fn run_on_redis(_: Args) -> Result<bool, String> {
    Err("this idemflow-simulate was built without the redis feature".to_owned())
}

async fn explore(simulation: &Simulation, args: &Args) -> Result<bool, String> {
    let first = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |since| since.as_secs())
    });
    let began = Instant::now();
    let mut failed = Vec::new();
    for seed in first..first.saturating_add(args.schedules) {
        let report = simulation.run(seed).await;
        if args.history {
            println!("{}", report.to_string().lines().next().unwrap_or_default());
            for line in &report.history {
                println!("    {line}");
            }
        } else if args.verbose || !report.passed() {
            println!("{}", report.to_string().lines().next().unwrap_or_default());
        }
        if !report.passed() {
            if args.verbose {
                println!("{report}");
            }
            failed.push(report);
        }
    }
    println!(
        "{} schedules (seeds {first}..{}) in {:.1} s: {} broke an invariant",
        args.schedules,
        first.saturating_add(args.schedules),
        began.elapsed().as_secs_f64(),
        failed.len()
    );
    for report in &failed {
        println!("  seed {}: {}", report.seed, report.violations.join(" | "));
        println!("    replay: {}", report.replay_command());
    }
    Ok(failed.is_empty())
}
