-- Diagnostics: truncation rate split by correct and incorrect trajectories, per run and policy version.
--
-- Answers: are truncated (length-limited) responses concentrated among the
-- failures? Scoring truncation as 0 inside a group baseline teaches the
-- policy that length itself is bad; a truncation rate that grows among
-- incorrect members (or appears among correct ones) is the length-bias trap.
-- Over valid members (as in quality.sql); correct = verdict PASS; truncated =
-- stop_reason max_length.
--
-- Parameters:
-- @param run_id = NULL      only this experiment (NULL: every run)
--
-- Columns:
--   run_id, policy_version
--   correct           verdict = PASS
--   n                 valid members
--   truncated         of them with stop_reason max_length
--   truncation_rate   truncated / n
SELECT
    run_id,
    policy_version,
    verdict = 'PASS' AS correct,
    count(*) AS n,
    count(*) FILTER (WHERE stop_reason = 'max_length') AS truncated,
    count(*) FILTER (WHERE stop_reason = 'max_length') / count(*) AS truncation_rate
FROM trajectories
WHERE ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
  AND status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL
GROUP BY run_id, policy_version, correct
ORDER BY run_id, policy_version, correct
