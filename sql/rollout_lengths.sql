-- Response length and truncation per policy version: how long answers are and how many hit the length limit.
--
-- Answers: are responses growing toward the limit (a truncation rate climbing
-- means the policy is learning to ramble, and truncated answers mostly fail)?
-- From trajectories: response_len (tokens of the response) and stop_reason
-- (max_length = cut at the generation limit). Every trajectory counts,
-- including failed ones.
--
-- Parameters:
-- @param run_id = NULL    only this experiment (NULL: every run)
--
-- Columns:
--   run_id, policy_version
--   trajectories                 rows
--   response_len_mean, response_len_p50, response_len_p95, response_len_max   response tokens
--   truncation_rate              share with stop_reason = 'max_length'
--   response_tokens              sum of response tokens
SELECT
    run_id,
    policy_version,
    count(*) AS trajectories,
    avg(response_len) AS response_len_mean,
    quantile_cont(response_len, 0.5) AS response_len_p50,
    quantile_cont(response_len, 0.95) AS response_len_p95,
    max(response_len) AS response_len_max,
    avg(CASE WHEN stop_reason = 'max_length' THEN 1.0 ELSE 0.0 END) AS truncation_rate,
    sum(response_len) AS response_tokens
FROM trajectories
WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
GROUP BY run_id, policy_version
ORDER BY run_id, policy_version
