-- The store's schema as numbered migrations (migrations.py applies the ones a database
-- lacks, in order, each in its own transaction). Never edit a shipped step: add the next one.
-- `{serial_pk}` and `{real}` are the dialect's auto-increment key and float column.

-- name: v1
CREATE TABLE corral_tasks (
    seq {serial_pk},
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    payload TEXT NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0,
    serial_key TEXT,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    created_at {real} NOT NULL,
    run_after {real} NOT NULL,
    lease_token TEXT,
    lease_expires_at {real},
    worker_id TEXT,
    started_at {real},
    finished_at {real},
    result TEXT,
    error TEXT,
    errors TEXT NOT NULL DEFAULT '[]',
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    batch_id TEXT
);
CREATE INDEX corral_tasks_claim ON corral_tasks (model, status, priority DESC, seq);
CREATE INDEX corral_tasks_serial ON corral_tasks (serial_key, status);
CREATE INDEX corral_tasks_lease ON corral_tasks (status, lease_expires_at);

-- name: v2
-- Partial indexes: a task sits in each only while it matters (queued for claims,
-- running for leases, keyed for serial keys), so committing a result touches one
-- index entry instead of six: less WAL per task, smaller indexes.
DROP INDEX corral_tasks_claim;
DROP INDEX corral_tasks_serial;
DROP INDEX corral_tasks_lease;
CREATE INDEX corral_tasks_queued ON corral_tasks (model, priority DESC, seq)
    WHERE status = 'queued';
CREATE INDEX corral_tasks_serial ON corral_tasks (serial_key, status)
    WHERE serial_key IS NOT NULL;
CREATE INDEX corral_tasks_running ON corral_tasks (lease_expires_at) WHERE status = 'running';

-- name: v3
-- The Batch API: files (bytes on disk, records here) and batches, whose lines are
-- tasks with a batch_id.
CREATE TABLE corral_files (
    seq {serial_pk},
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at {real} NOT NULL,
    path TEXT NOT NULL
);
CREATE TABLE corral_batches (
    seq {serial_pk},
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    created_at {real} NOT NULL,
    idempotency_key TEXT UNIQUE,
    data TEXT NOT NULL
);
CREATE INDEX corral_tasks_batch ON corral_tasks (batch_id, seq) WHERE batch_id IS NOT NULL;

-- name: v4
-- Service classes: interactive tasks are claimed before batch ones (existing tasks
-- are batch work, the queue's default).
ALTER TABLE corral_tasks ADD COLUMN interactive INTEGER NOT NULL DEFAULT 0;
DROP INDEX corral_tasks_queued;
CREATE INDEX corral_tasks_queued ON corral_tasks (model, interactive DESC, priority DESC, seq)
    WHERE status = 'queued';

-- name: v5
-- Files that expire (the Batch API's `expires_after`).
ALTER TABLE corral_files ADD COLUMN expires_at {real};

-- name: v6
-- Live workers and the models they serve, so that work nobody serves is reported.
CREATE TABLE corral_workers (
    id TEXT PRIMARY KEY,
    models TEXT NOT NULL,
    seen_at {real} NOT NULL
);

-- name: v7
-- Group commit: tasks started together, and tasks that must run alone (see
-- store.base: a grouped task's attempt does not count if its worker dies).
ALTER TABLE corral_tasks ADD COLUMN started_in_group INTEGER NOT NULL DEFAULT 0;
ALTER TABLE corral_tasks ADD COLUMN run_alone INTEGER NOT NULL DEFAULT 0;

-- name: v8
-- Which worker holds which model on which device: a cluster of workers on one
-- database loads each model where it costs least, once (model affinity).
CREATE TABLE corral_residency (
    worker_id TEXT NOT NULL,
    device TEXT NOT NULL,
    model TEXT NOT NULL,
    state TEXT NOT NULL,
    seen_at {real} NOT NULL,
    PRIMARY KEY (worker_id, model)
);

-- name: v9
-- Where a worker that is a `corral serve` node is reached: nodes forward requests
-- for a model to the node that holds it.
ALTER TABLE corral_workers ADD COLUMN url TEXT;

-- name: v10
-- Whose files and batches they are: the principal that made them (NULL: made before
-- principals, an admin's).
ALTER TABLE corral_files ADD COLUMN owner TEXT;
ALTER TABLE corral_batches ADD COLUMN owner TEXT;
CREATE INDEX corral_files_owner ON corral_files (owner, seq) WHERE owner IS NOT NULL;
CREATE INDEX corral_batches_owner ON corral_batches (owner, seq) WHERE owner IS NOT NULL;

-- name: v11
-- The audit log: admin actions and key changes, who did them and when.
CREATE TABLE corral_audit (
    seq {serial_pk},
    at {real} NOT NULL,
    principal TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX corral_audit_at ON corral_audit (at);
CREATE INDEX corral_audit_action ON corral_audit (action, target);

-- name: v12
-- Usage per hour, principal and model (`corral usage`), kept across restarts.
CREATE TABLE corral_usage (
    hour BIGINT NOT NULL,
    principal TEXT NOT NULL,
    model TEXT NOT NULL,
    requests BIGINT NOT NULL,
    input_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    wait_s {real} NOT NULL,
    service_s {real} NOT NULL,
    load_s {real} NOT NULL,
    PRIMARY KEY (hour, principal, model)
);

-- name: v13
-- Fair turns between the owners of batches: a batch line's `turn` is its place among its
-- model's queued work of its class, in `seq`'s units (`SqlBatches.starts`); a task without
-- one takes its place by `seq`, as before.
ALTER TABLE corral_tasks ADD COLUMN turn {real};
DROP INDEX corral_tasks_queued;
CREATE INDEX corral_tasks_queued
    ON corral_tasks (model, interactive DESC, priority DESC, (COALESCE(turn, seq)), seq)
    WHERE status = 'queued';
