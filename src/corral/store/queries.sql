-- The store's SQL, one named statement or fragment each (queries.py loads them as `SQL`).
-- Parameters are `:name` (PostgreSQL's adapter rewrites them). `{name}` includes the fragment
-- of that name when the file loads; any other `{name}` is filled in by the caller (a WHERE
-- clause, an IN list, a dialect's phrase). Dialect variants live beside their adapter
-- (sqlite.sql, postgres.sql). Migrations are in migrations.py.

-- name: columns
-- The task columns, in `to_task`'s order.
seq, id, kind, model, payload, priority, serial_key, status, attempts, max_attempts,
created_at, run_after, lease_token, lease_expires_at, worker_id, started_at, finished_at,
result, error, errors, cancel_requested, batch_id, interactive, started_in_group, run_alone

-- name: light_columns
-- The same columns without the payload and the result (`list(full=False)`).
seq, id, kind, model, 'null' AS payload, priority, serial_key, status, attempts, max_attempts,
created_at, run_after, lease_token, lease_expires_at, worker_id, started_at, finished_at,
NULL AS result, error, errors, cancel_requested, batch_id, interactive, started_in_group,
run_alone

-- name: qualified_columns
-- The task columns named with their table (a statement that joins another row source).
corral_tasks.seq, corral_tasks.id, corral_tasks.kind, corral_tasks.model,
corral_tasks.payload, corral_tasks.priority, corral_tasks.serial_key, corral_tasks.status,
corral_tasks.attempts, corral_tasks.max_attempts, corral_tasks.created_at,
corral_tasks.run_after, corral_tasks.lease_token, corral_tasks.lease_expires_at,
corral_tasks.worker_id, corral_tasks.started_at, corral_tasks.finished_at,
corral_tasks.result, corral_tasks.error, corral_tasks.errors, corral_tasks.cancel_requested,
corral_tasks.batch_id, corral_tasks.interactive, corral_tasks.started_in_group,
corral_tasks.run_alone

-- name: file_columns
id, purpose, filename, bytes, created_at, path, expires_at, owner

-- name: batch_columns
seq, id, status, created_at, idempotency_key, data, owner

-- name: claimable
-- A task `t` that `claim` may take now: queued, due, and the oldest of its serial key with
-- none of that key running.
t.status = 'queued' AND t.run_after <= :now
      AND (t.serial_key IS NULL OR (
        NOT EXISTS (SELECT 1 FROM corral_tasks r
                    WHERE r.serial_key = t.serial_key AND r.status = 'running')
        AND t.seq = (SELECT MIN(q.seq) FROM corral_tasks q
                     WHERE q.serial_key = t.serial_key AND q.status = 'queued')))

-- name: insert_task
INSERT INTO corral_tasks (id, kind, model, payload, priority, interactive, serial_key,
    status, max_attempts, created_at, run_after, batch_id, turn)
VALUES (:id, :kind, :model, :payload, :priority, :interactive, :serial_key, :status,
    :max_attempts, :created_at, :run_after, :batch_id, :turn)

-- name: insert_announced
-- One enqueue and its announcement to other processes in one statement ({notify}: a SELECT).
WITH added AS ({insert_task} RETURNING 1 AS x) {notify}

-- name: task_stored
-- Whether an enqueue whose commit may have been lost landed.
SELECT 1 AS x FROM corral_tasks WHERE id = :id

-- name: queued_of_kind
-- How many tasks of a kind wait (the partial index on queued tasks).
SELECT count(*) AS n FROM corral_tasks
WHERE model = :model AND status = 'queued' AND kind = :kind

-- name: turn_head
-- Where a model's queued work of one class stands: the place of its next task.
SELECT MIN(COALESCE(turn, seq)) AS head FROM corral_tasks
WHERE model = :model AND status = 'queued' AND interactive = :interactive
    AND priority = :priority

-- name: turn_tail
-- The place of an owner's last queued batch line of a model and class (batches without an
-- owner share one: a principal's name is never empty). A batch's lines of one model take
-- places in the order of their `seq`, so its last queued one is found from the end of the
-- batch's index, not by reading every queued line of the model.
SELECT MAX((
    SELECT t.turn FROM corral_tasks t
    WHERE t.batch_id = b.id AND t.model = :model AND t.status = 'queued'
        AND t.interactive = :interactive AND t.priority = :priority
    ORDER BY t.seq DESC LIMIT 1
)) AS tail FROM corral_batches b
WHERE COALESCE(b.owner, '') = COALESCE(CAST(:owner AS TEXT), '')
    AND b.status IN ('validating', 'in_progress', 'cancelling', 'finalizing')

-- name: last_seq
SELECT COALESCE(MAX(seq), 0) AS seq FROM corral_tasks

-- name: claim_starts
-- Whether a picked row `p` starts now: the best `:start` of them do; several started at once
-- are a group, which never includes a task that must run alone.
p.rn <= :start AND ((:grp = 0 AND (:start <= 1 OR p.picked <= 1)) OR p.run_alone = 0)

-- name: claim
-- Take `:limit` claimable tasks of `:model`, the first `:start` started, the rest reserved,
-- in one statement. The picked rows are ranked in a nested SELECT (window functions cannot
-- share a SELECT with FOR UPDATE). {new_token} and {lock_skip} are the dialect's.
UPDATE corral_tasks SET status = 'running',
    attempts = attempts + CASE WHEN {claim_starts} THEN 1 ELSE 0 END,
    started_at = CASE WHEN {claim_starts} THEN :now ELSE NULL END,
    started_in_group = CASE WHEN {claim_starts} AND (:grp = 1 OR (:start > 1 AND p.picked > 1))
                       THEN 1 ELSE 0 END,
    lease_token = {new_token}, lease_expires_at = :expires, worker_id = :worker
FROM (SELECT s.seq, s.run_alone,
             row_number() OVER (ORDER BY s.interactive DESC, s.priority DESC,
                                COALESCE(s.turn, s.seq), s.seq) AS rn,
             count(*) OVER () AS picked
      FROM (SELECT t.seq, t.interactive, t.priority, t.run_alone, t.turn FROM corral_tasks t
            WHERE t.model = :model AND {claimable}
            ORDER BY t.interactive DESC, t.priority DESC, COALESCE(t.turn, t.seq), t.seq
            LIMIT :limit {lock_skip}) s) p
WHERE corral_tasks.seq = p.seq
RETURNING {qualified_columns}

-- name: start
-- Start a reserved task: its attempt counts from here. In a group (`:start_group` 1), never a
-- task that must run alone.
UPDATE corral_tasks SET attempts = attempts + 1, started_at = :start_now,
    started_in_group = :start_group
WHERE id = :start_id AND status = 'running' AND lease_token = :start_token
    AND started_at IS NULL AND (:start_group = 0 OR run_alone = 0)
RETURNING id

-- name: update_held
-- A write by the worker holding the lease ({sets}: one of the `*_sets` below).
UPDATE corral_tasks SET {sets} WHERE id = :id AND status = 'running'
    AND lease_token = :token RETURNING cancel_requested, serial_key

-- name: update_held_then_start
-- The same, starting the next reserved task in the same statement (where a WITH clause may
-- hold an UPDATE).
WITH started AS ({start}) {update_held}

-- name: heartbeat_sets
lease_expires_at = :expires

-- name: finish_sets
status = 'succeeded', result = :result, lease_token = NULL, lease_expires_at = NULL,
finished_at = :now

-- name: release_sets
status = 'queued', attempts = attempts - CASE WHEN started_at IS NULL THEN 0 ELSE 1 END,
lease_token = NULL, started_in_group = 0, lease_expires_at = NULL, worker_id = NULL,
started_at = NULL

-- name: cancelled_sets
status = 'cancelled', lease_token = NULL, lease_expires_at = NULL, finished_at = :now

-- name: held_for_fail
SELECT attempts, max_attempts, errors, serial_key FROM corral_tasks
WHERE id = :id AND status = 'running' AND lease_token = :token

-- name: fail_again
-- A failed attempt with attempts left: back to the queue after `:after`.
UPDATE corral_tasks SET status = 'queued', run_after = :after, lease_token = NULL,
    lease_expires_at = NULL, worker_id = NULL, error = :error, errors = :errors
WHERE id = :id

-- name: fail_for_good
UPDATE corral_tasks SET status = 'failed', lease_token = NULL, lease_expires_at = NULL,
    finished_at = :now, error = :error, errors = :errors
WHERE id = :id

-- name: cancel
-- A queued task ends cancelled; a running one is flagged for its worker.
UPDATE corral_tasks SET
    cancel_requested = CASE WHEN status = 'running' THEN 1 ELSE cancel_requested END,
    finished_at = CASE WHEN status = 'queued' THEN :now ELSE finished_at END,
    status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END
WHERE id = :id RETURNING status

-- name: retry
UPDATE corral_tasks SET status = 'queued', attempts = 0, run_after = :now,
    finished_at = NULL, cancel_requested = 0, worker_id = NULL, started_at = NULL,
    started_in_group = 0, run_alone = 0
WHERE id = :id AND status IN ('failed', 'cancelled')

-- name: task_status
SELECT status FROM corral_tasks WHERE id = :id

-- name: expired
SELECT id, attempts, max_attempts, worker_id, errors, started_at, started_in_group,
    cancel_requested
FROM corral_tasks WHERE status = 'running' AND lease_expires_at < :now

-- name: reclaim
-- An expired lease ends: back to the queue, failed or cancelled; `:refund` 1 gives a grouped
-- task its attempt back and marks it to run alone, 2 gives it back only (cleared by its
-- worker's last words).
UPDATE corral_tasks SET status = :status, lease_token = NULL, lease_expires_at = NULL,
    worker_id = CASE WHEN :status = 'queued' THEN NULL ELSE worker_id END,
    finished_at = :finished, error = COALESCE(:error, error), errors = :errors,
    attempts = attempts - CASE WHEN :refund > 0 THEN 1 ELSE 0 END, started_in_group = 0,
    run_alone = CASE WHEN :refund = 1 THEN 1 ELSE run_alone END
WHERE id = :id AND status = 'running'

-- name: running_under
-- Whether a task is still running, started, under this worker and token.
SELECT 1 AS x FROM corral_tasks WHERE id = :id AND lease_token = :token
    AND worker_id = :worker AND status = 'running' AND started_at IS NOT NULL

-- name: clear_groups
-- `started_in_group` 2: a grouped task cleared by its worker's last words.
UPDATE corral_tasks SET started_in_group = 2 WHERE worker_id = :worker
    AND status = 'running' AND started_in_group IN (1, 2) RETURNING id

-- name: blame
UPDATE corral_tasks SET started_in_group = 0 WHERE id = :id AND lease_token = :token

-- name: purge
-- Finished tasks, oldest first; a batch's lines only once the batch has ended (its counts
-- and output files are written then).
DELETE FROM corral_tasks WHERE seq IN (SELECT seq FROM corral_tasks
    WHERE status IN ('succeeded', 'failed', 'cancelled')
    AND (batch_id IS NULL OR batch_id IN (SELECT id FROM corral_batches
        WHERE status IN ('completed', 'failed', 'expired', 'cancelled')))
    AND finished_at < :before ORDER BY finished_at LIMIT :limit)
RETURNING seq

-- name: get_task
SELECT {columns} FROM corral_tasks WHERE id = :id

-- name: list_tasks
-- {shown}: `columns` or `light_columns`; {where}: the filters, or "".
SELECT {shown} FROM corral_tasks{where} ORDER BY seq DESC LIMIT :limit

-- name: counts
SELECT model, status, COUNT(*) AS n FROM corral_tasks GROUP BY model, status

-- name: ready_counts
SELECT t.model, t.interactive, t.priority, COUNT(*) AS n FROM corral_tasks t
WHERE {claimable} GROUP BY t.model, t.interactive, t.priority

-- name: add_file
INSERT INTO corral_files (id, purpose, filename, bytes, created_at, path, expires_at, owner)
VALUES (:id, :purpose, :filename, :bytes, :created_at, :path, :expires_at, :owner)
RETURNING id

-- name: file_stored
SELECT id FROM corral_files WHERE id = :id

-- name: get_file
SELECT {file_columns} FROM corral_files WHERE id = :id

-- name: list_files
-- {where}: the page, the purpose and the owner; {direction}: ASC or DESC.
SELECT {file_columns} FROM corral_files WHERE {where} ORDER BY seq {direction} LIMIT :limit

-- name: delete_file
DELETE FROM corral_files WHERE id = :id RETURNING {file_columns}

-- name: batch_by_key
SELECT {batch_columns} FROM corral_batches WHERE idempotency_key = :k

-- name: add_batch
INSERT INTO corral_batches (id, status, created_at, idempotency_key, data, owner)
VALUES (:id, :status, :created_at, :key, :data, :owner) RETURNING {batch_columns}

-- name: start_batch
UPDATE corral_batches SET status = :status, data = :data
WHERE id = :id AND status = 'validating' RETURNING {batch_columns}

-- name: batch_exists
SELECT 1 AS x FROM corral_batches WHERE id = :id

-- name: get_batch
SELECT {batch_columns} FROM corral_batches WHERE id = :id

-- name: list_batches
-- {where}: the page, the statuses and the owner.
SELECT {batch_columns} FROM corral_batches WHERE {where} ORDER BY seq DESC LIMIT :limit

-- name: update_batch
-- A compare-and-set on the status ({expect}: an IN list).
UPDATE corral_batches SET status = :status, data = :data
WHERE id = :id AND status IN ({expect}) RETURNING {batch_columns}

-- name: batch_counts
SELECT status, COUNT(*) AS n FROM corral_tasks WHERE batch_id = :b GROUP BY status

-- name: batch_tasks
SELECT {columns} FROM corral_tasks WHERE batch_id = :b AND seq > :after
ORDER BY seq LIMIT :limit

-- name: cancel_batch_queued
UPDATE corral_tasks SET status = 'cancelled', finished_at = :now
WHERE batch_id = :b AND status = 'queued' RETURNING id

-- name: cancel_batch_running
UPDATE corral_tasks SET cancel_requested = 1
WHERE batch_id = :b AND status = 'running' RETURNING id

-- name: worker_seen
INSERT INTO corral_workers (id, models, seen_at, url) VALUES (:id, :models, :now, :url)
ON CONFLICT (id) DO UPDATE SET models = excluded.models, seen_at = excluded.seen_at,
    url = excluded.url

-- name: forget_worker
DELETE FROM corral_workers WHERE id = :id

-- name: forget_residency
-- A worker's rows, but those of the models it still holds ({keep}: "" or an AND clause).
DELETE FROM corral_residency WHERE worker_id = :id{keep}

-- name: hold
-- An upsert, not delete-then-insert: two calls at once cannot collide.
INSERT INTO corral_residency (worker_id, device, model, state, seen_at)
VALUES (:w, :device, :model, :state, :now) ON CONFLICT (worker_id, model)
DO UPDATE SET device = excluded.device, state = excluded.state, seen_at = excluded.seen_at

-- name: residency
SELECT worker_id, device, model, state, seen_at FROM corral_residency
WHERE seen_at > :t ORDER BY worker_id, model

-- name: workers
SELECT id, models FROM corral_workers WHERE seen_at > :t ORDER BY id

-- name: nodes
SELECT id, url FROM corral_workers WHERE seen_at > :t AND url IS NOT NULL ORDER BY id

-- name: schema_table
-- The applied migrations' versions (migrations.py).
CREATE TABLE IF NOT EXISTS corral_schema (version INTEGER NOT NULL)

-- name: schema_version
SELECT MAX(version) AS v FROM corral_schema

-- name: record_version
INSERT INTO corral_schema (version) VALUES (:v)

-- name: release_lines
-- A stored batch's lines made due: those one attempt held back while it stored them.
UPDATE corral_tasks SET run_after = :now WHERE batch_id = :b AND run_after = :hold

-- name: drop_held_lines
-- Lines one attempt at storing a batch held back, where it did not start the batch.
DELETE FROM corral_tasks WHERE batch_id = :b AND status = 'queued' AND run_after = :hold

-- name: drop_all_held_lines
-- Lines any attempt at storing a batch held back (those of attempts that died).
DELETE FROM corral_tasks WHERE batch_id = :b AND status = 'queued' AND run_after >= :held

-- name: drop_storing_batch
-- A batch whose creation failed while it stored its lines.
DELETE FROM corral_batches WHERE id = :id AND status = 'validating'

-- name: audit_record
INSERT INTO corral_audit (at, principal, action, target, detail)
VALUES (:at, :principal, :action, :target, :detail)

-- name: audit_record_once
-- An event that has one occurrence (a key made, a key revoked): kept once however often it
-- is reported.
INSERT INTO corral_audit (at, principal, action, target, detail)
SELECT :at, :principal, :action, :target, :detail
WHERE NOT EXISTS (SELECT 1 FROM corral_audit WHERE action = :action AND target = :target)

-- name: audit_list
SELECT seq, at, principal, action, target, detail FROM corral_audit
WHERE at >= :since ORDER BY seq DESC LIMIT :limit

-- name: usage_add
-- One (hour, principal, model)'s use since the last save, added to what is kept.
INSERT INTO corral_usage (hour, principal, model, requests, input_tokens, output_tokens,
    wait_s, service_s, load_s)
VALUES (:hour, :principal, :model, :requests, :input_tokens, :output_tokens, :wait_s,
    :service_s, :load_s)
ON CONFLICT (hour, principal, model) DO UPDATE SET
    requests = corral_usage.requests + excluded.requests,
    input_tokens = corral_usage.input_tokens + excluded.input_tokens,
    output_tokens = corral_usage.output_tokens + excluded.output_tokens,
    wait_s = corral_usage.wait_s + excluded.wait_s,
    service_s = corral_usage.service_s + excluded.service_s,
    load_s = corral_usage.load_s + excluded.load_s

-- name: usage_since
SELECT hour, principal, model, requests, input_tokens, output_tokens, wait_s, service_s, load_s
FROM corral_usage WHERE hour >= :since ORDER BY hour, principal, model

-- name: usage_forget
DELETE FROM corral_usage WHERE hour < :before RETURNING hour
