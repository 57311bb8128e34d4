-- Retry amplification per run: how much extra rollout work retries of failed members cost,
-- and how much of it bought a valid evaluation.
--
-- Answers: does the run resample failed members, how often, and does it pay? An
-- amplification near 1 with a low recovery rate under a failing tool is the budget holding.
--
-- A retry is an episode whose CREATED event carries "retry_of" in its payload (the harness
-- writes it when it resamples an INFRA_FAILED / UNKNOWN member of a group under the retry
-- budgets: pipeline/rollout/run.py, retry_group_budget and retry_run_budget).
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id
--   planned        episodes the run planned (CREATED without retry_of)
--   retries        retry episodes started
--   amplification  (planned + retries) / planned: episodes run per planned one
--   recovered      retries that landed with a reward (a valid evaluation)
--   recovery_rate  recovered / retries (NULL without retries)
--   groups_retried groups with at least one retry
WITH created AS (
    SELECT run_id, episode_id, group_id,
           json_extract_string(payload, '$.retry_of') IS NOT NULL AS is_retry
    FROM events
    WHERE event_type = 'CREATED' AND ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
),
ep AS (SELECT DISTINCT run_id, episode_id, group_id, is_retry FROM created),
t AS (
    SELECT run_id, trajectory_id, reward FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
)
SELECT ep.run_id,
       count(*) FILTER (WHERE NOT ep.is_retry) AS planned,
       count(*) FILTER (WHERE ep.is_retry) AS retries,
       CAST(count(*) AS DOUBLE) / nullif(count(*) FILTER (WHERE NOT ep.is_retry), 0) AS amplification,
       count(*) FILTER (WHERE ep.is_retry AND t.reward IS NOT NULL) AS recovered,
       CAST(count(*) FILTER (WHERE ep.is_retry AND t.reward IS NOT NULL) AS DOUBLE)
           / nullif(count(*) FILTER (WHERE ep.is_retry), 0) AS recovery_rate,
       count(DISTINCT ep.group_id) FILTER (WHERE ep.is_retry) AS groups_retried
FROM ep LEFT JOIN t ON t.run_id = ep.run_id AND t.trajectory_id = ep.episode_id
GROUP BY ep.run_id
ORDER BY ep.run_id
