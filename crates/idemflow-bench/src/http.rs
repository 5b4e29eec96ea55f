//! Workload 7: the checkout and the replay through the HTTP route (idemflow_http's
//! WorkflowService under axum) on 127.0.0.1, driven by a reqwest client over loopback.

use std::sync::Arc;

use axum::Router;
use axum::serve::ListenerExt;
use idemflow::{Runner, Workflow};
use idemflow_http::{BearerTenant, WorkflowService};
use tokio::task::JoinHandle;

use crate::Error;
use crate::workflows::{BODY, PATH, TENANT};

/// The HTTP service, serving until dropped.
#[derive(Debug)]
pub struct Server {
    pub url: String,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve(runner: Runner, workflow: Arc<Workflow>) -> Result<Server, Error> {
    let service = WorkflowService::new(runner, workflow, BearerTenant);
    let router = Router::new().route_service(PATH, service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(Server {
        url: format!("http://{address}{PATH}"),
        task,
    })
}

pub fn client(clients: usize) -> Result<reqwest::Client, Error> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(clients.max(1))
        .tcp_nodelay(true)
        .build()?)
}

/// One POST under `key`; `replayed` says which answer is expected.
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    replayed: bool,
) -> Result<(), Error> {
    let response = client
        .post(url)
        .header("idempotency-key", key)
        .header("authorization", format!("Bearer {TENANT}"))
        .header("content-type", "application/json")
        .body(BODY)
        .send()
        .await?;
    let status = response.status().as_u16();
    let was_replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.bytes().await?;
    if status != 201 || was_replayed != replayed {
        return Err(format!(
            "POST {key}: {status} (replayed: {was_replayed}, expected {replayed}): {}",
            String::from_utf8_lossy(&body)
        )
        .into());
    }
    Ok(())
}
