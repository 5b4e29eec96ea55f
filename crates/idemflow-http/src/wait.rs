//! A duplicate that would rather wait than be told 409 (`Prefer: wait=N`, RFC 7240): held until
//! the first attempt has stored its response, then answered as a retry would be (the replay), or
//! told 409 once its wait is over.
//!
//! A waiter holds no database connection: a connection held for seconds per waiting client would
//! empty the pool the first attempt needs to finish. It sleeps, then looks the key up (a pooled
//! connection taken and handed back) and, once the key is no longer running under a live lease,
//! sends the request again exactly as a retry: the runner replays the stored response (read
//! again from the database, byte for byte), or does whatever a retry does then (runs a key that
//! was freed, takes over a key whose lease ran out). Between looks it is woken at once when a run
//! of the same key ends in this process ([`Finishes`]); an owner in another process is only seen
//! by looking, every 50 ms at first, doubling to 1 s.

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idemflow_core::{Key, TenantId};
use idemflow_runner::{ConnectionPool, Engine, Outcome, RunError, Runner};
use idemflow_store::LookUp;
use tokio::sync::Notify;
use tokio::task::JoinError;
use tokio::time::{Instant, sleep_until, timeout};

use crate::metrics::{WaitEnd, waited};

/// The first look after the first answer; each later one waits twice as long, up to
/// [`LAST_POLL`]. Short at first because most first attempts end within a few hundred ms.
const FIRST_POLL: Duration = Duration::from_millis(50);
/// The longest between two looks: an owner in another process is seen within a second of
/// finishing, at one look-up a second per waiter.
const LAST_POLL: Duration = Duration::from_secs(1);
/// The least time a look-up is given, even at the end of the wait: a look that began is let
/// finish rather than wasted.
const LOOK_AT_LEAST: Duration = Duration::from_millis(250);
/// How long a key being claimed (its claim not yet committed) is taken to stay so, as the
/// runner's 409 says (`Retry-After: 1`).
const CLAIMING: Duration = Duration::from_secs(1);

/// What one run of a request came to: the runner's result, or its task's failure.
pub(crate) type Ran = Result<Result<Outcome, RunError>, JoinError>;

/// The runs of this layer's (or route's) keys that ended, for the duplicates waiting on them in
/// this process. One per layer, shared by its clones; an owner in another process is not seen
/// here, and is found by looking.
#[derive(Debug, Default)]
pub(crate) struct Finishes {
    waiting: Mutex<HashMap<(TenantId, Key), Arc<Notify>>>,
}

impl Finishes {
    /// Wakes the duplicates waiting on `(tenant, key)`, if any: a run of it ended.
    pub(crate) fn finished(&self, tenant: &TenantId, key: &Key) {
        let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        // Every covered request's run ends here: most find nobody waiting at all.
        if waiting.is_empty() {
            return;
        }
        if let Some(notify) = waiting.get(&(tenant.clone(), key.clone())) {
            notify.notify_waiters();
        }
    }

    /// A waiter's hold on the key's wake-ups, until dropped.
    fn watch(self: &Arc<Self>, tenant: &TenantId, key: &Key) -> Watch {
        let id = (tenant.clone(), key.clone());
        let notify = self
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(id.clone())
            .or_default()
            .clone();
        Watch {
            finishes: self.clone(),
            id,
            notify,
        }
    }

    #[cfg(test)]
    fn watched(&self) -> usize {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// One waiter's interest in a key: the last one to go removes the key's entry.
struct Watch {
    finishes: Arc<Finishes>,
    id: (TenantId, Key),
    notify: Arc<Notify>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut waiting = self
            .finishes
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Every clone is made under this lock: the map's and this one are the last two.
        if Arc::strong_count(&self.notify) == 2 {
            waiting.remove(&self.id);
        }
    }
}

/// Whether a run that came to `result` held the key and let it go (stored its response, freed
/// it, recorded a failed attempt, failed): then whoever waits on the key should look again. A
/// run that found the key another's (a 409, a replay, a 422) or was refused changed nothing.
pub(crate) fn ends_a_hold(result: &Result<Outcome, RunError>) -> bool {
    !matches!(
        result,
        Ok(Outcome::InProgress { .. }
            | Outcome::Replayed(_)
            | Outcome::Mismatch
            | Outcome::Rejected(_))
    )
}

/// A duplicate's wait: who it waits on, and for how long at most.
pub(crate) struct Waiting<'a, E: Engine> {
    pub runner: &'a Runner<E>,
    pub finishes: &'a Arc<Finishes>,
    pub workflow: &'a str,
    pub tenant: &'a TenantId,
    pub key: &'a Key,
    /// The wait the client asked for, bounded by the server's maximum; `None`: no wait.
    pub limit: Option<Duration>,
}

/// Runs the request (`run`: one attempt, as a retry would make it), and if the key was another
/// attempt's still running and the client asked to wait, waits for that attempt's answer.
/// Returns what the last run came to, or the 409 the wait ended with, and whether the request
/// waited (to say so with `Preference-Applied`).
pub(crate) async fn run_or_wait<E, F, Fut>(waiting: Waiting<'_, E>, mut run: F) -> (Ran, bool)
where
    E: Engine,
    F: FnMut() -> Fut,
    Fut: Future<Output = Ran>,
{
    let Some(limit) = waiting.limit else {
        return (run().await, false);
    };
    let watch = waiting.finishes.watch(waiting.tenant, waiting.key);
    // Armed before the first run: an owner that ends between the first look-up and the wait
    // is not missed.
    let mut woken = pin!(watch.notify.notified());
    woken.as_mut().enable();
    let first = run().await;
    let Ok(Ok(Outcome::InProgress { retry_after })) = first else {
        return (first, false);
    };
    let deadline = Instant::now() + limit;
    // Never slept past: once the owner's lease is over, a retry would take the key over.
    let mut lease_ends = Instant::now() + retry_after;
    let mut next_poll = FIRST_POLL;
    loop {
        let wake = (Instant::now() + next_poll).min(lease_ends).min(deadline);
        tokio::select! {
            () = woken.as_mut() => {}
            () = sleep_until(wake) => {}
        }
        // Armed again before looking: an owner that ends during the look-up wakes the next wait.
        woken.set(watch.notify.notified());
        woken.as_mut().enable();
        next_poll = (next_poll * 2).min(LAST_POLL);
        let now = Instant::now();
        let within = deadline.saturating_duration_since(now).max(LOOK_AT_LEAST);
        match look(waiting.runner, waiting.tenant, waiting.key, within).await {
            Some(Look::Running { lease_left }) => lease_ends = Instant::now() + lease_left,
            Some(Look::Changed) => {
                let again = run().await;
                match again {
                    Ok(Ok(Outcome::InProgress { retry_after })) => {
                        // Taken again between the look-up and the run: wait on.
                        lease_ends = Instant::now() + retry_after;
                    }
                    again => {
                        let end = match &again {
                            Ok(Ok(Outcome::Replayed(_))) => WaitEnd::Replayed,
                            _ => WaitEnd::Other,
                        };
                        waited(waiting.workflow, end);
                        return (again, true);
                    }
                }
            }
            // The look-up failed or did not answer in time: the database's trouble is the
            // first attempt's to meet; this one waits on, and answers 409 at the end.
            None => {}
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    waited(waiting.workflow, WaitEnd::InProgress);
    let retry_after = lease_ends.saturating_duration_since(Instant::now());
    (Ok(Ok(Outcome::InProgress { retry_after })), true)
}

/// What a look at a waited-on key found.
enum Look {
    /// Still another's: started under a live lease, or being claimed.
    Running { lease_left: Duration },
    /// Anything else (done, freed, its lease over): time to send the request again.
    Changed,
}

/// Looks the key up on a connection taken from the pool for this one statement, bounded by
/// `within`; `None` if it failed or took longer.
async fn look<E: Engine>(
    runner: &Runner<E>,
    tenant: &TenantId,
    key: &Key,
    within: Duration,
) -> Option<Look> {
    let looked = timeout(within, async {
        let mut connection = runner.pool().acquire().await.ok()?;
        E::look_up(&mut connection, tenant, key).await.ok()
    })
    .await
    .ok()??;
    Some(match looked {
        LookUp::Found(row) if !row.done && !row.lease_left.is_zero() => Look::Running {
            lease_left: row.lease_left,
        },
        LookUp::Claiming => Look::Running {
            lease_left: CLAIMING,
        },
        LookUp::Found(_) | LookUp::Absent(_) => Look::Changed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(key: &str) -> (TenantId, Key) {
        (
            TenantId::new("acme").expect("a tenant"),
            Key::parse(key).expect("a key"),
        )
    }

    /// A run that ends wakes every duplicate waiting on its key in this process, and none of
    /// another key; the last waiter to go leaves nothing behind.
    #[tokio::test]
    async fn an_ending_run_wakes_the_waiters_of_its_key_alone() {
        let finishes = Arc::new(Finishes::default());
        let (tenant, key) = pair("a");
        let (_, other) = pair("b");
        let first = finishes.watch(&tenant, &key);
        let second = finishes.watch(&tenant, &key);
        let elsewhere = finishes.watch(&tenant, &other);
        assert_eq!(finishes.watched(), 2);
        {
            let mut one = pin!(first.notify.notified());
            let mut two = pin!(second.notify.notified());
            let mut three = pin!(elsewhere.notify.notified());
            one.as_mut().enable();
            two.as_mut().enable();
            three.as_mut().enable();

            finishes.finished(&tenant, &key);
            timeout(Duration::from_secs(1), one)
                .await
                .expect("the first waiter is woken");
            timeout(Duration::from_secs(1), two)
                .await
                .expect("the second waiter is woken");
            assert!(
                timeout(Duration::from_millis(50), three).await.is_err(),
                "another key's waiter sleeps on"
            );
        }

        drop(first);
        assert_eq!(finishes.watched(), 2, "a waiter is left on the key");
        drop(second);
        drop(elsewhere);
        assert_eq!(finishes.watched(), 0);
        // A run that ends with nobody waiting finds nothing to wake.
        finishes.finished(&tenant, &key);
    }

    #[test]
    fn only_a_run_that_held_the_key_ends_a_hold() {
        assert!(!ends_a_hold(&Ok(Outcome::InProgress {
            retry_after: Duration::from_secs(1)
        })));
        assert!(!ends_a_hold(&Ok(Outcome::Mismatch)));
        assert!(!ends_a_hold(&Ok(Outcome::Replayed(
            idemflow_core::StoredResponse::new(200, Vec::new())
        ))));
        assert!(ends_a_hold(&Ok(Outcome::Executed(
            idemflow_core::StoredResponse::new(200, Vec::new())
        ))));
        assert!(ends_a_hold(&Err(RunError::Fenced)));
    }
}
