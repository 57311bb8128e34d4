-- Policy-lag distribution: members per lag value, at admission and at training.
--
-- Answers: how far behind the trained policy was the policy that generated the
-- data? kind = admission: snapshot_members.policy_lag (one row per snapshot
-- member); kind = training: trained version - generation version, one row per
-- (checkpoint, member) pair (definitions as in freshness.sql).
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id, kind (admission / training), lag
--   members    member rows with this lag
--   share      members / all members of this run and kind
WITH t AS (
    SELECT trajectory_id, run_id, policy_version FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
),
ck AS (
    SELECT c.checkpoint_id, c.snapshot_id,
           coalesce(p.policy_version, c.policy_version - 1) AS trained_version
    FROM (SELECT checkpoint_id, parent_checkpoint_id, policy_version, unnest(snapshot_ids) AS snapshot_id
          FROM checkpoints) AS c
    LEFT JOIN checkpoints AS p ON p.checkpoint_id = c.parent_checkpoint_id
),
lags AS (
    SELECT t.run_id, 'admission' AS kind, m.policy_lag AS lag
    FROM snapshot_members AS m JOIN t USING (trajectory_id)
    UNION ALL
    SELECT t.run_id, 'training' AS kind, ck.trained_version - t.policy_version AS lag
    FROM snapshot_members AS m JOIN ck USING (snapshot_id) JOIN t USING (trajectory_id)
)
SELECT run_id, kind, lag, count(*) AS members,
       count(*) / sum(count(*)) OVER (PARTITION BY run_id, kind) AS share
FROM lags
GROUP BY run_id, kind, lag
ORDER BY run_id, kind, lag
