//! The schedule explorer over the engine (crates/idemflow-testrig/src/simulation): seeded
//! schedules of concurrent clients, resumers, operators and faults, each checked, each on the
//! settings it draws (layout, isolation, bodies apart, sealing, a consumer on the engine's pool).
//! One source, every engine: the suite runs seeds 0 to 149 on PostgreSQL (in three parts, side
//! by side, about 45 s each), seeds 0 to 99 on SQLite (two parts) and seeds 0 to 149 on
//! MariaDB (three parts): the same schedules every time. The foreign-only world (a payment and a
//! payout whose phases are all foreign) runs seeds 0 to 99 on Redis (two parts), 0 to 49 on a
//! Redis Cluster of three primaries and 0 to 49 on PostgreSQL.
//! `scripts/simulate` explores any others; `scripts/mutants/run` shows these seeds catch each of
//! the defects they were built against. A failing schedule prints its seed and the command that
//! replays it.

use idemflow_testrig::simulation::Simulation;

/// Runs the schedules `seeds` names, one after another, and fails with every broken one. The
/// engine's own error logs are left off (a schedule's faults make many, all expected; a broken
/// schedule's report holds its whole history), and a broken schedule is printed when it breaks,
/// so the first lines of the output name it.
async fn explore(simulation: &Simulation, seeds: impl IntoIterator<Item = u64>) {
    let mut failed = Vec::new();
    let mut passed = 0;
    let (mut transfers, mut reruns) = (0, 0);
    for seed in seeds {
        let report = simulation.run(seed).await;
        transfers += report.counts.transfers;
        reruns += report.counts.transfer_reruns;
        if report.passed() {
            passed += 1;
        } else {
            println!("{report}");
            failed.push(report);
        }
    }
    println!("{passed} schedule(s) passed, {} broke", failed.len());
    println!("{transfers} contended transfer(s), {reruns} phase run(s) again");
    // The transfers are there to meet the database's refusals: a part whose transfers never did
    // checked nothing about restarts.
    assert!(
        transfers == 0 || reruns > 0,
        "{transfers} contended transfers and not one refused by the database"
    );
    if !failed.is_empty() {
        panic!(
            "{} schedule(s) broke an invariant; replay with: {}",
            failed.len(),
            failed
                .iter()
                .map(|report| report.replay_command())
                .collect::<Vec<_>>()
                .join(" ; ")
        );
    }
}

/// Seeds from `IDEMFLOW_SIM_SEEDS` (`first..last`), for a run by hand.
fn seeds_from_env(default: std::ops::Range<u64>) -> std::ops::Range<u64> {
    std::env::var("IDEMFLOW_SIM_SEEDS")
        .ok()
        .and_then(|range| {
            let (first, last) = range.split_once("..")?;
            Some(first.parse().ok()?..last.parse().ok()?)
        })
        .unwrap_or(default)
}

/// The PostgreSQL engine: seeds 0 to 149, every layout and isolation level the seeds draw.
mod postgres {
    use super::{explore, seeds_from_env};
    use idemflow_testrig::simulation::Simulation;
    use sqlx::PgPool;

    async fn simulation(pool: &PgPool) -> Simulation {
        Simulation::new(pool).await.unwrap()
    }

    #[sqlx::test(migrator = "idemflow::MIGRATOR")]
    async fn schedules_0_to_49(pool: PgPool) {
        explore(&simulation(&pool).await, seeds_from_env(0..50)).await;
    }

    #[sqlx::test(migrator = "idemflow::MIGRATOR")]
    async fn schedules_50_to_99(pool: PgPool) {
        explore(&simulation(&pool).await, seeds_from_env(50..100)).await;
    }

    #[sqlx::test(migrator = "idemflow::MIGRATOR")]
    async fn schedules_100_to_149(pool: PgPool) {
        explore(&simulation(&pool).await, seeds_from_env(100..150)).await;
    }
}

/// The SQLite engine: the same schedules from the same seeds, seeds 0 to 99 (a third of them with
/// a quarter-second busy timeout), each part on a file of its own.
mod sqlite {
    use super::{explore, seeds_from_env};
    use idemflow_testrig::simulation::Simulation;

    async fn simulation(part: &str) -> Simulation {
        let directory = std::env::temp_dir().join(format!("idemflow-simulate-{part}"));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).unwrap();
        Simulation::on_sqlite(&directory.join("idemflow.db"))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn schedules_0_to_49() {
        explore(&simulation("0-to-49").await, seeds_from_env(0..50)).await;
    }

    #[tokio::test]
    async fn schedules_50_to_99() {
        explore(&simulation("50-to-99").await, seeds_from_env(50..100)).await;
    }
}

/// The MySQL/MariaDB engine: the same schedules from the same seeds, seeds 0 to 149 (a third of
/// them with a one-second lock wait timeout), each part on a database of its own.
mod mariadb {
    use super::{explore, seeds_from_env};
    use idemflow_testrig::simulation::Simulation;

    async fn simulation(part: &str) -> Simulation {
        let pool = crate::support::mariadb::fresh(&format!("simulate_{part}")).await;
        Simulation::on_mysql(&pool).await.unwrap()
    }

    #[tokio::test]
    async fn schedules_0_to_49() {
        explore(&simulation("0_to_49").await, seeds_from_env(0..50)).await;
    }

    #[tokio::test]
    async fn schedules_50_to_99() {
        explore(&simulation("50_to_99").await, seeds_from_env(50..100)).await;
    }

    #[tokio::test]
    async fn schedules_100_to_149() {
        explore(&simulation("100_to_149").await, seeds_from_env(100..150)).await;
    }
}

/// The foreign-only world (`simulation::foreign`: a payment and a payout whose phases are all
/// foreign, two tenants sharing key names, impostors, lost rows claimed again under either
/// workflow, closed connections) on Redis, the engine that runs only such workflows: seeds 0 to
/// 99, in two parts. Each schedule's keys live under a prefix of its own.
mod redis {
    use super::{explore, seeds_from_env};
    use idemflow_testrig::simulation::Simulation;

    async fn simulation() -> Simulation {
        let url = crate::support::redis::url();
        Simulation::on_redis(&url).await.unwrap_or_else(|error| {
            panic!("the Redis schedules need a Redis at {url} (REDIS_URL): {error}")
        })
    }

    #[tokio::test]
    async fn schedules_0_to_49() {
        explore(&simulation().await, seeds_from_env(0..50)).await;
    }

    #[tokio::test]
    async fn schedules_50_to_99() {
        explore(&simulation().await, seeds_from_env(50..100)).await;
    }
}

/// The foreign-only world on a Redis Cluster of three primaries and three replicas
/// (`REDIS_CLUSTER_URLS`, started by scripts/test): the same schedules as on one Redis, the
/// store's scripts the same, its keys spread over the primaries by their buckets; the chaos
/// closes the store's connection to every primary. Seeds 0 to 49.
mod redis_cluster {
    use super::{explore, seeds_from_env};
    use idemflow_testrig::simulation::Simulation;

    #[tokio::test]
    async fn schedules_0_to_49() {
        let urls = crate::support::redis::cluster_urls();
        let simulation = Simulation::on_redis(&urls).await.unwrap_or_else(|error| {
            panic!("the Redis Cluster schedules need the cluster at {urls}: {error}")
        });
        explore(&simulation, seeds_from_env(0..50)).await;
    }
}

/// The foreign-only world on PostgreSQL, the reference its Redis schedules are read against:
/// seeds 0 to 49.
mod postgres_foreign {
    use super::{explore, seeds_from_env};
    use idemflow_testrig::simulation::Simulation;

    #[sqlx::test(migrator = "idemflow::MIGRATOR")]
    async fn schedules_0_to_49(pool: sqlx::PgPool) {
        let simulation = Simulation::foreign_on_postgres(&pool).await.unwrap();
        explore(&simulation, seeds_from_env(0..50)).await;
    }
}
