-- Freshness per generation policy version: queue wait p50/p95, lag at admission and at training.
--
-- Answers: how old is the data a checkpoint learns from? Policy version at
-- generation = the trajectory's policy_version (the version that started it);
-- policy version at training = the version the trainer updated, i.e. the
-- parent checkpoint's policy_version (policy_version - 1 of the produced
-- checkpoint when it has no parent row). A member is trained by every
-- checkpoint whose snapshot_ids hold one of its snapshots (snapshot_members).
-- Admission lag = snapshot_members.policy_lag (measured by admission against
-- its current version). Percentiles are continuous.
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id, policy_version            generation version
--   trajectories
--   queue_wait_p50_ms, queue_wait_p95_ms
--   admitted_members                  snapshot member rows of these trajectories
--   admission_lag_mean, admission_lag_max
--   trained_members                   (checkpoint, member) pairs
--   trained_version_min, trained_version_max
--   training_lag_mean, training_lag_p50, training_lag_p95, training_lag_max
--                                     trained version - generation version
WITH t AS (
    SELECT trajectory_id, run_id, policy_version, queue_wait_ms FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
),
ck AS (
    SELECT c.checkpoint_id, c.snapshot_id,
           coalesce(p.policy_version, c.policy_version - 1) AS trained_version
    FROM (SELECT checkpoint_id, parent_checkpoint_id, policy_version, unnest(snapshot_ids) AS snapshot_id
          FROM checkpoints) AS c
    LEFT JOIN checkpoints AS p ON p.checkpoint_id = c.parent_checkpoint_id
),
waits AS (
    SELECT run_id, policy_version, count(*) AS trajectories,
           quantile_cont(queue_wait_ms, 0.5) AS queue_wait_p50_ms,
           quantile_cont(queue_wait_ms, 0.95) AS queue_wait_p95_ms
    FROM t GROUP BY run_id, policy_version
),
admitted AS (
    SELECT t.run_id, t.policy_version, count(*) AS admitted_members,
           avg(m.policy_lag) AS admission_lag_mean, max(m.policy_lag) AS admission_lag_max
    FROM snapshot_members AS m JOIN t USING (trajectory_id)
    GROUP BY t.run_id, t.policy_version
),
trained AS (
    SELECT t.run_id, t.policy_version, count(*) AS trained_members,
           min(ck.trained_version) AS trained_version_min,
           max(ck.trained_version) AS trained_version_max,
           avg(ck.trained_version - t.policy_version) AS training_lag_mean,
           quantile_cont(ck.trained_version - t.policy_version, 0.5) AS training_lag_p50,
           quantile_cont(ck.trained_version - t.policy_version, 0.95) AS training_lag_p95,
           max(ck.trained_version - t.policy_version) AS training_lag_max
    FROM snapshot_members AS m
    JOIN ck USING (snapshot_id)
    JOIN t USING (trajectory_id)
    GROUP BY t.run_id, t.policy_version
)
SELECT
    w.run_id, w.policy_version, w.trajectories, w.queue_wait_p50_ms, w.queue_wait_p95_ms,
    coalesce(a.admitted_members, 0) AS admitted_members, a.admission_lag_mean, a.admission_lag_max,
    coalesce(tr.trained_members, 0) AS trained_members, tr.trained_version_min, tr.trained_version_max,
    tr.training_lag_mean, tr.training_lag_p50, tr.training_lag_p95, tr.training_lag_max
FROM waits AS w
LEFT JOIN admitted AS a USING (run_id, policy_version)
LEFT JOIN trained AS tr USING (run_id, policy_version)
ORDER BY w.run_id, w.policy_version
