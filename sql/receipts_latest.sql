-- The latest admission receipts with their decisions and reasons, newest first.
--
-- Answers: what did admission decide most recently, and why? One row per
-- group decision (receipts). reasons counts the exclusion reasons of the
-- group's members ('infra_failed x2, stale_policy x1'); failed_checks lists
-- the checks whose outcome is not pass or skip.
--
-- Parameters:
-- @param run_id = NULL    only this experiment (NULL: every run)
-- @param limit = 25       rows to return
--
-- Columns:
--   decided_at, run_id, group_id, task_id, decision
--   arrived_members, valid                 members arrived / passing every member check
--   reasons                                exclusion reasons with counts, sorted by reason
--   failed_checks                          'check: outcome' of failed checks, sorted
--   reward_mean, reward_std, policy_lag, max_queue_wait_ms
--   difficulty, length_bucket, current_policy_version, snapshot_id, admission_run_id
WITH r AS (
    SELECT * FROM receipts
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
    ORDER BY decided_at DESC, group_id
    LIMIT $limit::INTEGER
)
SELECT
    decided_at, run_id, group_id, task_id, decision, arrived_members,
    len(valid_members) AS valid,
    (SELECT string_agg(reason || ' x' || n, ', ' ORDER BY reason)
       FROM (SELECT reason, count(*) AS n FROM unnest(map_values(r.excluded_members)) AS u(reason) GROUP BY reason))
        AS reasons,
    (SELECT string_agg(c.key || ': ' || c.value, ', ' ORDER BY c.key)
       FROM unnest(map_entries(r.checks)) AS u(c)
      WHERE c.value NOT IN ('pass', 'skip')) AS failed_checks,
    reward_mean, reward_std, policy_lag, max_queue_wait_ms,
    difficulty, length_bucket, current_policy_version, snapshot_id, admission_run_id
FROM r
ORDER BY decided_at DESC, group_id
