-- Efficiency per policy version: tokens per trajectory, tool calls, turns, wall time and failure rates.
--
-- Answers: how much does one trajectory cost at each policy version, and how
-- often does the infrastructure (not the policy) fail? Token counts are the
-- lengths of prompt_ids / response_ids (the only columns here that touch the
-- token payload). Percentiles are continuous (linear interpolation).
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id, policy_version
--   trajectories
--   response_tokens_mean, response_tokens_p50, response_tokens_p95   len(response_ids)
--   prompt_tokens_mean                                               len(prompt_ids)
--   tool_calls_mean, tool_calls_p95, turns_mean, turns_p95
--   duration_s_p50, duration_s_p95      finished_at - created_at, seconds
--   infra_failed_rate    status INFRA_FAILED / trajectories
--   expired_rate         status EXPIRED / trajectories
--   env_error_rate       verdict ENV_ERROR or UNKNOWN / trajectories
--   no_reward_rate       reward null / trajectories
WITH t AS (
    SELECT
        run_id, policy_version, status, verdict, reward, num_tool_calls, num_turns,
        len(response_ids) AS response_tokens,
        len(prompt_ids) AS prompt_tokens,
        epoch_us(finished_at) - epoch_us(created_at) AS duration_us
    FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
)
SELECT
    run_id,
    policy_version,
    count(*) AS trajectories,
    avg(response_tokens) AS response_tokens_mean,
    quantile_cont(response_tokens, 0.5) AS response_tokens_p50,
    quantile_cont(response_tokens, 0.95) AS response_tokens_p95,
    avg(prompt_tokens) AS prompt_tokens_mean,
    avg(num_tool_calls) AS tool_calls_mean,
    quantile_cont(num_tool_calls, 0.95) AS tool_calls_p95,
    avg(num_turns) AS turns_mean,
    quantile_cont(num_turns, 0.95) AS turns_p95,
    quantile_cont(duration_us, 0.5) / 1e6 AS duration_s_p50,
    quantile_cont(duration_us, 0.95) / 1e6 AS duration_s_p95,
    avg(CASE WHEN status = 'INFRA_FAILED' THEN 1 ELSE 0 END) AS infra_failed_rate,
    avg(CASE WHEN status = 'EXPIRED' THEN 1 ELSE 0 END) AS expired_rate,
    avg(CASE WHEN verdict IN ('ENV_ERROR', 'UNKNOWN') THEN 1 ELSE 0 END) AS env_error_rate,
    avg(CASE WHEN reward IS NULL THEN 1 ELSE 0 END) AS no_reward_rate
FROM t
GROUP BY run_id, policy_version
ORDER BY run_id, policy_version
