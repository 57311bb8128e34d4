-- Admission, member checks: exclusions, reference configuration, freshness (one row per member of a ready group).
--
-- Input views (registered by pipeline/admission/engine_duckdb.py):
--   candidates       scalar member rows of undecided groups (pipeline/admission/candidates.py)
--   quality_rejects  trajectory_id -> reason for rows failing the great-expectations suite
-- A group is ready when all group_size members arrived or its oldest member
-- finished more than $group_timeout_s before $now.
-- Rules (docs/admission-rules.md), first matching reason wins:
--   quality:*  > infra_failed > expired > no_reward (UNKNOWN/ENV_ERROR verdict or null reward)
--   > out_of_vocabulary (a token id >= $vocab_size, when set; max_token_id null = not recorded)
--   > policy_/tokenizer_/template_/env_/verifier_/temperature_/top_p_/task_version_/harness_/
--     tool_schema_/prompt_/env_state_mismatch (first field that
--     differs from the group's reference configuration: the most common tuple among
--     members left after the exclusions; ties -> higher policy_version, then the
--     lexicographically smaller tuple)
--   > stale_policy (current - oldest sampled token version > $max_policy_lag)
--   > stale_wait (queue_wait_ms > $max_queue_wait_ms, when set)
-- @param current_policy_version
-- @param max_policy_lag = 1
-- @param max_queue_wait_ms = NULL
-- @param group_timeout_s = 600
-- @param now
-- @param vocab_size = NULL
-- Unordered: the caller sorts (group_id, trajectory_id) in Arrow, about half the cost of an ORDER BY here.
WITH arrived AS (
    SELECT group_id, count(*) AS arrived, max(group_size) AS group_size, min(finished_at) AS oldest_finish
    FROM candidates GROUP BY group_id
),
ready AS (
    SELECT group_id, arrived, group_size FROM arrived
    WHERE arrived >= group_size
       OR oldest_finish <= CAST($now AS TIMESTAMPTZ) - to_microseconds(CAST(round($group_timeout_s * 1e6) AS BIGINT))
),
m AS (
    SELECT c.*,
           CASE WHEN q.reason IS NOT NULL THEN q.reason
                WHEN c.status = 'INFRA_FAILED' THEN 'infra_failed'
                WHEN c.status = 'EXPIRED' THEN 'expired'
                WHEN c.verdict IN ('UNKNOWN', 'ENV_ERROR') OR c.reward IS NULL THEN 'no_reward'
                WHEN $vocab_size IS NOT NULL AND c.max_token_id >= $vocab_size THEN 'out_of_vocabulary'
           END AS member_reason
    FROM candidates c
    JOIN ready rd USING (group_id)
    LEFT JOIN quality_rejects q USING (trajectory_id)
),
cfg AS (
    SELECT group_id, policy_version, tokenizer_rev, prompt_template_rev, env_version,
           verifier_version, temperature, top_p, task_version, harness_version, tool_schema_version,
           prompt_hash, env_state_hash, count(*) AS n
    FROM m WHERE member_reason IS NULL
    GROUP BY ALL
),
ref AS (
    SELECT * FROM (
        SELECT *, row_number() OVER (
            PARTITION BY group_id
            ORDER BY n DESC, policy_version DESC, tokenizer_rev, prompt_template_rev, env_version,
                     verifier_version, temperature, top_p, task_version, harness_version,
                     tool_schema_version, prompt_hash, env_state_hash) AS rk
        FROM cfg)
    WHERE rk = 1
)
SELECT m.trajectory_id, m.group_id, m.group_size, m.content_hash, m.reward, m.queue_wait_ms, m.response_len,
       m.num_tool_calls, m.difficulty, m.run_id, m.task_id,
       CAST($current_policy_version AS BIGINT) - m.oldest_version AS policy_lag,
       COALESCE(m.member_reason,
           CASE WHEN m.policy_version <> r.policy_version THEN 'policy_mismatch'
                WHEN m.tokenizer_rev <> r.tokenizer_rev THEN 'tokenizer_mismatch'
                WHEN m.prompt_template_rev <> r.prompt_template_rev THEN 'template_mismatch'
                WHEN m.env_version <> r.env_version THEN 'env_mismatch'
                WHEN m.verifier_version <> r.verifier_version THEN 'verifier_mismatch'
                WHEN m.temperature <> r.temperature THEN 'temperature_mismatch'
                WHEN m.top_p <> r.top_p THEN 'top_p_mismatch'
                WHEN m.task_version <> r.task_version THEN 'task_version_mismatch'
                WHEN m.harness_version <> r.harness_version THEN 'harness_mismatch'
                WHEN m.tool_schema_version <> r.tool_schema_version THEN 'tool_schema_mismatch'
                WHEN m.prompt_hash <> r.prompt_hash THEN 'prompt_mismatch'
                WHEN m.env_state_hash <> r.env_state_hash THEN 'env_state_mismatch'
                WHEN CAST($current_policy_version AS BIGINT) - m.oldest_version > $max_policy_lag THEN 'stale_policy'
                WHEN $max_queue_wait_ms IS NOT NULL AND m.queue_wait_ms > $max_queue_wait_ms THEN 'stale_wait'
           END) AS reason,
       r.policy_version AS ref_policy_version, r.tokenizer_rev AS ref_tokenizer_rev,
       r.prompt_template_rev AS ref_prompt_template_rev, r.env_version AS ref_env_version,
       r.verifier_version AS ref_verifier_version, r.temperature AS ref_temperature,
       r.top_p AS ref_top_p, r.task_version AS ref_task_version, r.harness_version AS ref_harness_version,
       r.tool_schema_version AS ref_tool_schema_version, r.prompt_hash AS ref_prompt_hash,
       r.env_state_hash AS ref_env_state_hash
       /*COMPONENTS*/
FROM m LEFT JOIN ref r USING (group_id)
