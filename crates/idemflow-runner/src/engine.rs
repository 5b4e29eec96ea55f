//! The engine the runner drives: the boundary's [`Engine`] (`idemflow-store`), which every
//! engine's crate implements. The runner names no engine; a workflow, its phases, its runner and
//! its resumer all name one `E`.

pub use idemflow_store::{
    Claimed, ConnectionOf, ConnectionPool, DatabaseError, DatabaseErrorKind, Engine, EngineError,
    EnginePool, Isolation, KeyOwner, Limits, PoolOf, PooledOf, SqlEngine, Standing, Taken,
};
