//! A one-phase-after-a-call workflow answering with a body of the requested size, for the tests
//! of where responses are stored (tests/it/large_responses.rs, tests/it/partitions.rs).

use idemflow::PgStore;
use idemflow::{
    CrashHook, CrashPoint, DerivedKey, ForeignPhase, Key, LocalPhase, PhaseContext, PhaseError,
    StoredResponse, Workflow,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub bytes: usize,
}

/// Answers with a body of the requested size, bytes that vary with position (so a body cut,
/// shifted or compressed wrongly would show), and records that it ran.
pub struct Render;

#[async_trait::async_trait]
impl LocalPhase<PgStore> for Render {
    const NAME: &'static str = "render";
    type Input = Report;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut PgConnection,
        input: Report,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        sqlx::query("INSERT INTO renders (key) VALUES ($1)")
            .bind(context.key.as_str())
            .execute(&mut *connection)
            .await?;
        Ok(StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), "application/octet-stream".into())],
            body: body_of(input.bytes),
        })
    }
}

pub fn body_of(bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i * 31 % 251) as u8).collect()
}

/// Stands for a call to another system before the render, so the claim commits on its own and a
/// crash at the finish leaves a started key for the resumer.
pub struct Fetch;

#[async_trait::async_trait]
impl ForeignPhase for Fetch {
    const NAME: &'static str = "fetch";
    type Input = Report;
    type Output = Report;

    async fn call(
        &self,
        _: &DerivedKey,
        input: Report,
        _: &PhaseContext,
    ) -> Result<Report, PhaseError> {
        Ok(input)
    }
}

pub fn workflow() -> Workflow<PgStore> {
    Workflow::builder::<Report>("report.v1")
        .foreign(Fetch)
        .local(Render)
        .build()
        .unwrap()
}

pub async fn setup(pool: &PgPool) {
    sqlx::query("CREATE TABLE renders (key text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

/// Stops a run just before the transaction that stores the response commits.
#[derive(Debug)]
pub struct CrashBeforeFinish;

#[async_trait::async_trait]
impl CrashHook for CrashBeforeFinish {
    async fn crash_at(&self, point: &CrashPoint, _: &idemflow::TenantId, _: &Key) -> bool {
        matches!(point, CrashPoint::BeforeFinish)
    }
}
