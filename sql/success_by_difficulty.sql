-- Success per task difficulty and policy version (valid members only).
--
-- Answers: which tasks is the policy learning, and which has it given up on
-- (a difficulty whose success stays at 0 only feeds zero-variance groups)?
-- From trajectories: valid = not INFRA_FAILED / EXPIRED, verdict PASS or FAIL
-- and a reward, as in quality.sql; success = share of valid with verdict PASS.
--
-- Parameters:
-- @param run_id = NULL    only this experiment (NULL: every run)
--
-- Columns:
--   difficulty (NULL shown as '(none)'), policy_version
--   valid            valid trajectories
--   tasks            distinct task_id among them
--   success_rate     share of valid that PASS
SELECT
    coalesce(difficulty, '(none)') AS difficulty,
    policy_version,
    count(*) AS valid,
    count(DISTINCT task_id) AS tasks,
    avg(CASE WHEN verdict = 'PASS' THEN 1.0 ELSE 0.0 END) AS success_rate
FROM trajectories
WHERE status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL
  AND ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
GROUP BY 1, 2
ORDER BY 1, 2
